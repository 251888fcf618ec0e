"""The model's inputs under tensor parallelism.

With prescaled_batch=True the ranks of a TP group read the same batch. Otherwise each
reads its own, and the group runs the concatenation: tensor inputs whose dim 0 is the
microbatch size are all-gathered along dim 0 (rank order), and the tensor-parallel pass
cuts each output back to this rank's rows. Inputs without the batch on dim 0 (position
tables, flags) must be equal across the group; the first step checks that, as it checks
that a prescaled batch really is the same on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from smp.groups import ParallelGroups


def combine(
    args: tuple, kwargs: dict, batch_size: int | None, prescaled: bool, check: bool, groups: ParallelGroups
):
    """The inputs the tensor-parallel group runs; with `check`, verifies what must be equal is."""
    group = groups.tp
    leaves, spec = pytree.tree_flatten((args, kwargs))
    out: list[Any] = []
    for i, leaf in enumerate(leaves):
        batched = (
            not prescaled
            and isinstance(leaf, torch.Tensor)
            and leaf.dim() >= 1
            and batch_size is not None
            and leaf.shape[0] == batch_size
        )
        if batched:
            leaf = torch.ops.smp.tp_gather(leaf.contiguous(), 0, group.group_name)
        elif check and isinstance(leaf, torch.Tensor):
            _check_equal(leaf, i, groups, prescaled)
        out.append(leaf)
    return pytree.tree_unflatten(out, spec)


def _check_equal(tensor: torch.Tensor, index: int, groups: ParallelGroups, prescaled: bool) -> None:
    group = groups.tp
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    if all(torch.equal(parts[0], p) for p in parts[1:]):
        return
    if prescaled:
        fix = (
            "with prescaled_batch=True every rank of a tensor-parallel group must read the same batch "
            "(shard data by smp.rdp_rank()/smp.rdp_size(), not dp_rank)"
        )
    else:
        fix = (
            "with prescaled_batch=False tensor parallelism combines the batches of the group along dim 0, "
            "so batch inputs must have the microbatch size on dim 0 and other inputs must be equal on "
            "every rank (or set prescaled_batch=True)"
        )
    raise ValueError(
        f"smp: model input {index} (shape {tuple(tensor.shape)}) differs between the ranks of the "
        f"tensor-parallel group {list(groups.tp_ranks)}; {fix}"
    )
