"""The module's structure with meta tensors of the full shapes, taken before partitioning.

By the time a later input signature is captured, each rank holds only its stages' parameters
(the others' were freed) and tensor parallelism replaced full weights by shards. A later
signature is captured on the full module structure with the Skeleton's meta tensors swapped into
every parameter and buffer slot; its stage graphs then read this rank's real tensors
(`make_real`): parameters never move and optimizer state stays put. A graph that would need a
tensor this rank does not hold (the new shapes changed where an op runs) is an error naming it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

_TABLES = ("_parameters", "_buffers")


class Skeleton:
    """Every parameter and buffer slot of a module, with a meta tensor of the tensor's full shape
    (tied tensors share theirs), taken before the module was partitioned."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        """`compute_dtype`: the metas of floating-point parameters have it (sharded data parallelism
        keeps fp32 parameters that compute in bf16: graphs are captured as they run)."""
        self.module = module  # what later signatures are captured on, with the metas swapped in
        self._slots: list[tuple[nn.Module, str, str, torch.Tensor]] = []
        self._path: dict[int, str] = {}  # id(meta tensor) -> its first name in the module
        self._slot: dict[int, tuple[nn.Module, str, str]] = {}
        self._metas: list[torch.Tensor] = []  # one per distinct tensor
        metas: dict[int, torch.Tensor] = {}
        for prefix, owner in module.named_modules(remove_duplicate=False):
            for table in _TABLES:
                for name, t in getattr(owner, table).items():
                    if t is None:
                        continue
                    if id(t) not in metas:
                        dtype = compute_dtype if compute_dtype and table == "_parameters" else None
                        metas[id(t)] = _meta_like(t, dtype if t.is_floating_point() else None)
                        self._metas.append(metas[id(t)])
                        self._path[id(metas[id(t)])] = f"{prefix}.{name}" if prefix else name
                        self._slot[id(metas[id(t)])] = (owner, table, name)
                    self._slots.append((owner, table, name, metas[id(t)]))

    @contextlib.contextmanager
    def swapped_in(self):
        """The module with the meta tensors in every slot (restored after)."""
        saved = [
            (owner, table, name, getattr(owner, table).get(name)) for owner, table, name, _ in self._slots
        ]
        try:
            for owner, table, name, meta in self._slots:
                getattr(owner, table)[name] = meta
            yield
        finally:
            for owner, table, name, t in saved:
                getattr(owner, table)[name] = t

    def holders(self) -> dict[int, torch.Tensor]:
        """id(meta) -> the tensor in its slot now (what a graph captured on the metas reads)."""
        return {id(meta): self.local(meta) for meta in self._metas}

    def local(self, meta: torch.Tensor) -> torch.Tensor | None:
        """The tensor this rank holds now in the slot `meta` stands for (None: freed here)."""
        owner, table, name = self._slot[id(meta)]
        return getattr(owner, table).get(name)

    def metas(self) -> list[torch.Tensor]:
        return list(self._metas)

    def name(self, meta: torch.Tensor) -> str:
        return self._path.get(id(meta), "?")

    def knows(self, t: torch.Tensor) -> bool:
        return id(t) in self._slot


def make_real(stage_module: nn.Module, skeleton: Skeleton, stage: int) -> None:
    """Points the stage graph's meta tensors at the real ones this rank holds, checking each is here
    and has the shape the graph was captured with."""
    for owner in stage_module.modules():
        for table in _TABLES:
            slots = getattr(owner, table)
            for name, t in list(slots.items()):
                if t is None or not t.is_meta:
                    continue
                real = skeleton.local(t) if skeleton.knows(t) else None
                if real is None or real.shape != t.shape or real.is_meta:
                    where = "is not held on this stage" if real is None else f"is {tuple(real.shape)} here"
                    raise RuntimeError(
                        f"smp: the graph captured for a new input signature reads {skeleton.name(t)} "
                        f"{tuple(t.shape)} on pipeline stage {stage}, but that tensor {where}: the new "
                        "shapes moved an op to another stage or changed a tensor-parallel decision, and "
                        "parameters cannot move after the first step; pad inputs to the first step's "
                        "shapes (tokenizer padding='max_length'), or mark the partition explicitly "
                        "(smp.partition / auto_partition=False)"
                    )
                slots[name] = real


def _meta_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    meta = torch.empty(t.shape, dtype=dtype or t.dtype, device="meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(meta, requires_grad=t.requires_grad)
    return meta
