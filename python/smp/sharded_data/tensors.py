"""A sharded parameter (FSDP2's DTensor, dim 0 cut over the sdp group) spoken of as a part of
the whole tensor: its rows, its place in the flattened whole, the whole gathered, a whole copied
in. State dicts and checkpoints use these; nothing else reads DTensor internals."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard


def is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's own memory of `t` (its rows, for a sharded tensor)."""
    return t.to_local() if is_sharded(t) else t


def first_row(t: DTensor) -> int:
    """The first row of the whole tensor that this rank's shard holds (FSDP2 cuts dim 0 as
    torch.chunk does: ceil(rows / N) each, the last ones shorter or empty)."""
    row = 0
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"smp: a sharded parameter cut along dim {placement.dim}; smp expects dim 0")
            parts = t.device_mesh.size(mesh_dim)
            chunk = math.ceil(t.shape[0] / parts) if t.dim() else 0
            row = min(chunk * t.device_mesh.get_local_rank(mesh_dim), t.shape[0])
    return row


def flat_start(t: DTensor) -> int:
    """Where this rank's shard begins in the flattened whole tensor."""
    return first_row(t) * math.prod(t.shape[1:])


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective over the sdp group for a sharded one)."""
    return t.full_tensor() if is_sharded(t) else t


def copy_whole_into(t: torch.Tensor, full: torch.Tensor) -> None:
    """Writes this rank's part of `full` (the whole tensor) into `t`."""
    if not is_sharded(t):
        t.copy_(full)
        return
    mine = t.to_local()
    row = first_row(t)
    mine.copy_(full[row : row + mine.shape[0]])


def like(param: DTensor, local_part: torch.Tensor) -> DTensor:
    """A DTensor shaped and cut as `param` over `local_part`'s memory (optimizer state loaded
    into place)."""
    return DTensor.from_local(
        local_part,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
