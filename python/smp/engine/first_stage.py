"""A step's inputs are the first pipeline stage's (SMP v1's rule).

SMP v1's scripts load data only where `smp.pp_rank() == 0`; the other stages call the step
function with placeholders (`torch.Tensor(0)` batches from a dummy dataset). Whatever a later
stage needs of the inputs, SMP sent it from the first stage. Here the first stage broadcasts the
tensors of its step arguments over the pipeline group at the start of each step, and every
stage calls the step function with them: the arguments the other stages passed are not read
(only their structure must match: the same containers with the same number of tensors).
Later stages then hold real inputs, so what smp computes again from the inputs on a later stage
(masks, labels reshaped: smp.passes.split) is what the first stage computes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from smp import faults
from smp.groups import ParallelGroups


def arguments(args: tuple, kwargs: dict, groups: ParallelGroups, device: torch.device) -> tuple[tuple, dict]:
    """(args, kwargs) with every tensor replaced by the first stage's (a collective over the
    pipeline group; returns them unchanged with one stage)."""
    if groups.pp_size == 1:
        return args, kwargs
    leaves, spec = pytree.tree_flatten((args, kwargs))
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    first = groups.pp_rank == 0
    if first:
        leaves = [leaf.to(device).contiguous() if i in at else leaf for i, leaf in enumerate(leaves)]
    # Every stage learns the first stage's shapes and every stage's count (all-gathered, so that a
    # stage whose arguments do not match makes every stage raise, not the others wait for it).
    mine = ([(tuple(leaves[i].shape), leaves[i].dtype) for i in at] if first else None, len(at))
    told: list = [None] * groups.pp_size
    where = faults.group_of("pipeline", groups.pp)
    with faults.waiting("the step's inputs from the first pipeline stage", where):
        dist.all_gather_object(told, mine, group=groups.pp)
    shapes = told[0][0]
    counts = [count for _, count in told]
    if len(set(counts)) > 1:
        raise ValueError(
            f"smp.step: the pipeline stages called the step function with {counts} tensor arguments "
            "(stage by stage); every stage must call it with the same arguments. A later stage's tensors "
            "are replaced by the first stage's, so placeholders such as torch.Tensor(0) are fine, but "
            "their number must match"
        )
    source = groups.pp_ranks[0]
    with faults.waiting("the step's inputs from the first pipeline stage", where):
        for i, (shape, dtype) in zip(at, shapes, strict=True):
            tensor = leaves[i] if first else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=source, group=groups.pp)
            leaves[i] = tensor
    return pytree.tree_unflatten(leaves, spec)
