// Collectives for the tensor-parallel ops, reached through the dispatcher as
// torch's functional collectives (_c10d_functional::*), by process-group
// name. Called inside kernels and autograd functions, so that torch.compile
// (AOTAutograd) traces them into visible _c10d_functional nodes.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace smp::ops {

// Number of ranks in the group registered under group_name.
int64_t groupSize(const std::string& group_name);

// This process's rank in the group registered under group_name.
int64_t groupRank(const std::string& group_name);

// all_reduce(input, reduce_op) followed by wait_tensor: a new tensor, the
// input is left alone. reduce_op is "sum", "max", ... as in
// _c10d_functional::all_reduce.
at::Tensor allReduce(const at::Tensor& input, const std::string& reduce_op,
                     const std::string& group_name);

// all_gather_into_tensor along dimension `dim` (already wrapped, >= 0):
// the group's tensors concatenated along dim in group-rank order.
at::Tensor allGather(const at::Tensor& input, int64_t dim,
                     const std::string& group_name);

// all_to_all_single with uneven splits (rows of dim 0): input_splits[r]
// rows go to rank r, output_splits[r] rows come from it, in group-rank order.
at::Tensor allToAll(const at::Tensor& input,
                    const std::vector<int64_t>& output_splits,
                    const std::vector<int64_t>& input_splits,
                    const std::string& group_name);

// reduce_scatter_tensor (sum) along dimension `dim` (already wrapped, >= 0):
// the input's size there divides by the group size, and this rank keeps the
// sum of every rank's block number group-rank.
at::Tensor reduceScatter(const at::Tensor& input, int64_t dim,
                         const std::string& group_name);

// all_to_all_single on dimension 0 (its size divides by the group size):
// block j of the input goes to rank j, and the output's block i came from
// rank i.
at::Tensor allToAll(const at::Tensor& input, const std::string& group_name);

}  // namespace smp::ops
