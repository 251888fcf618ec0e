// Argument checks and small helpers shared by the tensor-parallel ops.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <cstdint>

namespace smp::ops {

// Wraps a possibly negative dim into [0, t.dim()), or fails with an error
// naming the op, the dim and the tensor's shape.
int64_t wrapDim(const char* op, int64_t dim, const at::Tensor& t);

// Fails unless t is a floating-point tensor (float32/64, bfloat16, float16).
void checkFloating(const char* op, const char* name, const at::Tensor& t);

// Fails unless b has a's dtype and device.
void checkSameDtypeAndDevice(const char* op, const char* a_name,
                             const at::Tensor& a, const char* b_name,
                             const at::Tensor& b);

// Global ids mapped to this rank's shard [start, start + count).
struct LocalIds {
  at::Tensor local;    // ids - start where inside the shard, 0 elsewhere
  at::Tensor outside;  // bool: the id belongs to another rank's shard
};
LocalIds localIds(const at::Tensor& ids, int64_t start,
                  const c10::SymInt& count);

// Sum of the outer products grad^T . input over all leading dims:
// [..., m] x [..., n] -> [m, n] (the weight gradient of a linear layer).
at::Tensor weightGrad(const at::Tensor& grad, const at::Tensor& input);

// `t` as an output autograd does not take for a view of another tensor (the
// same storage, no copy). A custom Function's output that is a view cannot be
// changed in place afterwards ("a view ... created inside a custom Function"),
// and the ops after an smp op in a captured graph do that. Whether at::linear,
// movedim or contiguous return a view depends on the device and the shapes
// (at::linear does on CUDA for a 3-D input with a bias, not on the CPU).
at::Tensor ownOutput(const at::Tensor& t);

// Sum of grad over all leading dims: [..., m] -> [m].
at::Tensor biasGrad(const at::Tensor& grad);

}  // namespace smp::ops
