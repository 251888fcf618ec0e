"""The gradients an optimizer steps, in one object per regime (issue 45: one room for the gradient
path). The engine, which owns the gradient averaging, chooses the regime once, when a model with a
DistributedOptimizer is partitioned, and hands it to the optimizer, which from then on talks only
to it:

- PlainGradients (plain.py): each parameter's own `.grad` (fp32, no sharded optimizer state);
- FlatGradients (flat.py): flat fp32 masters and ZeRO-1 chunks (shard_optimizer_state, bf16,
  fp16), whose gradient buffers the averaging fills (or, sharded, only their chunks);
- ShardedDataGradients (sharded_data.py): FSDP2's sharded parameters (sharded_data_parallel_degree).

Each answers the same interface (state.py's GradientState): the loss scale and overflow,
gradients_ready (unscale, check), zero_grad, clip, step (skipped after an overflow), and the
optimizer's state for state dicts and checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from smp.config import Config
from smp.data_parallel.grad_sync import GradSync
from smp.gradients.flat import FlatGradients
from smp.gradients.plain import PlainGradients
from smp.gradients.sharded_data import ShardedDataGradients
from smp.gradients.state import GradientState, follow_moves
from smp.groups import ParallelGroups
from smp.optim.loss_scale import LossScaler
from smp.sharded_data import ShardedModel


def choose(
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    config: Config,
    groups: ParallelGroups,
    counts: Callable[[torch.Tensor], bool],
    local_part: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    sync: GradSync | None,
    sharded_model: ShardedModel | None,
    shard_gradients: bool,
    fix_trained: Callable[[], None],
) -> GradientState:
    """The regime for `optimizer` over a partitioned model (see the module doc). `shard_gradients`:
    whether sharded optimizer state keeps only its chunk of the gradients (the engine decides:
    config "shard_gradients", or where it saves memory); `fix_trained`: makes the set of
    parameters that train final (flat state is built for it)."""
    common = (optimizer, scaler, groups, counts, local_part)
    if sharded_model is not None:
        return ShardedDataGradients(*common, fp16=config.fp16, model=sharded_model)
    if config.shard_optimizer_state or config.bf16 or config.fp16:
        sharded = bool(config.shard_optimizer_state) and groups.rdp_size > 1
        return FlatGradients(
            *common,
            fp16=config.fp16,
            sync=sync,
            sharded=sharded,
            shard_grads=sharded and shard_gradients,
            fix_trained=fix_trained,
        )
    return PlainGradients(*common, fp16=config.fp16)


__all__ = [
    "FlatGradients",
    "GradientState",
    "PlainGradients",
    "ShardedDataGradients",
    "choose",
    "follow_moves",
]
