// Context parallelism's communication ops, over the sequence cut in the
// load-balanced layout (cp_layout.h), each with the exact adjoint as its
// backward (every rank's copy of a replicated value is its own, and the
// gradients of the parameters are averaged over the cp group):
//   cp_gather:   this rank's segments -> the whole sequence (all_gather, then
//                chunks put in order); backward reduce_scatter (sum).
//   cp_reduce:   partial sums -> the total (all_reduce sum); backward the
//                same, since every rank's copy of the total feeds its loss.
//   cp_to_heads: sequence cut -> heads cut (Ulysses' all-to-all): this rank's
//                1/C of the heads over the whole sequence, in order.
//   cp_to_seq:   its inverse. Each is the other's backward.

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "collectives.h"
#include "common.h"
#include "cp_layout.h"

namespace smp::ops {

at::Tensor chunksInOrder(const at::Tensor& x, int64_t dim, int64_t size,
                         bool inverse) {
  const int64_t chunks = 2 * size;
  std::vector<int64_t> order(chunks);
  for (int64_t rank = 0; rank < size; ++rank) {
    for (int64_t segment = 0; segment < 2; ++segment) {
      const int64_t gathered = 2 * rank + segment;
      const int64_t chunk = chunkOf(rank, segment, size);
      // order[to] = from: sequence order reads the gathered block holding
      // each chunk; the inverse reads each chunk at its sequence place.
      order[inverse ? gathered : chunk] = inverse ? chunk : gathered;
    }
  }
  // Slices and one cat (no index tensor): fake and symbolic sizes trace it,
  // so the autograd kernels run under torch.compile's fake tensors too.
  const c10::SymInt length = x.sym_size(dim) / chunks;
  std::vector<at::Tensor> parts;
  parts.reserve(chunks);
  for (const int64_t from : order) {
    parts.push_back(x.narrow_symint(dim, length * from, length));
  }
  return at::cat(parts, dim);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void checkChunks(const char* op, const at::Tensor& x, int64_t dim,
                 int64_t chunks, const char* what) {
  TORCH_CHECK(x.sym_size(dim) % chunks == 0, op, ": the ", what, " (dim ", dim,
              ", size ", x.sym_size(dim), ") does not divide into ", chunks,
              " chunks; shape ", x.sym_sizes());
}

at::Tensor gatherInOrder(const at::Tensor& x, int64_t dim,
                         const std::string& group_name) {
  const int64_t size = groupSize(group_name);
  return chunksInOrder(allGather(x, dim, group_name), dim, size, false);
}

at::Tensor scatterSum(const at::Tensor& grad, int64_t dim,
                      const std::string& group_name) {
  const int64_t size = groupSize(group_name);
  return reduceScatter(chunksInOrder(grad, dim, size, true), dim, group_name);
}

// Heads (dim h, divisible by C) out to their ranks, the sequence (dim s, this
// rank's two segments) in: this rank's 1/C of the heads over the whole
// sequence, in sequence order.
at::Tensor toHeads(const at::Tensor& x, int64_t s, int64_t h,
                   const std::string& group_name) {
  const int64_t size = groupSize(group_name);
  // [.., H, ..] -> [C, .., H/C, ..]: the destination rank first, as
  // all_to_all sends it; every original dim i is now at i + 1.
  at::Tensor blocks =
      x.unflatten_symint(h,
                         std::vector<c10::SymInt>{size, x.sym_size(h) / size})
          .movedim(h, 0);
  at::Tensor got = allToAll(blocks, group_name);  // [source rank, ...]
  // Each source rank's segments go before its sequence dim, in rank order.
  at::Tensor sequence = got.movedim(0, s).flatten(s, s + 1);
  return chunksInOrder(sequence, s, size, false);
}

// The inverse of toHeads: this rank's heads over the whole sequence (dim s)
// -> all heads (dim h) over this rank's segments.
at::Tensor toSeq(const at::Tensor& y, int64_t s, int64_t h,
                 const std::string& group_name) {
  const int64_t size = groupSize(group_name);
  at::Tensor gathered = chunksInOrder(y, s, size, true);
  at::Tensor blocks =
      gathered
          .unflatten_symint(
              s, std::vector<c10::SymInt>{size, gathered.sym_size(s) / size})
          .movedim(s, 0);
  at::Tensor got = allToAll(blocks, group_name);  // [source rank's heads, ...]
  return got.movedim(0, h).flatten(h, h + 1);
}

void checkHeadsAndSeq(const char* op, const at::Tensor& x, int64_t s, int64_t h,
                      const std::string& group_name, bool to_heads) {
  TORCH_CHECK(s != h, op, ": the sequence and head dims are both ", s);
  const int64_t size = groupSize(group_name);
  if (to_heads) {
    checkChunks(op, x, h, size, "head count");
    checkChunks(op, x, s, 2, "local sequence");
  } else {
    checkChunks(op, x, s, 2 * size, "sequence");
  }
}

class CpGatherFn : public torch::autograd::Function<CpGatherFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            int64_t dim, const std::string& group_name) {
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["group_name"] = group_name;
    return gatherInOrder(x, dim, group_name);
  }

  static variable_list backward(AutogradContext* ctx,
                                const variable_list& grads) {
    // Every rank's copy of the whole sequence fed its own loss: this rank's
    // segments get the sum of all copies' gradients.
    return {scatterSum(grads[0], ctx->saved_data["dim"].toInt(),
                       ctx->saved_data["group_name"].toStringRef()),
            at::Tensor(), at::Tensor()};
  }
};

class CpReduceFn : public torch::autograd::Function<CpReduceFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const std::string& group_name) {
    ctx->saved_data["group_name"] = group_name;
    return allReduce(x, "sum", group_name);
  }

  static variable_list backward(AutogradContext* ctx,
                                const variable_list& grads) {
    return {
        allReduce(grads[0], "sum", ctx->saved_data["group_name"].toStringRef()),
        at::Tensor()};
  }
};

template <bool kToHeads>
class CpAllToAllFn : public torch::autograd::Function<CpAllToAllFn<kToHeads>> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            int64_t s, int64_t h,
                            const std::string& group_name) {
    ctx->saved_data["s"] = s;
    ctx->saved_data["h"] = h;
    ctx->saved_data["group_name"] = group_name;
    return kToHeads ? toHeads(x, s, h, group_name) : toSeq(x, s, h, group_name);
  }

  static variable_list backward(AutogradContext* ctx,
                                const variable_list& grads) {
    const int64_t s = ctx->saved_data["s"].toInt();
    const int64_t h = ctx->saved_data["h"].toInt();
    const std::string& group = ctx->saved_data["group_name"].toStringRef();
    at::Tensor grad = kToHeads ? toSeq(grads[0], s, h, group)
                               : toHeads(grads[0], s, h, group);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor cpGather(const at::Tensor& x, int64_t dim,
                    const std::string& group_name) {
  const int64_t d = wrapDim("smp::cp_gather", dim, x);
  checkChunks("smp::cp_gather", x, d, 2, "local sequence");
  return gatherInOrder(x, d, group_name);
}

at::Tensor cpGatherAutograd(const at::Tensor& x, int64_t dim,
                            const std::string& group_name) {
  const int64_t d = wrapDim("smp::cp_gather", dim, x);
  checkChunks("smp::cp_gather", x, d, 2, "local sequence");
  return CpGatherFn::apply(x, d, group_name);
}

at::Tensor cpReduce(const at::Tensor& x, const std::string& group_name) {
  return allReduce(x, "sum", group_name);
}

at::Tensor cpReduceAutograd(const at::Tensor& x,
                            const std::string& group_name) {
  return CpReduceFn::apply(x, group_name);
}

template <bool kToHeads>
at::Tensor cpAllToAll(const at::Tensor& x, int64_t seq_dim, int64_t head_dim,
                      const std::string& group_name) {
  const char* op = kToHeads ? "smp::cp_to_heads" : "smp::cp_to_seq";
  const int64_t s = wrapDim(op, seq_dim, x);
  const int64_t h = wrapDim(op, head_dim, x);
  checkHeadsAndSeq(op, x, s, h, group_name, kToHeads);
  return kToHeads ? toHeads(x, s, h, group_name) : toSeq(x, s, h, group_name);
}

template <bool kToHeads>
at::Tensor cpAllToAllAutograd(const at::Tensor& x, int64_t seq_dim,
                              int64_t head_dim, const std::string& group_name) {
  const char* op = kToHeads ? "smp::cp_to_heads" : "smp::cp_to_seq";
  const int64_t s = wrapDim(op, seq_dim, x);
  const int64_t h = wrapDim(op, head_dim, x);
  checkHeadsAndSeq(op, x, s, h, group_name, kToHeads);
  return CpAllToAllFn<kToHeads>::apply(x, s, h, group_name);
}

}  // namespace
}  // namespace smp::ops

TORCH_LIBRARY_IMPL(smp, CPU, m) {
  m.impl("cp_gather", &smp::ops::cpGather);
  m.impl("cp_reduce", &smp::ops::cpReduce);
  m.impl("cp_to_heads", &smp::ops::cpAllToAll<true>);
  m.impl("cp_to_seq", &smp::ops::cpAllToAll<false>);
}

TORCH_LIBRARY_IMPL(smp, CUDA, m) {
  m.impl("cp_gather", &smp::ops::cpGather);
  m.impl("cp_reduce", &smp::ops::cpReduce);
  m.impl("cp_to_heads", &smp::ops::cpAllToAll<true>);
  m.impl("cp_to_seq", &smp::ops::cpAllToAll<false>);
}

TORCH_LIBRARY_IMPL(smp, Autograd, m) {
  m.impl("cp_gather", &smp::ops::cpGatherAutograd);
  m.impl("cp_reduce", &smp::ops::cpReduceAutograd);
  m.impl("cp_to_heads", &smp::ops::cpAllToAllAutograd<true>);
  m.impl("cp_to_seq", &smp::ops::cpAllToAllAutograd<false>);
}
