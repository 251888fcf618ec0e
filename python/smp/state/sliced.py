"""A rank's part of a tensor described by where it sits in the whole: the layout-free unit of
smp's checkpoints.

Every layout cuts a tensor of the original model in its own way: a pipeline stage holds some
tensors whole, tensor parallelism holds a slice along one dimension (or one slice of each of
`blocks` fused parts, e.g. q, k and v), and sharded optimizer state holds a contiguous range of
the flattened local tensor, which is not a rectangle of it. `Slices` says which rectangles of
the global tensor a rank holds, each with a view of the rank's own memory. A checkpoint stores
the rectangles with their global coordinates, so a reader on any other layout asks for its
own rectangles and gets them assembled from whatever was written.

`Slices` implements torch.distributed.checkpoint's extension protocol (the one DTensor
implements: __create_write_items__, __create_chunk_list__, __get_tensor_shard__), so DCP saves
and loads it with its planner, files and resharding: on save the views are read, on load they
are written in place.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

import smp.passes as passes

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclasses.dataclass(frozen=True)
class Placement:
    """How a rank's local tensor sits in the global one: whole, or its shard over a group (of
    tensor parallelism, or with `expert`, the ep group's block of experts: tp_rank and tp_size are
    then the rank in that group and its size)."""

    global_shape: tuple[int, ...]
    spec: passes.ShardSpec | None = None
    tp_rank: int = 0
    tp_size: int = 1
    expert: bool = False

    @staticmethod
    def of(local_shape, spec: passes.ShardSpec | None, tp_rank: int, tp_size: int) -> Placement:
        shape = list(local_shape)
        if spec is not None:
            shape[spec.dim] *= tp_size
        return Placement(tuple(shape), spec, tp_rank, tp_size)

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        if self.spec is not None:
            shape[self.spec.dim] //= self.tp_size
        return tuple(shape)

    def to_global(self, box: Box) -> list[tuple[Box, Box]]:
        """(global box, the part of `box` it covers, relative to `box`) for a box of the local
        tensor: one piece, or several where the box crosses blocks of a fused shard."""
        offsets, sizes = box
        if self.spec is None:
            return [(box, (tuple(0 for _ in sizes), sizes))]
        dim, blocks = self.spec.dim, self.spec.blocks
        local_block = self.local_shape()[dim] // blocks  # this rank's slice of each block
        global_block = self.global_shape[dim] // blocks
        pieces = []
        lo, hi = offsets[dim], offsets[dim] + sizes[dim]
        while lo < hi:
            b, within = divmod(lo, local_block)
            n = min(hi - lo, local_block - within)
            g_off = list(offsets)
            g_off[dim] = b * global_block + self.tp_rank * local_block + within
            g_size = list(sizes)
            g_size[dim] = n
            rel_off = [0] * len(sizes)
            rel_off[dim] = lo - offsets[dim]
            pieces.append(((tuple(g_off), tuple(g_size)), (tuple(rel_off), tuple(g_size))))
            lo += n
        return pieces


def range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The rectangles that elements [start, stop) of a row-major tensor of `shape` make, in
    order; each is a contiguous run of the flattened tensor."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    rest = tuple(shape[1:])
    if r0 == r1:
        return [((r0, *o), (1, *s)) for o, s in range_boxes(rest, c0, c1)]
    boxes = []
    if c0:
        boxes += [((r0, *o), (1, *s)) for o, s in range_boxes(rest, c0, inner)]
        r0 += 1
    if r1 > r0:
        boxes.append(((r0, *(0,) * len(rest)), (r1 - r0, *rest)))
    if c1:
        boxes += [((r1, *o), (1, *s)) for o, s in range_boxes(rest, 0, c1)]
    return boxes


class Slices:
    """Rectangles of one global tensor held by this rank, each with a view of this rank's memory."""

    def __init__(self, global_shape, dtype: torch.dtype):
        self.global_shape = torch.Size(global_shape)
        self.dtype = dtype
        self.pieces: list[tuple[tuple[int, ...], torch.Tensor]] = []  # (global offsets, view)

    def add_local(self, local: torch.Tensor, placement: Placement) -> Slices:
        """All of `local` (a whole local tensor: a parameter, or state shaped like one)."""
        whole = ((0,) * local.dim(), tuple(local.shape))
        return self._add_box(local, whole, placement)

    def add_range(self, flat: torch.Tensor, start: int, placement: Placement) -> Slices:
        """`flat`, a 1-D run of the flattened local tensor beginning at element `start` (a
        sharded optimizer's chunk of a parameter)."""
        local_shape = placement.local_shape()
        pos = 0
        for box in range_boxes(local_shape, start, start + flat.numel()):
            n = math.prod(box[1])
            self._add_box(flat[pos : pos + n].view(box[1]), box, placement)
            pos += n
        return self

    def _add_box(self, data: torch.Tensor, box: Box, placement: Placement) -> Slices:
        for (g_off, g_size), (rel_off, _) in placement.to_global(box):
            view = data
            for d, (o, n) in enumerate(zip(rel_off, g_size, strict=True)):
                if o or n != view.shape[d]:
                    view = view.narrow(d, o, n)
            self.pieces.append((g_off, view))
        return self

    # --- torch.distributed.checkpoint's extension protocol ------------------------------

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets), i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), view.shape),
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.global_shape,
                ),
            )
            for i, (offsets, view) in enumerate(self.pieces)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offsets), view.shape) for offsets, view in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.pieces):
            offsets, view = self.pieces[index.index]
            if torch.Size(offsets) == index.offset:
                return view
        for offsets, view in self.pieces:
            if torch.Size(offsets) == index.offset:
                return view
        raise ValueError(f"smp: no slice at {tuple(index.offset)} of {index.fqn}")

    def fill_from(self, whole: torch.Tensor) -> None:
        """Copies this rank's rectangles out of the whole tensor (a full checkpoint's)."""
        if tuple(whole.shape) != tuple(self.global_shape):
            raise ValueError(
                f"smp: the checkpoint's tensor has shape {tuple(whole.shape)}, this model's "
                f"{tuple(self.global_shape)}"
            )
        with torch.no_grad():
            for offsets, view in self.pieces:
                part = whole
                for d, (o, n) in enumerate(zip(offsets, view.shape, strict=True)):
                    part = part.narrow(d, o, n)
                view.copy_(part)


def assemble(pieces: list[tuple[tuple[int, ...], torch.Tensor]], shape, dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor from rectangles that cover it (a full checkpoint's writer)."""
    whole = torch.empty(tuple(shape), dtype=dtype)
    for offsets, data in pieces:
        part = whole
        for d, (o, n) in enumerate(zip(offsets, data.shape, strict=True)):
            part = part.narrow(d, o, n)
        part.copy_(data)
    return whole
