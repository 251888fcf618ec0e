"""Global gradient-norm clipping across stages, tensor-parallel shards and optimizer chunks.

Each rank adds up the squares of the gradient elements it is the one to count (see
Engine.counts_in_norm and the optimizer's chunks); one all-reduce over the world gives
the global norm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from smp import params as param_facts


def check_norm_type(norm_type: float, name: str) -> None:
    if norm_type != 2.0:
        raise ValueError(f"smp: {name} supports the L2 norm (norm_type=2), got {norm_type}")


def first_holder(rdp_rank: int, ep_size: int) -> Callable[[torch.Tensor], bool]:
    """Whether this rank is the first reduced-data-parallel replica holding a whole parameter, the
    one to count it: rdp rank 0, and for an expert parameter (different on each rank of an ep group,
    a block of consecutive replicas) every rank of the first ep group."""
    return lambda p: rdp_rank < ep_size if param_facts.is_expert(p) else rdp_rank == 0


def unsharded_squares(
    params: Iterable[torch.nn.Parameter],
    counts: Callable[[torch.Tensor], bool],
    first_replica: Callable[[torch.Tensor], bool],
) -> torch.Tensor:
    """Squares of whole gradients, which every reduced-data-parallel replica holds (experts: every
    replica of an ep rank): the first replica holding each (`first_holder`) counts it."""
    return squares_of(
        [p.grad.detach() for p in params if p.grad is not None and counts(p) and first_replica(p)]
    )


def squares_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of every element of `tensors`, on the host in fp64: one foreach
    kernel and one copy to the host per device, not one per tensor (on CUDA each .cpu() is a
    sync); each tensor's norm accumulated in fp32, squared in fp64."""
    total = torch.zeros((), dtype=torch.float64)
    for group in _by_device(tensors):
        total += torch.stack(torch._foreach_norm(group, 2.0, dtype=torch.float32)).double().pow(2).sum().cpu()
    return total


def _by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return list(groups.values())


def clip(local_squares: torch.Tensor, max_norm: float, scale: Callable[[float], None]) -> torch.Tensor:
    """The global norm from every rank's `local_squares`; calls scale(coef) when it exceeds max_norm."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local_squares)
    norm = local_squares.sqrt().float()
    coef = max_norm / (norm.item() + 1e-6)
    if coef < 1.0 and torch.isfinite(norm):
        scale(coef)
    return norm


def clip_whole(
    params: Iterable[torch.nn.Parameter],
    counts: Callable[[torch.Tensor], bool],
    max_norm: float,
    first_replica: Callable[[torch.Tensor], bool],
):
    """clip() over the whole gradients of `params` (no optimizer chunks)."""
    params = [p for p in params if p.grad is not None]

    def scale(coef: float) -> None:
        for group in _by_device([p.grad for p in params]):
            torch._foreach_mul_(group, coef)

    return clip(unsharded_squares(params, counts, first_replica), max_norm, scale)
