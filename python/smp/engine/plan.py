"""The plan: what the one-time parallelization of a module decided for this rank.

`make_plan` runs once per model, at its first step, with that microbatch as the example inputs.
One function per parallelism, each with explicit inputs, in this order: capture (train and eval
graphs) -> pipeline partition -> tensor-parallel rewrite -> context-parallel rewrite -> pipeline
split and keep-local ->
materialize (delayed initialization) -> data-parallel replica sync. The result is a frozen Plan,
which every input signature's program follows (smp.engine.build), and the first signature's
split pipelines, already made. `place_whole` is the plan of a module that runs whole (data
parallelism alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

import smp.passes as passes
from smp import params as param_facts
from smp import recompute
from smp.config import Config
from smp.context_parallel import cut_modes
from smp.data_parallel import replicas
from smp.engine import delayed_init
from smp.engine.skeleton import Skeleton
from smp.expert_parallel import ExpertPlacement, distribute, global_router_losses, scale_gradients
from smp.expert_parallel import graph as expert_graph
from smp.expert_parallel.find import check_divides, expert_banks
from smp.groups import ParallelGroups
from smp.passes.regions import Region
from smp.pipeline import placement
from smp.pipeline.partitioning import module_partitions
from smp.schedules import Schedule
from smp.sharded_data import ShardedModel, shard_model, shard_stages
from smp.tensor_parallel.coverage import CoverageReport
from smp.tensor_parallel.marks import marked_modules
from smp.tensor_parallel.shard import shard_modes

Flags = tuple[bool, ...]  # the train/eval mode of every module: which captured graph runs


@dataclasses.dataclass(frozen=True)
class Plan:
    """This rank's part of the model and what every input signature's program follows."""

    schedule: Schedule
    pp_rank: int  # this rank's place in the pipeline
    device: torch.device
    # id(local shard) -> how it was cut from the full parameter.
    shard_specs: Mapping[int, passes.ShardSpec]
    # Parameters several stages hold, with the group joining their copies.
    shared: tuple[replicas.SharedParameter, ...]
    # id(parameter) -> how many of this rank's stages read it, where more than one.
    stage_reads: Mapping[int, int]
    # The group whose ranks average this rank's gradients (None: no other replica).
    grad_group: dist.ProcessGroup | None
    # The rest is for a captured model (pipeline stages or tensor-parallel layers) only.
    # The pipeline partition of the mode the first step ran in.
    partition: passes.PartitionPlan | None = None
    # The module structure with full-shape meta tensors, taken before partitioning.
    skeleton: Skeleton | None = None
    # Per mode, module path -> its stage (the modules the partition kept on one stage).
    module_stages: Mapping[Flags, Mapping[str, int]] = dataclasses.field(default_factory=dict)
    # Tensor parallelism: the marked modules, what stays replicated (and why), its coverage.
    marked: frozenset[str] = frozenset()
    replicated: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tp_coverage: CoverageReport | None = None
    # Activation checkpointing: the regions (each with its offload flag), and the offloader.
    checkpointing: tuple[tuple[Region, bool], ...] = ()
    offloader: recompute.ActivationOffloader | None = None
    # Checkpointed regions the partition cut in two (for `debug`).
    split_regions: tuple[str, ...] = ()
    # Sharded data parallelism over the stages (FSDP2's units), or None.
    sharded_data: ShardedModel | None = None
    # Expert parallelism: this rank's experts and where their gradients are combined, or None.
    experts: ExpertPlacement | None = None

    def counts_in_norm(self, param: torch.Tensor, tp_rank: int) -> bool:
        """Whether this rank counts `param` in a global norm over the model-parallel ranks: shards
        always; replicated parameters on tp rank 0; a parameter shared by stages on its first one."""
        if id(param) not in self.shard_specs and tp_rank != 0:
            return False
        group = next((g for _, p, g in self.shared if p is param), None)
        return group is None or dist.get_global_rank(group, 0) == dist.get_rank()

    @property
    def own_stages(self) -> tuple[int, ...]:
        """The stages this rank runs."""
        return self.schedule.rank_stages(self.pp_rank)


def place_whole(module: nn.Module, config: Config, groups: ParallelGroups) -> Plan:
    """Data parallelism alone: the module runs whole on this rank's device."""
    device = rank_device()
    if delayed_init.is_delayed(module):
        _materialize(module, {}, device, config.tensor_parallel_seed, groups)
    module.to(device)
    tensors = list(module.parameters()) + list(module.buffers())
    grad_group = replicas.broadcast_over(tensors, groups.dp, groups.dp_ranks)
    # After the broadcast: the replicas agree on every expert, and each keeps its ep rank's block.
    experts = None
    if groups.ep_size > 1:
        experts = distribute(module, groups)
        global_router_losses(module, groups.dp)
    return Plan(config.schedule(), groups.pp_rank, device, {}, (), {}, grad_group, experts=experts)


def place_sharded(
    module: nn.Module,
    config: Config,
    groups: ParallelGroups,
    compile_layer: Callable[[nn.Module], None] | None = None,
) -> Plan:
    """Sharded data parallelism: the module runs whole on each rank, its parameters sharded over the
    sdp group (FSDP2 averages the gradients: the plan has no gradient group of smp's). With expert
    parallelism each rank keeps its block of the experts first (the replicas agreeing on the whole
    model), and FSDP2 shards those over the replicas holding the same experts."""
    device = rank_device()
    materialize = None
    if delayed_init.is_delayed(module):
        if groups.ep_size > 1:
            raise ValueError(
                "smp: expert_parallel_degree with sharded_data_parallel_degree needs the model's real "
                "parameters (each rank cuts its experts from the whole model before sharding); build "
                "it outside smp.delay_param_initialization(), or set sharded_data_parallel_degree=1"
            )
        seed = config.tensor_parallel_seed

        def materialize(unit: nn.Module, path: str) -> None:
            delayed_init.materialize(unit, {}, device, seed, 0, prefix=path, model=module)

    experts = None
    if groups.ep_size > 1:
        module.to(device)
        replicas.broadcast_over(
            list(module.parameters()) + list(module.buffers()), groups.dp, groups.dp_ranks
        )
        experts = distribute(module, groups)
        global_router_losses(module, groups.dp)
        # An expert's gradient holds every ep rank's tokens already: one process's is its sum over
        # the dp/ep replicas holding it divided by dp, and FSDP2 divides by dp/ep (a divide factor
        # of its own needs PREMUL_SUM, which Gloo lacks), so the banks' gradients come scaled 1/ep.
        for bank in experts.banks:
            scale_gradients(bank.module, 1.0 / groups.ep_size)
    sharded, experts = shard_model(module, config, groups, device, materialize, compile_layer, experts)
    return Plan(
        config.schedule(), groups.pp_rank, device, {}, (), {}, None, sharded_data=sharded, experts=experts
    )


def make_plan(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    config: Config,
    groups: ParallelGroups,
    batch_size: int | None,
    trace_execution_times: bool = False,
    checkpointing: Sequence[tuple[Region, bool]] = (),
    offloader: recompute.ActivationOffloader | None = None,
) -> tuple[Plan, dict[Flags, passes.PipelineGraph]]:
    """Captures, partitions, shards and splits `module` for this rank, freeing what its stages do
    not use. `args`/`kwargs` are one microbatch's inputs (of the whole tensor-parallel group);
    `batch_size` is the rows of one rank's microbatch. Returns the plan and, per mode, the split
    pipeline of these inputs' signature (for smp.engine.build).

    The graph is captured in the current train/eval mode and in the opposite one, while every
    parameter still exists: switching modes later picks the other graph.
    """
    device = rank_device()
    delayed = delayed_init.is_delayed(module)
    if delayed:  # capture on meta tensors; only this rank's part is ever allocated
        if trace_execution_times:
            raise ValueError(
                "smp: trace_execution_times needs real parameters; it cannot be combined with "
                "smp.delay_param_initialization()"
            )
        args, kwargs = delayed_init.to_meta((args, kwargs))
        delayed_init.real_buffers_to(module, device)  # (what __init__ computed: rotary tables)
    else:
        module.to(device)
    # Sharded data parallelism under bf16/fp16 keeps fp32 parameters and computes in half
    # precision: the graphs are captured in it, on the skeleton's metas.
    half = _half_dtype(config) if config.sharded_data_parallel_degree > 1 else None
    in_half = half is not None
    skeleton = Skeleton(module, half)  # before anything is freed or sharded
    retarget = device if delayed else None
    schedule = config.schedule()
    own = schedule.rank_stages(groups.pp_rank)
    banks = _expert_banks(module, groups)  # expert parallelism: each experts module one call
    calls = [expert_graph.ExpertsCall(b) for b in banks]

    def _capture(module: nn.Module, args: tuple, kwargs: dict, retarget: torch.device | None):
        if not delayed:
            captured = _capture_on(module, args, kwargs, retarget, device, skeleton if in_half else None)
        else:
            with delayed_init.meta_buffers(module) as real_of:  # (one device: meta) then the real ones
                captured = _capture_on(module, args, kwargs, retarget, device, skeleton if in_half else None)
            delayed_init.replace_in(captured.graph_module, real_of)
        expert_graph.collapse(captured.graph_module, calls)
        return captured

    captured = _capture(module, args, kwargs, retarget)
    partition = placement.plan_stages(
        captured,
        captured.flatten_inputs(args, kwargs),
        config,
        schedule.num_stages,
        module_partitions(module),
        trace_execution_times,
    )
    modes = {training_flags(module): (captured, partition)}
    with _opposite_mode(module) as flags:
        other = _capture(module, args, kwargs, retarget)
        modes[flags] = (other, passes.follow_partition(other.graph_module, partition))
    # Where each module runs, which later signatures follow (before the TP rewrite adds nodes).
    module_stages = {flags: passes.module_stages(c.graph_module, p) for flags, (c, p) in modes.items()}
    specs: dict[int, passes.ShardSpec] = {}
    tp_coverage, replicated, marked = None, {}, marked_modules(module)
    marked -= {b.path for b in banks}  # (expert parallelism keeps each expert whole on its ep rank)
    if groups.tp_size > 1:
        combined = combined_batch(config, groups, batch_size)
        modes, specs, tp_coverage, replicated = shard_modes(
            modes, module, groups.tp, marked, combined, config.colocate_shared_parameters
        )
    if groups.cp_size > 1:  # each rank's part of the sequence (after TP: heads already local)
        modes = cut_modes(modes, groups.cp, config.cp_comm_type, config.colocate_shared_parameters)
    partition = modes[training_flags(module)][1]
    pipes = {flags: passes.split(c, p) for flags, (c, p) in modes.items()}
    partitions = [p for _, p in modes.values()]
    placement.keep_local(module, captured.graph_module, list(pipes.values()), partitions, own)
    if delayed:
        specs, replaced = _materialize(module, specs, device, config.tensor_parallel_seed, groups)
        holders = [c.graph_module for c, _ in modes.values()]
        holders += [s.module for pipe in pipes.values() for s in pipe.stages if s.module is not None]
        for graph_module in holders:
            delayed_init.replace_in(graph_module, replaced)
    shared = replicas.shared_groups(captured.graph_module, partitions, schedule.stage_ranks, groups)
    grad_group = replicas.synchronize(module, set(specs), shared, groups)
    holders = [c.graph_module for c, _ in modes.values()]
    holders += [s.module for pipe in pipes.values() for s in pipe.stages if s.module is not None]
    experts = _distribute_stages(module, banks, groups, holders) if banks else None
    stage_reads = _stage_reads(captured.graph_module, partition, own)
    sharded = None
    if config.sharded_data_parallel_degree > 1:  # FSDP2 over the sdp group averages the gradients
        graphs = {s: [pipe.stages[s].module for pipe in pipes.values()] for s in own}
        sharded, replaced = shard_stages(module, graphs, config, groups, device, tuple(shared))
        specs = {id(replaced[k]) if k in replaced else k: v for k, v in specs.items()}
        shared = list(sharded.shared)
        grad_group = None
    plan = Plan(
        schedule,
        groups.pp_rank,
        device,
        specs,
        tuple(shared),
        stage_reads,
        grad_group,
        partition,
        skeleton,
        module_stages,
        frozenset(marked),
        replicated,
        tp_coverage,
        tuple(checkpointing),
        offloader,
        _split_regions(captured, partition, checkpointing),
        sharded,
        experts,
    )
    if sharded is not None:
        sharded.counts = lambda p: plan.counts_in_norm(p, groups.tp_rank)
    return plan, pipes


def _expert_banks(module: nn.Module, groups: ParallelGroups) -> list:
    """The experts modules expert parallelism divides (none without it), checked against the whole
    model; their routers' auxiliary loss made global before capture, so the graphs hold it (over
    the reduced data-parallel group: a tensor-parallel group's ranks route the same tokens)."""
    if groups.ep_size == 1:
        return []
    banks = expert_banks(module)
    check_divides(banks, groups.ep_size, module)
    global_router_losses(module, groups.rdp)
    return banks


def _distribute_stages(
    module: nn.Module, banks: list, groups: ParallelGroups, holders: list
) -> ExpertPlacement:
    """Cuts the experts modules this rank's stages hold to its block (after the replicas agreed on
    them), and points the graphs (`holders`) reading their banks at the blocks."""
    kept = expert_graph.held(banks)
    full = [getattr(b.module, name) for b in kept for name in b.banks]
    experts = distribute(module, groups, kept)
    replaced = {id(p): param_facts.current(p) for p in full}
    for graph_module in holders:
        delayed_init.replace_in(graph_module, replaced)
    return experts


def combined_batch(config: Config, groups: ParallelGroups, batch_size: int | None) -> int | None:
    """The rows of the tensor-parallel group's combined microbatch (None under prescaled_batch,
    where the group's ranks read the same batch)."""
    return None if config.prescaled_batch else batch_size * groups.tp_size


def _stage_reads(gm, partition: passes.PartitionPlan, own: tuple[int, ...]) -> dict[int, int]:
    """id(parameter) -> how many of the stages `own` read it, where more than one."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    reads: dict[int, int] = {}
    for s in own:
        for name in partition.stage_parameters[s]:
            reads[id(params[name])] = reads.get(id(params[name]), 0) + 1
    return {key: n for key, n in reads.items() if n > 1}


def _split_regions(captured, partition: passes.PartitionPlan, checkpointing) -> tuple[str, ...]:
    """A checkpointed region that spans stages is split at the boundary, each stage recomputing its
    own part as one region: these lines say where that happened."""
    lines = []
    for region, _ in checkpointing:
        nodes = passes.regions.region_nodes(captured.graph_module.graph, region)
        stages = sorted({partition.node_stage[n.name] for n in nodes if n.name in partition.node_stage})
        if len(stages) > 1:
            lines.append(
                f"smp checkpointing: region {region.label} spans stages {stages}: split at the boundary"
            )
    return tuple(lines)


def _half_dtype(config: Config) -> torch.dtype | None:
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None


def _capture_on(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    retarget: torch.device | None,
    device: torch.device,
    skeleton: Skeleton | None,
):
    """The module's graph; with `skeleton`, captured on its metas (their dtypes) and then reading
    the module's own tensors."""
    if skeleton is None:
        captured = passes.capture(module, args, kwargs)
    else:
        with skeleton.swapped_in():
            captured = passes.capture(module, *delayed_init.to_meta((args, kwargs)))
        delayed_init.replace_in(captured.graph_module, skeleton.holders())
        retarget = device
    if retarget is not None:
        delayed_init.retarget(captured.graph_module, retarget)
    return captured


def _materialize(
    module: nn.Module,
    specs: dict[int, passes.ShardSpec],
    device: torch.device,
    seed: int,
    groups: ParallelGroups,
) -> tuple[dict[int, passes.ShardSpec], dict[int, torch.Tensor]]:
    """Delayed initialization: allocates and initializes this rank's part; replicated tensors
    then come from the tensor-parallel group's first rank, so the group agrees on them.
    Returns the shard specs keyed by the new tensors, and id(meta tensor) -> its replacement."""
    full_shapes = {}
    for p in module.parameters():
        spec = specs.get(id(p))
        if spec is not None:
            shape = list(p.shape)
            shape[spec.dim] *= groups.tp_size
            full_shapes[id(p)] = torch.Size(shape)
    replaced = delayed_init.materialize(module, full_shapes, device, seed, groups.tp_rank)
    specs = {id(replaced[k]) if k in replaced else k: v for k, v in specs.items()}
    if groups.tp_size > 1:
        replicated = [p for p in module.parameters() if id(p) not in specs]
        replicas.broadcast_over(replicated + list(module.buffers()), groups.tp, groups.tp_ranks)
    return specs, replaced


def training_flags(module: nn.Module) -> Flags:
    """The train/eval mode of every module: which captured graph runs."""
    return tuple(m.training for m in module.modules())


@contextlib.contextmanager
def _opposite_mode(module: nn.Module):
    """Every module in the opposite of the root's train/eval mode; yields those flags, then restores."""
    before = [(m, m.training) for m in module.modules()]
    module.train(not module.training)
    try:
        yield training_flags(module)
    finally:
        for m, training in before:
            m.training = training


def rank_device() -> torch.device:
    """Where this rank's part of the model runs: its GPU wherever there is one (as place_whole, and
    as SMP does), also when the batch comes on the CPU (smp.step moves CPU inputs there; building
    on the inputs' device would silently train on the CPU of a GPU machine)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
