// smp's custom ops (TORCH_LIBRARY namespace "smp"): the plain
// forward kernels, registered for CPU and CUDA and called by the autograd
// kernels' forwards. See ops/README.md for the schemas and the math.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace smp::ops {

// input [..., in] (replicated), weight [out_local, in], bias [out_local]:
// input @ weight^T + bias. No communication.
at::Tensor columnParallelLinear(const at::Tensor& input,
                                const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias,
                                const std::string& group_name);

// input [..., in_local] (sharded), weight [out, in_local], bias [out]:
// all_reduce_sum(input @ weight^T) + bias.
at::Tensor rowParallelLinear(const at::Tensor& input, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias,
                             const std::string& group_name);

// weight [V_local, D] = rows [vocab_start, vocab_start + V_local) of the
// table: all_reduce_sum of the local lookup, zero rows for other ranks' ids.
at::Tensor vocabParallelEmbedding(const at::Tensor& indices,
                                  const at::Tensor& weight, int64_t vocab_start,
                                  int64_t padding_idx,
                                  const std::string& group_name);

// logits [..., V_local], target [...]: per-element cross entropy over the
// full vocabulary (0 where target == ignore_index).
at::Tensor vocabParallelCrossEntropy(const at::Tensor& logits,
                                     const at::Tensor& target,
                                     int64_t vocab_start, int64_t ignore_index,
                                     const std::string& group_name);

// The same, also returning the float32 (float64 for float64 logits)
// logsumexp over the full vocabulary, which the backward reuses.
std::tuple<at::Tensor, at::Tensor> vocabParallelCrossEntropyWithLse(
    const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
    int64_t ignore_index, const std::string& group_name);

// all_gather along dim, concatenated in group-rank order.
at::Tensor tpGather(const at::Tensor& input, int64_t dim,
                    const std::string& group_name);

// This rank's contiguous slice along dim (a copy).
at::Tensor tpSplit(const at::Tensor& input, int64_t dim, double grad_scale,
                   const std::string& group_name);

// all_reduce sum.
at::Tensor tpReduce(const at::Tensor& input, const std::string& group_name);
at::Tensor tpCopy(const at::Tensor& input, const std::string& group_name);

// Expert parallelism (moe.cpp): hidden [N, H], top_k_index [N, k] ->
// (the pairs routed to this rank's experts [M, H], expert-major; their count
// per local expert [E / ranks]; the route moe_combine takes).
std::tuple<at::Tensor, at::Tensor, at::Tensor> moeDispatch(
    const at::Tensor& hidden, const at::Tensor& top_k_index,
    int64_t num_experts, const std::string& group_name);

// expert_out [M, H] (moe_dispatch's rows), weights [N, k], route ->
// ([N, H]: each token's k expert outputs back home, weighted and summed;
// those outputs [N * k, H], token-major, which the weights' gradient reads).
std::tuple<at::Tensor, at::Tensor> moeCombine(const at::Tensor& expert_out,
                                              const at::Tensor& weights,
                                              const at::Tensor& route,
                                              const std::string& group_name);

}  // namespace smp::ops
