"""Sharded data parallelism (SMP v1's `sharded_data_parallel_degree`) on torch FSDP2.

`shard_model` puts each transformer layer (smp.sharded_data.units) and then the whole model (the
root unit: embeddings, final norm, head) under `fully_shard` over the sdp group: parameters,
gradients and optimizer state live as dim-0 shards (DTensors) on each rank, a unit's parameters
are all-gathered just before its forward and again before its backward, and its gradients are
reduce-scattered as its backward ends. Where sdp is smaller than the data-parallel degree the
mesh is two-dimensional (FSDP2's hybrid sharding): sdp groups shard, and the ranks holding the
same shard in each sdp group average their gradients.

SMP v1's knobs map to FSDP2's (config.py, README):
- bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the sharded parameters stay
  fp32 (they are the master weights), only gathered copies are bf16;
- sdp_param_persistence_threshold: a unit with fewer parameters stays gathered from its forward
  to its backward (reshard_after_forward=False), saving an all-gather;
- sdp_max_live_parameters: how many layers are gathered ahead (explicit prefetch, units.py);
- sdp_gradient_clipping: global L2 clipping of the sharded gradients before each optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from smp import params as param_facts
from smp.config import Config
from smp.data_parallel import replicas
from smp.groups import ParallelGroups
from smp.sharded_data import tensors, units

# Initializes the meta tensors of a module at a path (delayed parameter initialization).
Materialize = Callable[[nn.Module, str], None]


class ShardedModel:
    """A module under FSDP2 over the sdp group: its units, and what the optimizer asks of it."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh, layers: list[tuple[str, nn.Module]], clip: float):
        self.module, self.mesh, self.layers, self.clip = module, mesh, layers, clip

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the sharded gradients by their global norm over the whole model (a collective over
        the sdp group); returns the norm."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        norm = tensors.whole(norm)  # the DTensor of partial norms, reduced
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def clip_before_step(self) -> None:
        """SMP v1's sdp_gradient_clipping, applied before every optimizer step (<= 0: off)."""
        if self.clip > 0:
            self.clip_grad_norm(self.clip)


def shard_model(
    module: nn.Module,
    config: Config,
    groups: ParallelGroups,
    device: torch.device,
    materialize: Materialize | None = None,
) -> ShardedModel:
    """Shards `module` in place over this rank's sdp group and returns it as a ShardedModel.

    `materialize` (delayed initialization): called for each layer, then for the root, just before
    that unit is sharded, so only one layer is ever whole on a rank. Without it the module's
    parameters are real: they move to `device` and the data-parallel group takes the first
    rank's, so every rank shards the same values.
    """
    if materialize is None:
        module.to(device)
        replicas.broadcast_over(
            list(module.parameters()) + list(module.buffers()), groups.rdp, groups.rdp_ranks
        )
    mesh = _mesh(groups, device)
    layers = units.layer_units(module)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if config.bf16 else None, reduce_dtype=torch.float32
    )
    threshold = config.sdp_param_persistence_threshold
    for path, layer in [*layers, ("", module)]:
        if materialize is not None:
            materialize(layer, path)
        own = units.numel(layer) - sum(units.numel(m) for _, m in layers if layer is module)
        _shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=own >= threshold)
    _prefetch(layers, units.prefetch_depth(config.sdp_max_live_parameters, layers))
    return ShardedModel(module, mesh, layers, config.sdp_gradient_clipping)


def _shard(unit: nn.Module, **options) -> None:
    """fully_shard(unit): its parameters become new (DTensor) Parameters, which an optimizer built
    from the old ones follows (smp.params)."""
    before = dict(unit.named_parameters(remove_duplicate=False))
    fully_shard(unit, **options)
    after = dict(unit.named_parameters(remove_duplicate=False))
    for name, old in before.items():
        if after[name] is not old:
            param_facts.mark_moved(old, after[name])


def _mesh(groups: ParallelGroups, device: torch.device) -> DeviceMesh:
    """The sdp group as FSDP2's mesh; with replicas of it (sdp < data-parallel degree), the 2-D
    (replicate, shard) mesh of the reduced-data-parallel group."""
    if len(groups.sdp_replica_ranks) <= 1:
        return DeviceMesh.from_group(groups.sdp, device.type)
    layout = torch.tensor(groups.rdp_ranks).view(len(groups.sdp_replica_ranks), len(groups.sdp_ranks))
    return DeviceMesh.from_group(
        [groups.sdp_replica, groups.sdp], device.type, mesh=layout, mesh_dim_names=("replicate", "shard")
    )


def _prefetch(layers: list[tuple[str, nn.Module]], depth: int) -> None:
    if depth < 1:
        return
    modules = [m for _, m in layers]
    for i, m in enumerate(modules):
        m.set_modules_to_forward_prefetch(modules[i + 1 : i + 1 + depth])
        m.set_modules_to_backward_prefetch(modules[max(0, i - depth) : i][::-1])
