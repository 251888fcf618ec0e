// The load-balanced layout of a sequence cut over a context-parallel group
// of C ranks: the sequence is 2C chunks of equal length, and rank r holds
// chunk r followed by chunk 2C-1-r, so that under causal attention every rank
// has the same work (an early chunk with few keys, a late one with many).

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace smp::ops {

// The chunk (in sequence order) that segment 0 or 1 of rank `rank` holds.
inline int64_t chunkOf(int64_t rank, int64_t segment, int64_t size) {
  return segment == 0 ? rank : 2 * size - 1 - rank;
}

// x's dimension `dim` holds the group's segments in group-rank order (rank
// 0's two, then rank 1's, ...): the same chunks in sequence order. With
// `inverse`, from sequence order back to group-rank order.
at::Tensor chunksInOrder(const at::Tensor& x, int64_t dim, int64_t size,
                         bool inverse);

}  // namespace smp::ops
