// Vocabulary-parallel embedding and cross entropy: each rank of the group
// holds a contiguous slice [vocab_start, vocab_start + V_local) of the
// vocabulary (rows of the embedding table, columns of the LM head's logits).
// Neither op ever gathers the full table or the full logits.

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

constexpr const char* kEmbedding = "smp::vocab_parallel_embedding";
constexpr const char* kCrossEntropy = "smp::vocab_parallel_cross_entropy";

void checkEmbedding(const at::Tensor& indices, const at::Tensor& weight,
                    int64_t vocab_start, int64_t padding_idx) {
  TORCH_CHECK(
      indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt,
      kEmbedding, ": indices must be int64 or int32, got ",
      indices.scalar_type());
  checkFloating(kEmbedding, "weight", weight);
  TORCH_CHECK(indices.device() == weight.device(), kEmbedding,
              ": indices are on ", indices.device(), " but weight is on ",
              weight.device());
  TORCH_CHECK(weight.dim() == 2, kEmbedding,
              ": weight must be 2-D [V_local, embedding_dim], got shape ",
              weight.sym_sizes());
  TORCH_CHECK(vocab_start >= 0, kEmbedding, ": vocab_start must be >= 0, got ",
              vocab_start);
  TORCH_CHECK(padding_idx >= -1, kEmbedding,
              ": padding_idx must be a global row id >= 0, or -1 for none; "
              "got ",
              padding_idx);
}

// Accumulation dtype of the cross entropy: float32 for half types.
at::ScalarType accType(const at::Tensor& logits) {
  const auto t = logits.scalar_type();
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

void checkCrossEntropy(const at::Tensor& logits, const at::Tensor& target,
                       int64_t vocab_start) {
  checkFloating(kCrossEntropy, "logits", logits);
  TORCH_CHECK(target.scalar_type() == at::kLong, kCrossEntropy,
              ": target must be int64 class ids, got ", target.scalar_type());
  TORCH_CHECK(logits.device() == target.device(), kCrossEntropy,
              ": logits are on ", logits.device(), " but target is on ",
              target.device());
  TORCH_CHECK(logits.dim() >= 1, kCrossEntropy,
              ": logits must be [..., V_local], got a 0-d tensor");
  TORCH_CHECK(logits.sym_size(-1) > 0, kCrossEntropy,
              ": this rank's vocabulary slice is empty (logits shape ",
              logits.sym_sizes(), ")");
  const auto batch = logits.sym_sizes().slice(0, logits.dim() - 1);
  TORCH_CHECK(target.sym_sizes() == batch, kCrossEntropy, ": target shape ",
              target.sym_sizes(),
              " must equal the logits' shape without the last dimension ",
              batch, " (logits shape ", logits.sym_sizes(), ")");
  TORCH_CHECK(vocab_start >= 0, kCrossEntropy,
              ": vocab_start must be >= 0, got ", vocab_start);
}

class VocabParallelEmbeddingFn
    : public torch::autograd::Function<VocabParallelEmbeddingFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& indices,
                            const at::Tensor& weight, int64_t vocab_start,
                            int64_t padding_idx,
                            const std::string& group_name) {
    ctx->save_for_backward({indices});
    ctx->saved_data["num_rows"] = weight.sym_size(0);
    ctx->saved_data["vocab_start"] = vocab_start;
    ctx->saved_data["padding_idx"] = padding_idx;
    return vocabParallelEmbedding(indices, weight, vocab_start, padding_idx,
                                  group_name);
  }

  static variable_list backward(AutogradContext* ctx,
                                const variable_list& grad_outputs) {
    variable_list grads(5);
    if (!ctx->needs_input_grad(1)) {
      return grads;
    }
    const at::Tensor indices = ctx->get_saved_variables()[0];
    const c10::SymInt rows = ctx->saved_data["num_rows"].toSymInt();
    const int64_t start = ctx->saved_data["vocab_start"].toInt();
    const int64_t padding_idx = ctx->saved_data["padding_idx"].toInt();
    const auto ids = localIds(indices, start, rows);
    // Rows of other ranks' ids contribute nothing; the padding row gets no
    // gradient, as in nn.Embedding.
    const at::Tensor grad =
        grad_outputs[0].masked_fill(ids.outside.unsqueeze(-1), 0);
    c10::SymInt local_padding = -1;
    if (padding_idx >= start && rows + start > padding_idx) {
      local_padding = padding_idx - start;
    }
    grads[1] = at::embedding_dense_backward_symint(grad, ids.local, rows,
                                                   local_padding, false);
    return grads;
  }
};

class VocabParallelCrossEntropyFn
    : public torch::autograd::Function<VocabParallelCrossEntropyFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, int64_t vocab_start,
                            int64_t ignore_index,
                            const std::string& group_name) {
    auto [loss, lse] = vocabParallelCrossEntropyWithLse(
        logits, target, vocab_start, ignore_index, group_name);
    ctx->save_for_backward({logits, target, lse});
    ctx->saved_data["vocab_start"] = vocab_start;
    ctx->saved_data["ignore_index"] = ignore_index;
    return loss;
  }

  static variable_list backward(AutogradContext* ctx,
                                const variable_list& grad_outputs) {
    variable_list grads(5);
    if (!ctx->needs_input_grad(0)) {
      return grads;
    }
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& logits = saved[0];
    const at::Tensor& target = saved[1];
    const at::Tensor& lse = saved[2];
    const int64_t start = ctx->saved_data["vocab_start"].toInt();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const auto acc = accType(logits);
    // d loss / d logit_c = softmax_c - [c == target], softmax over the full
    // vocabulary: exp(logit_c - logsumexp).
    const at::Tensor softmax = (logits.to(acc) - lse.unsqueeze(-1)).exp();
    const auto ids = localIds(target, start, logits.sym_size(-1));
    const at::Tensor onehot = at::zeros_like(softmax).scatter(
        -1, ids.local.unsqueeze(-1),
        ids.outside.logical_not().to(acc).unsqueeze(-1));
    const at::Tensor grad =
        grad_outputs[0].to(acc).masked_fill(target.eq(ignore_index), 0);
    grads[0] = ((softmax - onehot) * grad.unsqueeze(-1)).to(logits.dtype());
    return grads;
  }
};

// Arguments are checked before Function::apply builds any autograd state
// (see linear.cpp).
at::Tensor vocabParallelEmbeddingAutograd(const at::Tensor& indices,
                                          const at::Tensor& weight,
                                          int64_t vocab_start,
                                          int64_t padding_idx,
                                          const std::string& group_name) {
  checkEmbedding(indices, weight, vocab_start, padding_idx);
  return VocabParallelEmbeddingFn::apply(indices, weight, vocab_start,
                                         padding_idx, group_name);
}

at::Tensor vocabParallelCrossEntropyAutograd(const at::Tensor& logits,
                                             const at::Tensor& target,
                                             int64_t vocab_start,
                                             int64_t ignore_index,
                                             const std::string& group_name) {
  checkCrossEntropy(logits, target, vocab_start);
  return VocabParallelCrossEntropyFn::apply(logits, target, vocab_start,
                                            ignore_index, group_name);
}

}  // namespace

at::Tensor vocabParallelEmbedding(const at::Tensor& indices,
                                  const at::Tensor& weight, int64_t vocab_start,
                                  int64_t padding_idx,
                                  const std::string& group_name) {
  checkEmbedding(indices, weight, vocab_start, padding_idx);
  const auto ids = localIds(indices, vocab_start, weight.sym_size(0));
  const at::Tensor local = at::embedding_symint(weight, ids.local)
                               .masked_fill(ids.outside.unsqueeze(-1), 0);
  return allReduce(local, "sum", group_name);
}

std::tuple<at::Tensor, at::Tensor> vocabParallelCrossEntropyWithLse(
    const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
    int64_t ignore_index, const std::string& group_name) {
  checkCrossEntropy(logits, target, vocab_start);
  const at::Tensor x = logits.to(accType(logits));
  // The logit of the target class, from the rank that owns the class (0 on
  // the others), and the full vocabulary's max and sum of exps: three
  // scalars per row cross the group, never the logits. The two sums travel
  // in one all_reduce.
  const auto ids = localIds(target, vocab_start, logits.sym_size(-1));
  const at::Tensor target_logit = x.gather(-1, ids.local.unsqueeze(-1))
                                      .squeeze(-1)
                                      .masked_fill(ids.outside, 0);
  const at::Tensor max = allReduce(x.amax(-1), "max", group_name);
  const at::Tensor sum_exp = (x - max.unsqueeze(-1)).exp().sum(-1);
  const at::Tensor sums =
      allReduce(at::stack({sum_exp, target_logit}), "sum", group_name);
  at::Tensor lse = sums.select(0, 0).log() + max;
  at::Tensor loss = (lse - sums.select(0, 1))
                        .masked_fill(target.eq(ignore_index), 0)
                        .to(logits.scalar_type());
  return {std::move(loss), std::move(lse)};
}

at::Tensor vocabParallelCrossEntropy(const at::Tensor& logits,
                                     const at::Tensor& target,
                                     int64_t vocab_start, int64_t ignore_index,
                                     const std::string& group_name) {
  return std::get<0>(vocabParallelCrossEntropyWithLse(
      logits, target, vocab_start, ignore_index, group_name));
}

}  // namespace smp::ops

TORCH_LIBRARY_IMPL(smp, CPU, m) {
  m.impl("vocab_parallel_embedding", &smp::ops::vocabParallelEmbedding);
  m.impl("vocab_parallel_cross_entropy", &smp::ops::vocabParallelCrossEntropy);
}

TORCH_LIBRARY_IMPL(smp, CUDA, m) {
  m.impl("vocab_parallel_embedding", &smp::ops::vocabParallelEmbedding);
  m.impl("vocab_parallel_cross_entropy", &smp::ops::vocabParallelCrossEntropy);
}

TORCH_LIBRARY_IMPL(smp, Autograd, m) {
  m.impl("vocab_parallel_embedding", &smp::ops::vocabParallelEmbeddingAutograd);
  m.impl("vocab_parallel_cross_entropy",
         &smp::ops::vocabParallelCrossEntropyAutograd);
}
