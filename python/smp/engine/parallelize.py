"""parallelize(): an unmodified module and example inputs in, this rank's parallelized part out.

One function per parallelism, each with explicit inputs, in this order:
capture (train and eval graphs) -> pipeline plan -> tensor-parallel rewrite -> pipeline
split and keep-local -> materialize (delayed initialization) -> data-parallel replica sync.
The result is a frozen value the engine runs; nothing here keeps state.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from smp import passes, recompute
from smp.config import Config
from smp.data_parallel import replicas
from smp.engine import compiled, delayed_init, recapture
from smp.groups import ParallelGroups
from smp.passes.regions import Region
from smp.pipeline import placement
from smp.pipeline.partitioning import module_partitions
from smp.pipeline.rank_runtime import RankRuntime
from smp.tensor_parallel.coverage import CoverageReport
from smp.tensor_parallel.marks import marked_modules
from smp.tensor_parallel.shard import shard_modes


@dataclasses.dataclass(frozen=True)
class Parallelized:
    """This rank's part of the model, ready to run."""

    # The stage runtime per train/eval flags of the modules, for the first input signature (empty
    # when the module runs whole; the engine hands them to its signature cache and keeps none).
    runtimes: Mapping[tuple[bool, ...], RankRuntime]
    # id(local shard) -> how it was cut from the full parameter.
    shard_specs: Mapping[int, passes.ShardSpec]
    # Parameters several stages hold, with the group joining their copies.
    shared: tuple[replicas.SharedParameter, ...]
    # id(parameter) -> how many of this rank's stages read it, where more than one.
    stage_reads: Mapping[int, int]
    # The group whose ranks average this rank's gradients (None: no other replica).
    grad_group: dist.ProcessGroup | None
    # The pipeline partition of the current mode (None when the module runs whole).
    plan: passes.PartitionPlan | None = None
    # What activation checkpointing did on this rank's stage (for `debug`).
    recompute_report: str = ""
    # How much of the marked modules tensor parallelism cut (None without it).
    tp_coverage: CoverageReport | None = None
    # What captures of other input signatures follow (None when the module runs whole).
    recipe: recapture.Recipe | None = None


def place_whole(module: nn.Module, config: Config, groups: ParallelGroups) -> Parallelized:
    """Data parallelism alone: the module runs whole on this rank's device."""
    device = rank_device()
    if delayed_init.is_delayed(module):
        _materialize(module, {}, device, config.tensor_parallel_seed, groups)
    module.to(device)
    tensors = list(module.parameters()) + list(module.buffers())
    grad_group = replicas.broadcast_over(tensors, groups.dp, groups.dp_ranks)
    return Parallelized(runtimes={}, shard_specs={}, shared=(), stage_reads={}, grad_group=grad_group)


def parallelize(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    config: Config,
    groups: ParallelGroups,
    batch_size: int | None,
    trace_execution_times: bool = False,
    checkpointing: Sequence[tuple[Region, bool]] = (),
    offloader: recompute.ActivationOffloader | None = None,
) -> Parallelized:
    """Captures, partitions, shards and splits `module` for this rank, freeing what its stage does
    not use. `args`/`kwargs` are one microbatch's inputs (of the whole tensor-parallel group);
    `batch_size` is the rows of one rank's microbatch.

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
    else:
        module.to(device)
    skeleton = recapture.Skeleton(module)  # before anything is freed or sharded
    retarget = device if delayed else None
    captured = _capture(module, args, kwargs, retarget)
    stage_ranks = config.schedule().stage_ranks
    own = config.schedule().rank_stages(groups.pp_rank)
    plan = placement.plan_stages(
        captured,
        captured.flatten_inputs(args, kwargs),
        config,
        len(stage_ranks),
        module_partitions(module),
        trace_execution_times,
    )
    modes = {training_flags(module): (captured, plan)}
    with _opposite_mode(module) as flags:
        other = _capture(module, args, kwargs, retarget)
        modes[flags] = (other, passes.follow_partition(other.graph_module, plan))
    # Where each module runs, which later signatures follow (before the TP rewrite adds nodes).
    module_stages = {flags: passes.module_stages(c.graph_module, p) for flags, (c, p) in modes.items()}
    specs: dict[int, passes.ShardSpec] = {}
    tp_coverage, replicated, marked = None, {}, marked_modules(module)
    if groups.tp_size > 1:
        combined = None if config.prescaled_batch else batch_size * groups.tp_size
        modes, specs, tp_coverage, replicated = shard_modes(
            modes, module, groups.tp, marked, combined, config.colocate_shared_parameters
        )
    plan = modes[training_flags(module)][1]
    pipes = {flags: passes.split(c, p) for flags, (c, p) in modes.items()}
    plans = [p for _, p in modes.values()]
    placement.keep_local(module, captured.graph_module, list(pipes.values()), plans, own)
    if delayed:
        specs, replaced = _materialize(module, specs, device, config.tensor_parallel_seed, groups)
        holders = [c.graph_module for c, _ in modes.values()]
        holders += [s.module for pipe in pipes.values() for s in pipe.stages if s.module is not None]
        for graph_module in holders:
            delayed_init.replace_in(graph_module, replaced)
    report = _checkpoint_stages(pipes, modes, list(checkpointing), offloader, own, training_flags(module))
    if config.compile is not None:
        for pipe in pipes.values():
            for s in own:
                if pipe.stages[s].module is not None:
                    pipe.stages[s].module = compiled.compile_stage(pipe.stages[s].module, config.compile)
    shared = replicas.shared_groups(captured.graph_module, plans, stage_ranks, groups)
    grad_group = replicas.synchronize(module, set(specs), shared, groups)
    runtimes = {
        flags: RankRuntime(
            pipe, stage_ranks, groups.pp_rank, groups.pp, list(groups.pp_ranks), config.microbatches, device
        )
        for flags, pipe in pipes.items()
    }
    recipe = recapture.Recipe(
        skeleton,
        module_stages,
        stage_ranks,
        frozenset(marked),
        replicated,
        specs,
        tuple(checkpointing),
        offloader,
        device,
    )
    reads = _stage_reads(captured.graph_module, plan, own)
    return Parallelized(runtimes, specs, tuple(shared), reads, grad_group, plan, report, tp_coverage, recipe)


def _stage_reads(gm, plan: passes.PartitionPlan, own: tuple[int, ...]) -> dict[int, int]:
    """id(parameter) -> how many of the stages `own` read it, where more than one."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    reads: dict[int, int] = {}
    for s in own:
        for name in plan.stage_parameters[s]:
            reads[id(params[name])] = reads.get(id(params[name]), 0) + 1
    return {key: n for key, n in reads.items() if n > 1}


def _checkpoint_stages(pipes, modes, checkpointing, offloader, own: tuple[int, ...], current) -> str:
    """Outlines the checkpointed regions on this rank's stages in every mode, and reports (for the
    current mode) what it did: a region that spans stages is split at the boundary, each stage
    recomputing its own part as one region."""
    if not checkpointing:
        return ""
    lines = []
    graph, plan = modes[current]
    for region, _ in checkpointing:
        nodes = passes.regions.region_nodes(graph.graph_module.graph, region)
        stages = sorted({plan.node_stage[n.name] for n in nodes if n.name in plan.node_stage})
        if len(stages) > 1:
            lines.append(
                f"smp checkpointing: region {region.label} spans stages {stages}: split at the boundary"
            )
    for flags, pipe in pipes.items():
        for stage in own:
            module = pipe.stages[stage].module
            labels = recompute.apply_to_stage(module, checkpointing, offloader) if module is not None else []
            if flags == current:
                lines.append(
                    f"smp checkpointing: stage {stage} recomputes {len(labels)} regions: {', '.join(labels)}"
                )
    return "\n".join(lines)


def _capture(module: nn.Module, args: tuple, kwargs: dict, retarget: torch.device | None):
    captured = passes.capture(module, args, kwargs)
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


def training_flags(module: nn.Module) -> tuple[bool, ...]:
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
