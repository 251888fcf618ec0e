"""Data parallelism's part of parallelization: replicas start equal, and each parameter shared
by several pipeline stages gets a group joining its copies.

Replicated tensors come from the data-parallel group's first rank, tensor-parallel shards
from the reduced-data-parallel group's. Gradients are then averaged over the reduced-data-
parallel group only: the ranks of a tensor-parallel group run one batch (prescaled, or
their batches combined) and so already hold identical gradients of every replicated
parameter, which makes that average equal to SMP's data-parallel one, at less traffic.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import fx, nn

import smp.passes as passes
from smp._backend import BACKEND_NAME
from smp.groups import ParallelGroups
from smp.topology import CommGroup

# (parameter path, the parameter, the group of the stages holding a copy of it)
SharedParameter = tuple[str, nn.Parameter, dist.ProcessGroup]


def broadcast_over(
    tensors: Iterable[torch.Tensor], group: dist.ProcessGroup, ranks: tuple[int, ...]
) -> dist.ProcessGroup | None:
    """Gives every rank of `group` its first rank's values; returns the group if it has >1 rank."""
    if len(ranks) == 1:
        return None
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=ranks[0], group=group)
    return group


class BufferSlots:
    """A module's buffers by their slots, listed once: walking the modules every step was a host
    cost a step could see (docs/benchmarks.md, "Host overhead"). A buffer a module assigned anew
    since is read from its slot."""

    def __init__(self, module: nn.Module):
        self._slots = [(m, name) for m in module.modules() for name, _ in m.named_buffers(recurse=False)]

    def now(self) -> list[torch.Tensor]:
        tensors = {id(t): t for t in (getattr(m, name) for m, name in self._slots)}  # tied: once
        return [t for t in tensors.values() if t is not None]


def synchronize(
    module: nn.Module,
    distributed: set[int],
    shared: list[SharedParameter],
    groups: ParallelGroups,
) -> dist.ProcessGroup | None:
    """Makes the replicas (and the copies of shared parameters) equal; returns the group that
    averages gradients (None when this stage has no other replica)."""
    params = list(module.parameters())
    replicated = [p for p in params if id(p) not in distributed]
    broadcast_over(replicated + list(module.buffers()), groups.dp, groups.dp_ranks)
    grad_group = broadcast_over([p for p in params if id(p) in distributed], groups.rdp, groups.rdp_ranks)
    for _, p, group in shared:
        dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)
    return grad_group


def shared_groups(
    gm: fx.GraphModule,
    plans: list[passes.PartitionPlan],
    stage_ranks: tuple[int, ...],
    groups: ParallelGroups,
) -> list[SharedParameter]:
    """Process groups joining the copies of each parameter that stages on several pipeline ranks
    hold (`stage_ranks`: each stage's pipeline rank; created on every rank, in one order, for every
    pipeline); returns this rank's shared trainable parameters. Stages of one rank read one tensor,
    whose gradients add up in place: they need no group."""
    sharing: dict[str, set[int]] = {}  # parameter -> the pipeline ranks holding a copy
    for plan in plans:
        for name, stages in plan.shared_parameters.items():
            sharing.setdefault(name, set()).update(stage_ranks[s] for s in stages)
    sharing = {name: holders for name, holders in sharing.items() if len(holders) > 1}
    by_holders: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for holders in sorted({tuple(sorted(h)) for h in sharing.values()}):
        for ranks in groups.topology.all_groups(CommGroup.PP_GROUP):
            members = [ranks[r] for r in holders]
            group = dist.new_group(members, backend=BACKEND_NAME)
            if groups.rank in members:
                by_holders[holders] = group
    shared = []
    params = dict(gm.named_parameters(remove_duplicate=False))
    for name, holders in sorted(sharing.items()):
        if groups.pp_rank in holders and params[name].requires_grad:
            shared.append((name, params[name], by_holders[tuple(sorted(holders))]))
    return shared
