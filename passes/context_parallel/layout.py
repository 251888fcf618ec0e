"""Where the sequence is in a value, and the arithmetic of cutting it.

The sequence (length S) is cut load-balanced over C ranks: 2C chunks of S / 2C positions, rank r
holding chunk r followed by chunk 2C-1-r. A value holding the sequence on dimension `dim` is
described by `Cut(dim, pre, post)`: that dimension is the flattening of (pre, S, post) (a plain
sequence dimension has pre = post = 1; flattening [B, S, V] to [B * S, V] gives Cut(0, B, 1)),
and the cut keeps this rank's positions of the middle factor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Cut:
    dim: int
    pre: int = 1
    post: int = 1

    def moved(self, dim: int) -> Cut:
        return Cut(dim, self.pre, self.post)


@dataclasses.dataclass(frozen=True)
class Sequence_:
    """The cut sequence: its length, the group's size and this rank's place in it."""

    length: int
    size: int
    rank: int

    @property
    def chunk(self) -> int:
        return self.length // (2 * self.size)

    @property
    def local(self) -> int:
        return self.length // self.size

    def chunks(self) -> tuple[int, int]:
        """The two chunks this rank holds, in its order."""
        return self.rank, 2 * self.size - 1 - self.rank

    def positions(self) -> list[int]:
        return [p for c in self.chunks() for p in range(c * self.chunk, (c + 1) * self.chunk)]

    def full_size(self, cut: Cut) -> int:
        return cut.pre * self.length * cut.post

    def local_shape(self, shape: Sequence[int], cut: Cut) -> list[int]:
        out = list(shape)
        out[cut.dim] = cut.pre * self.local * cut.post
        return out


def aligned(cut: Cut, ndim_from: int, ndim_to: int) -> Cut | None:
    """The cut of a broadcast operand with `ndim_from` dims seen in a result of `ndim_to` dims
    (aligned from the right), or None when the operand lacks that dim."""
    dim = cut.dim + ndim_to - ndim_from
    return cut.moved(dim) if dim >= 0 else None


def view_cut(in_shape: Sequence[int], out_shape: Sequence[int], cut: Cut, length: int) -> Cut | None:
    """The cut of a view (reshape) of a value cut by `cut`, or None when the view splits or
    merges the sequence with dims in a way no Cut describes (it would break the positions up).

    In row-major order the sequence factor has `inner` elements after it and `outer` before; the
    view keeps it whole when some output dim spans it: the dims after that one hold a divisor of
    `inner` and the dim itself the rest of `inner` (post), the sequence and part of `outer` (pre).
    """
    inner = cut.post * math.prod(in_shape[cut.dim + 1 :])
    tail = 1
    for dim in range(len(out_shape) - 1, -1, -1):
        size = out_shape[dim]
        if inner % tail == 0:
            post = inner // tail
            if size % (length * post) == 0 and size >= length * post:
                if tail * size >= inner * length:
                    return Cut(dim, size // (length * post), post)
        tail *= size
        if tail > inner:
            break
    return None
