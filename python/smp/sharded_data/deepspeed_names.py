"""SMP v1's sharded data parallelism ran on DeepSpeed ZeRO-3, and its scripts read DeepSpeed's
names: on a parameter `ds_shape` and `ds_numel` (the whole parameter's) and `ds_tensor` (this
rank's shard, whose `ds_numel` is its size); on the optimizer `fp16_groups` (the parameters of
each group), `fp32_partitioned_groups_flat` (per group, this rank's fp32 shards flattened end to
end, in the group's order), `ds_param_shard_group` (the group a parameter is sharded over) and
`_global_grad_norm` (the gradient norm of the last step). smp's sdp is FSDP2: the names answer
for its sharded parameters, read-only (the scripts count parameters, log norms and record shapes
for their checkpoints with them).

- `name_parameter(p)` puts the parameter's names on a sharded parameter (FSDP2's DTensor); its
  `ds_tensor` is a view of the local shard, so it follows the optimizer's in-place updates.
- `optimizer_attribute(name, optimizer, sharded)` answers the optimizer's names (None if `name` is
  not one of them); `fp32_partitioned_groups_flat` is a copy made when read.
"""

from __future__ import annotations

from typing import Any

import torch

OPTIMIZER_NAMES = frozenset(
    {"fp16_groups", "fp32_partitioned_groups_flat", "ds_param_shard_group", "_global_grad_norm"}
)


def name_parameter(p: torch.Tensor) -> None:
    """DeepSpeed's names on a sharded parameter (a DTensor: its shape is the whole parameter's)."""
    shard = p.to_local()
    shard.ds_numel = shard.numel()
    p.ds_shape = p.shape
    p.ds_numel = p.numel()
    p.ds_tensor = shard


def optimizer_attribute(name: str, optimizer: torch.optim.Optimizer, sharded) -> Any:
    """DeepSpeed's optimizer attribute `name`, for a model sharded by `sharded` (a ShardedModel)."""
    if sharded is None:
        raise AttributeError(
            f"smp.DistributedOptimizer has no {name!r}: it is DeepSpeed ZeRO-3's name, which SMP v1's "
            "sharded data parallelism answered; set sharded_data_parallel_degree > 1 for it"
        )
    groups = [list(g["params"]) for g in optimizer.param_groups]
    if name == "fp16_groups":
        return groups
    if name == "fp32_partitioned_groups_flat":
        return [_flat_shards(params) for params in groups]
    if name == "ds_param_shard_group":
        return sharded.shard_group
    return sharded.last_grad_norm


def _flat_shards(params: list[torch.Tensor]) -> torch.Tensor:
    shards = [getattr(p, "ds_tensor", p).detach().reshape(-1).float() for p in params]
    return torch.cat(shards) if shards else torch.zeros(0)
