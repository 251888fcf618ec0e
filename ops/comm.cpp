// Communication-only ops, the glue between sharded and replicated layouts:
// tp_gather (shards -> replicated), tp_split (replicated -> shards) and
// tp_reduce (partial sums -> replicated) and tp_copy (replicated input of
// several column-parallel layers), each with the conjugate backward.

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "collectives.h"
#include "common.h"
#include "tp_ops.h"

namespace smp::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The length of this rank's slice of input along d (dim wrapped); fails
// unless the group size divides the dimension.
c10::SymInt splitLength(const at::Tensor& input, int64_t d, int64_t dim,
                        const std::string& group_name) {
  const int64_t size = groupSize(group_name);
  const c10::SymInt& length = input.sym_size(d);
  TORCH_CHECK(length % size == 0, "smp::tp_split: the size of dim ", dim, " (",
              length, ") does not divide by the group size (", size,
              "); input shape ", input.sym_sizes());
  return length / size;
}

class TpGatherFn : public torch::autograd::Function<TpGatherFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            int64_t dim, const std::string& group_name) {
    const int64_t d = wrapDim("smp::tp_gather", dim, input);
    ctx->saved_data["dim"] = d;
    ctx->saved_data["size"] = input.sym_size(d);
    ctx->saved_data["group_name"] = group_name;
    return tpGather(input, dim, group_name);
  }

  static variable_list backward(AutogradContext* ctx,
                                const variable_list& grad_outputs) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const c10::SymInt size = ctx->saved_data["size"].toSymInt();
    const int64_t rank = groupRank(ctx->saved_data["group_name"].toStringRef());
    // This rank's block of the gathered gradient.
    at::Tensor grad =
        grad_outputs[0].narrow_symint(dim, size * rank, size).contiguous();
    return {grad, at::Tensor(), at::Tensor()};
  }
};

class TpSplitFn : public torch::autograd::Function<TpSplitFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            int64_t dim, double grad_scale,
                            const std::string& group_name) {
    ctx->saved_data["dim"] = wrapDim("smp::tp_split", dim, input);
    ctx->saved_data["grad_scale"] = grad_scale;
    ctx->saved_data["group_name"] = group_name;
    return tpSplit(input, dim, grad_scale, group_name);
  }

  static variable_list backward(AutogradContext* ctx,
                                const variable_list& grad_outputs) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const double grad_scale = ctx->saved_data["grad_scale"].toDouble();
    at::Tensor grad = allGather(grad_outputs[0], dim,
                                ctx->saved_data["group_name"].toStringRef());
    if (grad_scale != 1.0) {
      grad = grad.mul(grad_scale);
    }
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class TpReduceFn : public torch::autograd::Function<TpReduceFn> {
 public:
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& input,
                            const std::string& group_name) {
    return tpReduce(input, group_name);
  }

  static variable_list backward(AutogradContext* /*ctx*/,
                                const variable_list& grad_outputs) {
    // The output is replicated, so its gradient is too: every input
    // contributed to it with weight one.
    return {grad_outputs[0], at::Tensor()};
  }
};

class TpCopyFn : public torch::autograd::Function<TpCopyFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const std::string& group_name) {
    ctx->saved_data["group_name"] = group_name;
    return tpCopy(input, group_name);
  }

  static variable_list backward(AutogradContext* ctx,
                                const variable_list& grad_outputs) {
    // Each rank's consumers saw the same input but computed different output
    // slices: the input's gradient is the sum of every rank's part.
    return {allReduce(grad_outputs[0], "sum",
                      ctx->saved_data["group_name"].toStringRef()),
            at::Tensor()};
  }
};

// Arguments are checked before Function::apply builds any autograd state
// (see linear.cpp).
at::Tensor tpGatherAutograd(const at::Tensor& input, int64_t dim,
                            const std::string& group_name) {
  wrapDim("smp::tp_gather", dim, input);
  return TpGatherFn::apply(input, dim, group_name);
}

at::Tensor tpSplitAutograd(const at::Tensor& input, int64_t dim,
                           double grad_scale, const std::string& group_name) {
  splitLength(input, wrapDim("smp::tp_split", dim, input), dim, group_name);
  return TpSplitFn::apply(input, dim, grad_scale, group_name);
}

at::Tensor tpReduceAutograd(const at::Tensor& input,
                            const std::string& group_name) {
  return TpReduceFn::apply(input, group_name);
}

at::Tensor tpCopyAutograd(const at::Tensor& input,
                          const std::string& group_name) {
  groupSize(group_name);  // a bad group name fails here
  return TpCopyFn::apply(input, group_name);
}

}  // namespace

at::Tensor tpGather(const at::Tensor& input, int64_t dim,
                    const std::string& group_name) {
  return allGather(input, wrapDim("smp::tp_gather", dim, input), group_name);
}

at::Tensor tpSplit(const at::Tensor& input, int64_t dim, double /*grad_scale*/,
                   const std::string& group_name) {
  const int64_t d = wrapDim("smp::tp_split", dim, input);
  const c10::SymInt chunk = splitLength(input, d, dim, group_name);
  // A copy: the output must not alias the input.
  return input.narrow_symint(d, chunk * groupRank(group_name), chunk)
      .clone(at::MemoryFormat::Contiguous);
}

at::Tensor tpReduce(const at::Tensor& input, const std::string& group_name) {
  return allReduce(input, "sum", group_name);
}

at::Tensor tpCopy(const at::Tensor& input, const std::string& group_name) {
  groupSize(group_name);  // resolves the group now: a bad name fails here
  return input.clone();   // the output must not alias the input
}

}  // namespace smp::ops

TORCH_LIBRARY_IMPL(smp, CPU, m) {
  m.impl("tp_gather", &smp::ops::tpGather);
  m.impl("tp_split", &smp::ops::tpSplit);
  m.impl("tp_reduce", &smp::ops::tpReduce);
  m.impl("tp_copy", &smp::ops::tpCopy);
}

TORCH_LIBRARY_IMPL(smp, CUDA, m) {
  m.impl("tp_gather", &smp::ops::tpGather);
  m.impl("tp_split", &smp::ops::tpSplit);
  m.impl("tp_reduce", &smp::ops::tpReduce);
  m.impl("tp_copy", &smp::ops::tpCopy);
}

TORCH_LIBRARY_IMPL(smp, Autograd, m) {
  m.impl("tp_gather", &smp::ops::tpGatherAutograd);
  m.impl("tp_split", &smp::ops::tpSplitAutograd);
  m.impl("tp_reduce", &smp::ops::tpReduceAutograd);
  m.impl("tp_copy", &smp::ops::tpCopyAutograd);
}
