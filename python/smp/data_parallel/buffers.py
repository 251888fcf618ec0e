"""Gradient buffers and buckets for smp.data_parallel.grad_sync: flat buffers holding parameters'
gradients (a parameter in the buffer's dtype has its .grad a view; a bf16/fp16 one is added into
its fp32 view), the buckets averaged as ranges of them, and the sharded groups (ZeRO-2) whose
buckets hold storage of their own until their average is taken into the rank's chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

IN_FLIGHT = 2  # sharded gradients: buckets being averaged at once (each holds its storage)


@dataclasses.dataclass
class Bucket:
    params: list[torch.nn.Parameter]
    flat: torch.Tensor | None  # the range of a gradient buffer with their gradients (averaged in place)
    # Sharded gradients: the range [lo, hi) of its group's layout, the storage (allocated at the
    # first gradient, freed once averaged), and the group.
    lo: int = 0
    hi: int = 0
    storage: torch.Tensor | None = None
    shard: Shard | None = None
    experts: bool = False  # expert parameters: combined over the replicas holding the same experts

    def sharded_view(self, p: torch.nn.Parameter) -> torch.Tensor:
        """p's part of the storage (allocated now if it is not yet)."""
        if self.storage is None:
            self.storage = torch.zeros(self.hi - self.lo, dtype=torch.float32, device=p.device)
        start = self.shard.offset_of[id(p)] - self.lo
        return self.storage[start : start + p.numel()].view_as(p)


@dataclasses.dataclass
class Shard:
    """An optimizer's param group whose gradients are kept as this rank's chunk only: the
    parameters laid out end to end (`offsets`), and the chunk [lo, lo + len(grad)) of that layout
    whose averaged gradient goes to `grad`."""

    params: list[torch.nn.Parameter]
    offsets: list[int]
    lo: int
    grad: torch.Tensor
    whole: list[torch.nn.Parameter]  # of `params`, those whose gradient is kept whole (shared ones)

    def __post_init__(self):
        self.offset_of = {id(p): off for p, off in zip(self.params, self.offsets, strict=True)}

    def take_whole(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Copies the chunk's part of a whole-kept parameter's final gradient into `grad`."""
        off = self.offset_of[id(p)]
        start, end = max(off, self.lo), min(off + p.numel(), self.lo + self.grad.numel())
        if start < end:
            self.grad[start - self.lo : end - self.lo].copy_(grad.reshape(-1)[start - off : end - off])

    def take(self, bucket: Bucket, storage: torch.Tensor) -> None:
        """Copies the chunk's part of an averaged bucket into `grad`."""
        start, end = max(bucket.lo, self.lo), min(bucket.hi, self.lo + self.grad.numel())
        if start < end:
            self.grad[start - self.lo : end - self.lo].copy_(storage[start - bucket.lo : end - bucket.lo])


@dataclasses.dataclass
class Buffer:
    """A flat gradient buffer and the parameters laid out in it."""

    grads: torch.Tensor
    params: list[torch.nn.Parameter]
    offsets: list[int]

    @property
    def low(self) -> bool:
        """Whether its parameters are bf16/fp16 accumulated in fp32 (else their grads are views)."""
        return bool(self.params) and self.params[0].dtype != self.grads.dtype

    def views(self):
        for p, off in zip(self.params, self.offsets, strict=True):
            yield p, self.grads[off : off + p.numel()].view_as(p)


def own_buffers(
    params: list[torch.nn.Parameter], fp32: bool, old: Mapping[int, torch.Tensor]
) -> list[Buffer]:
    """One buffer per (gradient dtype, device) for `params`, in their order, holding the gradients
    they have so far (a view of an earlier buffer, or .grad). The gradient dtype is the parameter's,
    except fp32 for bf16/fp16 ones when accumulating in fp32."""
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in params:
        low = fp32 and p.dtype in (torch.bfloat16, torch.float16)
        groups.setdefault((torch.float32 if low else p.dtype, p.device, low), []).append(p)
    buffers = []
    for (dtype, device, _), group in groups.items():
        offsets, total = [], 0
        for p in group:
            offsets.append(total)
            total += p.numel()
        buffer = Buffer(torch.zeros(total, dtype=dtype, device=device), group, offsets)
        with torch.no_grad():
            for p, view in buffer.views():
                before = old.get(id(p))
                if before is None and p.grad is not None:
                    before = p.grad
                if before is not None:
                    view.copy_(before)
        buffers.append(buffer)
    return buffers


def attach_grad(p: torch.nn.Parameter, view: torch.Tensor) -> None:
    """Makes `view` p's grad, holding p's current gradient (zero if none): autograd then
    accumulates into it in place."""
    if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
        return
    if p.grad is None:
        view.zero_()
    else:
        view.copy_(p.grad)
    p.grad = view


def split_into_buckets(
    params: list[torch.nn.Parameter], cap_bytes: int, kind=lambda p: None
) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype, device and `kind` (averaged over the same group), about
    cap_bytes each."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0

    def key(p: torch.nn.Parameter) -> tuple:
        return (p.dtype, p.device, kind(p))

    for p in params:
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > cap_bytes or key(buckets[-1][0]) != key(p):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def worth_sharding(
    replicas: int, backwards: int, windowed: bool, on_cuda: bool, grad_bytes: int, bucket_bytes: int
) -> bool:
    """The rule for sharded gradients left unset (config "shard_gradients": null): on where they save
    memory without costing time. Replicas to average, one microbatch and no accumulation over steps
    (else every bucket lives through the whole backward), CUDA parameters (on the host each step's
    fresh bucket storage costs page faults, which slow the step: docs/benchmarks.md, "Bytes per
    parameter a rank holds"; CUDA's caching allocator reuses the blocks), and more saved than the
    buckets in flight cost, twice over (small models keep their whole gradients, and torch's .grad)."""
    if replicas < 2 or backwards != 1 or windowed or not on_cuda:
        return False
    saved = grad_bytes * (1 - 1 / replicas)
    return saved > 2 * (IN_FLIGHT + 1) * bucket_bytes
