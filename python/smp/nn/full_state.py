"""Between a distributed module's state_dict (this rank's shards) and the whole state_dict the
dense model would have (the same keys, whole tensors): what a full checkpoint holds and what
the Hugging Face translate functions read and write.

Both are collectives over the tensor-parallel group when it has more than one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from smp.nn import tp_group
from smp.nn.distributed_module import shard_dims


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """module.state_dict() with every shard all-gathered into the whole tensor (a collective)."""
    state = module.state_dict()
    group, size = tp_group.tp_group(), tp_group.tp_size()
    for name, dim in shard_dims(module).items():
        local = state[name].contiguous()
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        state[name] = torch.cat(parts, dim)
    return state


def load_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True):
    """Loads a whole state_dict (the dense model's shapes) into the module's shards."""
    cuts = shard_dims(module)
    size, rank = tp_group.tp_size(), tp_group.tp_rank()
    local = {}
    for name, value in state_dict.items():
        if name in cuts:
            if value.shape[cuts[name]] % size:
                raise ValueError(
                    f"smp.nn: {name} has {value.shape[cuts[name]]} entries along dimension {cuts[name]}, "
                    f"which does not divide by the tensor-parallel degree {size}; is it a whole tensor?"
                )
            value = value.chunk(size, cuts[name])[rank]
        local[name] = value
    return module.load_state_dict(local, strict=strict)
