"""Sharded data parallelism (SMP v1's `sharded_data_parallel_degree`) on torch FSDP2.

`shard_model` puts each transformer layer (smp.sharded_data.units) and then the whole model (the
root unit: embeddings, final norm, head) under `fully_shard` over the sdp group: parameters,
gradients and optimizer state live as dim-0 shards (DTensors) on each rank, a unit's parameters
are all-gathered just before its forward and again before its backward, and its gradients are
reduce-scattered as its backward ends. Where sdp is smaller than the data-parallel degree the
mesh is two-dimensional (FSDP2's hybrid sharding): sdp groups shard, and the ranks holding the
same shard in each sdp group average their gradients.

SMP v1's knobs map to FSDP2's (config.py, docs/sdp.md):
- bf16 (fp16): MixedPrecisionPolicy(param_dtype=bf16 (fp16), reduce_dtype=fp32): the sharded
  parameters stay fp32 (they are the master weights), only gathered copies are half precision;
  fp16's loss scaling is the DistributedOptimizer's, on the fp32 sharded gradients;
- sdp_param_persistence_threshold: a unit with fewer parameters stays gathered from its forward
  to its backward (reshard_after_forward=False), saving an all-gather;
- sdp_max_live_parameters: how many layers are gathered ahead (explicit prefetch, units.py);
- sdp_gradient_clipping: global L2 clipping of the sharded gradients before each optimizer step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from smp import params as param_facts
from smp.config import Config
from smp.data_parallel import replicas
from smp.groups import ParallelGroups
from smp.sharded_data import deepspeed_names, stages, tensors, units

if TYPE_CHECKING:
    from smp.expert_parallel import ExpertPlacement

# Initializes the meta tensors of a module at a path (delayed parameter initialization).
Materialize = Callable[[nn.Module, str], None]


class ShardedModel:
    """A model under FSDP2 over the sdp group, and what the optimizer and engine ask of it.

    `counts` (with pipeline or tensor parallelism): whether this rank counts a parameter in a
    global norm, summed over `norm_groups` (the pipeline and tensor-parallel groups); `shared`:
    (name, parameter, group) of parameters whose copies on several pipeline ranks add their
    gradients; `stage_calls`: per stage, what runs its graphs (smp.sharded_data.stages)."""

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        clip: float,
        counts: Callable[[torch.Tensor], bool] | None = None,
        norm_groups: tuple[dist.ProcessGroup, ...] = (),
        shared: tuple = (),
        stage_units: dict | None = None,
        expert_group: dist.ProcessGroup | None = None,
    ):
        self.module, self.mesh, self.clip = module, mesh, clip
        # Expert parallelism: its experts' shards sit on their own mesh, and the ep group's ranks
        # hold different experts (their norms add).
        self.expert_group = expert_group
        self.counts, self.norm_groups, self.shared = counts, norm_groups, shared
        self.stage_units = stage_units or {}
        self.last_grad_norm: torch.Tensor | None = None  # the norm clip_before_step found

    @property
    def shard_group(self) -> dist.ProcessGroup:
        """The group a parameter's shards are spread over (the mesh's shard dimension)."""
        return self.mesh.get_group(self.mesh.ndim - 1)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the sharded gradients by their global norm over the whole model (a collective over
        the sdp group, and the pipeline and tensor-parallel groups); returns the norm."""
        norm, params = self.grad_norm(norm_type)
        experts = [p for p in params if param_facts.is_expert(p)]
        for part in (experts, [p for p in params if not param_facts.is_expert(p)]):  # (one mesh each)
            if part:
                torch.nn.utils.clip_grads_with_norm_(part, max_norm, norm)
        return norm

    def grad_norm(self, norm_type: float = 2.0) -> tuple[torch.Tensor, list[nn.Parameter]]:
        """(the sharded gradients' global norm, a collective as above; the parameters with one)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        counted = [p for p in params if self.counts is None or self.counts(p)]
        device = params[0].device if params else torch.device("cpu")
        norm = _norm([p.grad for p in counted if not param_facts.is_expert(p)], norm_type, device)
        if self.expert_group is not None:  # (a mesh of their own: a norm of their own, added)
            experts = _norm([p.grad for p in counted if param_facts.is_expert(p)], norm_type, device)
            norm = _combined_norm(
                norm, norm_type, (), _combined_norm(experts, norm_type, (self.expert_group,))
            )
        return _combined_norm(norm, norm_type, self.norm_groups), params

    def clip_before_step(self) -> None:
        """SMP v1's sdp_gradient_clipping, applied before every optimizer step (<= 0: off); the
        global norm is kept either way (DeepSpeed's `_global_grad_norm`, which scripts log)."""
        if self.clip > 0:
            self.last_grad_norm = self.clip_grad_norm(self.clip)
        else:
            self.last_grad_norm = self.grad_norm()[0]

    def wrap_stage(
        self,
        stage: int,
        gm: fx.GraphModule,
        recompute: Callable[[fx.GraphModule], list[str]],
        compile_body: Callable[[fx.GraphModule], nn.Module] | None = None,
    ) -> tuple[nn.Module, list[str]]:
        """What runs stage `stage`'s graph `gm` (any signature's) under its units: the graph reads the
        sharded parameters through the module, each layer unit's nodes are outlined into calls of
        it, and `recompute` (activation checkpointing) applies to the layers' bodies and the rest;
        `compile_body` (config "compile") compiles each layer's body, inside its unit's gathers.
        Returns it and the checkpointed regions' labels."""
        unit, layer_units = self.stage_units[stage]
        managed = {
            str(n.target)
            for n in gm.graph.nodes
            if n.op == "get_attr" and self._is_sharded_param(str(n.target))
        }
        stages.read_through_owner(gm, self.module, managed)
        labels: list[str] = []
        for i, (path, layer_unit) in enumerate(layer_units):
            calls = stages.outline_layer(gm, path, layer_unit, self.module, f"smp_sharded_{i}")
            outside = stages.reads_outside(gm, path)
            if outside:
                raise RuntimeError(
                    f"smp: sharded data parallelism: stage {stage} reads {outside[:3]} of layer {path} "
                    "outside that layer; a layer's parameters must be used only inside it (untie them, "
                    "or set sharded_data_parallel_degree=1)"
                )
            for call in calls:
                labels += recompute(call.body)
                if compile_body is not None:
                    call.body = compile_body(call.body)
        labels += recompute(gm)
        return stages.StageCall(unit, gm), labels

    def _is_sharded_param(self, name: str) -> bool:
        try:
            return tensors.is_sharded(self.module.get_parameter(name))
        except AttributeError:
            return False

    def finish_backward(self) -> None:
        """After a step's backward: the copies of a parameter shared by pipeline ranks add their
        (sharded, already averaged) gradients."""
        for _, p, group in self.shared:
            if p.grad is not None:
                dist.all_reduce(tensors.local(p.grad), group=group)


def _norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The norm of sharded gradients of one mesh (a collective over it)."""
    if not grads:
        return torch.zeros((), device=device)
    return tensors.whole(torch.nn.utils.get_total_norm(grads, norm_type)).to(device)


def _combined_norm(
    norm: torch.Tensor, norm_type: float, groups, other: torch.Tensor | None = None
) -> torch.Tensor:
    """The norm of parts held apart: over `groups` (each rank's part its own), and with `other`."""
    if not groups and other is None:
        return norm
    if norm_type == float("inf"):
        for group in groups:
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm if other is None else torch.maximum(norm, other)
    total = norm.double() ** norm_type
    for group in groups:
        dist.all_reduce(total, group=group)
    if other is not None:
        total = total + other.double() ** norm_type
    return (total ** (1.0 / norm_type)).to(norm.dtype)


def shard_model(
    module: nn.Module,
    config: Config,
    groups: ParallelGroups,
    device: torch.device,
    materialize: Materialize | None = None,
    compile_layer: Callable[[nn.Module], None] | None = None,
    experts: ExpertPlacement | None = None,
) -> tuple[ShardedModel, ExpertPlacement | None]:
    """Shards `module` in place over this rank's sdp group and returns it as a ShardedModel, with
    `experts` (expert parallelism's placement, its blocks cut already) following the new parameters.

    `materialize` (delayed initialization): called for each layer, then for the root, just before
    that unit is sharded, so only one layer is ever whole on a rank. Without it the module's
    parameters are real: they move to `device` and the data-parallel group takes the first
    rank's, so every rank shards the same values. `compile_layer` (config "compile") compiles each
    layer's forward in place before it is sharded, so FSDP2's hooks stay outside the graphs.
    """
    if materialize is None and experts is None:  # (ep: the replicas agreed before cutting)
        module.to(device)
        replicas.broadcast_over(
            list(module.parameters()) + list(module.buffers()), groups.rdp, groups.rdp_ranks
        )
    mesh = _mesh(groups, device)
    layers = units.layer_units(module)
    policy = _policy(config)
    threshold = config.sdp_param_persistence_threshold
    if experts is not None:
        experts = _shard_experts(experts, groups, device, policy)
    in_layers = sum(units.numel(m) for _, m in layers)
    for path, layer in [*layers, ("", module)]:
        if materialize is not None:
            materialize(layer, path)
        if compile_layer is not None and layer is not module:
            compile_layer(layer)
        own = units.numel(layer) - (in_layers if layer is module else 0)  # (the root: its own)
        _shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=own >= threshold)
    _prefetch(layers, units.prefetch_depth(config.sdp_max_live_parameters, layers))
    expert_group = experts.group if experts is not None else None
    return ShardedModel(module, mesh, config.sdp_gradient_clipping, expert_group=expert_group), experts


def _shard_experts(
    experts: ExpertPlacement, groups: ParallelGroups, device: torch.device, policy: MixedPrecisionPolicy
) -> ExpertPlacement:
    """Each experts module under its own fully_shard over the replicas holding the same experts
    (the layers' units then leave its banks to it; FSDP2 averages their gradients over those
    replicas, which the experts' forward has prescaled: see smp.engine.plan.place_sharded)."""
    mesh = DeviceMesh.from_group(groups.ep_replica, device.type)
    replaced: dict[int, nn.Parameter] = {}
    for bank in experts.banks:
        replaced |= _shard(bank.module, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    params = tuple(replaced.get(id(p), p) for p in experts.params)
    for p in params:
        param_facts.mark_expert(p)
    return dataclasses.replace(experts, params=params)


def shard_stages(
    module: nn.Module,
    stage_graphs: dict[int, list[fx.GraphModule]],
    config: Config,
    groups: ParallelGroups,
    device: torch.device,
    shared: tuple,
) -> tuple[ShardedModel, dict[int, nn.Parameter]]:
    """Shards this rank's part of a captured model (its stages' parameters, its tensor-parallel
    shards) over the sdp group: each layer whose parameters one stage holds is a LayerUnit, the
    rest of each stage its StageUnit. `stage_graphs`: each own stage's graphs (every mode's), which
    then read the parameters through the module. Returns the model and id(old parameter) -> new."""
    mesh = _mesh(groups, device)
    policy = _policy(config)
    threshold = config.sdp_param_persistence_threshold
    reads = _stage_reads(stage_graphs)
    replaced: dict[int, nn.Parameter] = {}
    stage_units = {}
    for s, named in reads.items():
        own = {id(p) for p in named.values()}
        layer_units = []
        for path, layer in units.layer_units(module):
            local = list(layer.parameters())
            if local and all(id(p) in own for p in local):
                unit = stages.LayerUnit(layer)
                replaced |= _shard(
                    unit, mesh=mesh, mp_policy=policy, reshard_after_forward=units.numel(layer) >= threshold
                )
                layer_units.append((path, unit))
        rest = [p for p in named.values() if id(p) not in replaced]
        unit = stages.StageUnit(module, [u for _, u in layer_units])
        ignored = {p for p in module.parameters()} - set(rest)
        keep = sum(p.numel() for p in rest) >= threshold
        replaced |= _shard(
            unit, mesh=mesh, mp_policy=policy, reshard_after_forward=keep, ignored_params=ignored
        )
        _prefetch(layer_units, units.prefetch_depth(config.sdp_max_live_parameters, layer_units))
        stage_units[s] = (unit, layer_units)
    shared = tuple((name, replaced.get(id(p), p), group) for name, p, group in shared)
    norm_groups = (groups.pp, groups.tp)
    # (which parameters count in a norm: the plan says, once made; see make_plan)
    sharded = ShardedModel(module, mesh, config.sdp_gradient_clipping, None, norm_groups, shared, stage_units)
    return sharded, replaced


def _stage_reads(stage_graphs: dict[int, list[fx.GraphModule]]) -> dict[int, dict[str, nn.Parameter]]:
    """Per stage, the parameters its graphs read (by name); one stage of this rank per parameter."""
    reads: dict[int, dict[str, nn.Parameter]] = {}
    holder: dict[int, int] = {}
    for s, graphs in stage_graphs.items():
        reads[s] = {}
        for gm in graphs:
            reads[s] |= stages.stage_parameters(gm)
        for name, p in reads[s].items():
            if holder.setdefault(id(p), s) != s:
                raise ValueError(
                    f"smp: sharded_data_parallel_degree > 1: parameter {name} is read by stages "
                    f"{holder[id(p)]} and {s}, both on this rank; sharded data parallelism gathers each "
                    "stage's parameters on their own. Set colocate_shared_parameters=True (every user "
                    "of a shared parameter on one stage) or untie the parameter"
                )
    return reads


def _policy(config: Config) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None,
        reduce_dtype=torch.float32,
    )


def _shard(unit: nn.Module, **options) -> dict[int, nn.Parameter]:
    """fully_shard(unit): its parameters become new (DTensor) Parameters, which an optimizer built
    from the old ones follows (smp.params). Returns id(old) -> new."""
    before = dict(unit.named_parameters(remove_duplicate=False))
    fully_shard(unit, **options)
    after = dict(unit.named_parameters(remove_duplicate=False))
    replaced = {}
    for name, old in before.items():
        if after[name] is not old and id(old) not in replaced:
            param_facts.mark_moved(old, after[name])
            deepspeed_names.name_parameter(after[name])
            replaced[id(old)] = after[name]
            # FSDP2 copied this rank's rows: free the whole, which stage graphs captured earlier
            # still reference (they read through the module from now on)
            old.data = torch.empty(0, dtype=old.dtype, device=old.device)
    return replaced


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
