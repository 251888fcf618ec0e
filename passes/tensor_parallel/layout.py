"""Layouts: how a value of the rewritten graph is held across the tensor-parallel group.

A value is replicated (None: every rank holds the whole tensor) or a Shard: cut along `dim`
into `size` contiguous slices, rank r holding the r-th; with blocks > 1 the dimension is
first seen as `blocks` equal parts and each part is cut that way (a fused q/k/v projection's
output: each rank holds its slice of q, of k and of v). An op that returns several tensors
(split, chunk) has a list of layouts, one per result.

A parameter's ShardSpec is the same cut, stored with the parameter so that it can be sliced
from the full weight and put back together.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch


class Shard(NamedTuple):
    dim: int
    blocks: int = 1


# None for replicated; a list (of layouts) for the results of an op that returns several tensors.
Layout = Shard | list[Any] | None


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How a parameter is split over the group: along `dim`, each of `blocks` parts separately."""

    dim: int
    blocks: int = 1

    def local(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        parts = full.unflatten(self.dim, (self.blocks, -1))
        shard = parts.chunk(size, dim=self.dim + 1)[rank].flatten(self.dim, self.dim + 1).contiguous()
        # A slice of leading rows is already contiguous: a view that would keep the whole
        # weight's storage alive for as long as the shard lives. Own memory instead.
        return (
            shard.clone()
            if shard.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
            else shard
        )

    def full(self, shards: list[torch.Tensor]) -> torch.Tensor:
        parts = [s.unflatten(self.dim, (self.blocks, -1)) for s in shards]
        return torch.cat(parts, dim=self.dim + 1).flatten(self.dim, self.dim + 1)

    @property
    def layout(self) -> Shard:
        return Shard(self.dim, self.blocks)


def local_val(val, layout: Layout, size: int):
    """The fake value one rank holds of `val` (a fake tensor or a list of them) in `layout`."""
    if layout is None or val is None:
        return val
    if isinstance(layout, list):
        return [local_val(v, lay, size) for v, lay in zip(val, layout, strict=True)]
    shape = list(val.shape)
    shape[layout.dim] //= size
    return val.new_empty(shape)


def view_dim(before: list[int], after: list[int], dim: int) -> int | None:
    """Where dimension `dim` of `before` lands in `after` as the leading factor of its group
    (split into heads, or merged with later dimensions), or None if it does not: only then does
    a view keep the slices of a value sharded on `dim` contiguous, so each rank can view its own."""
    prefix = math.prod(before[:dim])
    n = before[dim]
    j, acc = 0, 1
    while j < len(after) and (acc < prefix or after[j] == 1):
        acc *= after[j]
        j += 1
    if j == len(after) or acc != prefix:
        return None
    m = after[j]
    if m == n:
        return j
    if m < n:  # split: n = m * (later dims of after)
        return j if n % m == 0 and _covers(after[j:], n) else None
    return j if m % n == 0 and _covers(before[dim:], m) else None  # merge


def _covers(dims: list[int], total: int) -> bool:
    """Whether a run of leading `dims` multiplies to exactly `total`."""
    acc = 1
    for d in dims:
        acc *= d
        if acc == total:
            return True
        if acc > total:
            return False
    return False
