"""build(): the one builder of this rank's Program for an input signature, following the plan.

For the first signature the split pipelines come from smp.engine.plan.make_plan, whose capture
decided the plan. Any later signature (another sequence length, an eval batch size) is captured
on the module's Skeleton, follows the first capture's stage of every module and its
tensor-parallel decisions, is split, and its stage graphs read this rank's real tensors. Both then
go the same way: activation checkpointing, torch.compile, the stage runtime, and what the schedule
asks of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from torch import nn

import smp.passes as passes
from smp import recompute
from smp.config import Config
from smp.context_parallel import cut_following
from smp.engine import compiled, delayed_init
from smp.engine.plan import Flags, Plan, combined_batch
from smp.engine.skeleton import make_real
from smp.groups import ParallelGroups
from smp.pipeline.bundles import layout_of
from smp.pipeline.messages import Messages
from smp.pipeline.rank_runtime import RankRuntime
from smp.schedules import Schedule
from smp.tensor_parallel.shard import shard_following


@dataclasses.dataclass(frozen=True)
class Program:
    """This rank's work for one input signature in one train/eval mode: its stages' runtime and the
    schedule that orders their actions."""

    runtime: RankRuntime
    schedule: Schedule
    # Stage -> the checkpointed regions it recomputes (for `debug`).
    checkpointed: Mapping[int, tuple[str, ...]]


def build(
    plan: Plan,
    flags: Flags,
    args: tuple,
    kwargs: dict,
    batch_size: int | None,
    config: Config,
    groups: ParallelGroups,
    pipe: passes.PipelineGraph | None = None,
    messages: Messages | None = None,
) -> Program:
    """This rank's program for inputs `args`/`kwargs` (the module in the modes `flags`); `pipe` is
    their split pipeline when planning made it (the first signature); `messages`: the rank's,
    shared by its programs (smp.pipeline.messages)."""
    if pipe is None:
        with plan.skeleton.swapped_in():
            captured = passes.capture(
                plan.skeleton.module, *delayed_init.to_meta((tuple(args), dict(kwargs)))
            )
        delayed_init.retarget(captured.graph_module, plan.device)
        tp_batch = combined_batch(config, groups, batch_size) if groups.tp_size > 1 else None
        pipe = _split_following(
            plan, captured, flags, config.colocate_shared_parameters, groups, tp_batch, config.cp_comm_type
        )
    checkpointed = {}

    def checkpoint(gm) -> list[str]:
        if not plan.checkpointing:
            return []
        return recompute.apply_to_stage(gm, list(plan.checkpointing), plan.offloader)

    for s in plan.own_stages:
        stage = pipe.stages[s]
        labels = []
        compiling = config.compile is not None
        if stage.module is not None and plan.sharded_data is not None:  # (layer bodies compiled)
            compile_body = (lambda body: compiled.compile_stage(body, config.compile)) if compiling else None
            stage.module, labels = plan.sharded_data.wrap_stage(s, stage.module, checkpoint, compile_body)
            compiling = False
        elif stage.module is not None:
            labels = checkpoint(stage.module)
        checkpointed[s] = tuple(labels)
        if stage.module is not None and compiling:
            stage.module = compiled.compile_stage(stage.module, config.compile)
    schedule = plan.schedule
    runtime = RankRuntime(
        pipe,
        schedule.stage_ranks,
        groups.pp_rank,
        groups.pp,
        list(groups.pp_ranks),
        config.microbatches,
        plan.device,
        messages,
    )
    if groups.pp_size > 1:  # the lists the executor runs (every pair), and this program's part
        ordered = messages is not None and messages.ordered
        for layout in (None, layout_of(pipe)):  # of them, cannot deadlock: raises if they could
            for with_gradients in (True, False):
                schedule.check(layout, ordered, with_gradients)
    if schedule.splits_backward:  # weight gradients wait for the schedule's W
        runtime.defer_weight_gradients()
    return Program(runtime, schedule, checkpointed)


def debug_report(plan: Plan, program: Program, groups: ParallelGroups) -> None:
    """Prints (config `debug`) the partition and tensor-parallel coverage on the first rank, and
    what activation checkpointing did on each pipeline rank's first replica."""
    if groups.rank == 0:
        print(plan.partition.report(), flush=True)
        if plan.tp_coverage is not None:
            print(plan.tp_coverage, flush=True)
    report = recompute_report(plan, program)
    if report and groups.tp_rank == groups.rdp_rank == 0:
        print(report, flush=True)


def recompute_report(plan: Plan, program: Program) -> str:
    """What activation checkpointing did on this rank's stages (empty without it)."""
    if not plan.checkpointing:
        return ""
    lines = list(plan.split_regions)
    for stage, labels in program.checkpointed.items():
        lines.append(
            f"smp checkpointing: stage {stage} recomputes {len(labels)} regions: {', '.join(labels)}"
        )
    return "\n".join(lines)


def _split_following(
    plan: Plan,
    captured,
    flags: Flags,
    colocate: bool,
    groups: ParallelGroups,
    tp_batch: int | None,
    cp_comm: str,
) -> passes.PipelineGraph:
    """A new signature's capture (on the skeleton) cut as the plan says, this rank's stages reading
    its real tensors (the others' dropped). `tp_batch`: the tensor-parallel group's combined batch;
    `cp_comm`: the context-parallel attention's communication."""
    gm = captured.graph_module
    partition = passes.follow_modules(gm, plan.module_stages[flags], plan.schedule.num_stages, colocate)
    if groups.tp_size > 1:
        partition = shard_following(
            captured,
            partition,
            groups.tp,
            set(plan.marked),
            tp_batch,
            _shards(plan),
            dict(plan.replicated),
            colocate,
        )
    if groups.cp_size > 1:
        partition = cut_following(captured, partition, groups.cp, cp_comm, colocate)
    pipe = passes.split(captured, partition)
    own = plan.own_stages
    for s in pipe.stages:
        if s.index not in own:
            s.module = None
        else:
            make_real(s.module, plan.skeleton, s.index)
    return pipe


def _shards(plan: Plan) -> dict[int, nn.Parameter]:
    """id(meta full tensor) -> this rank's shard of it, for every sharded tensor this rank holds."""
    shards = {}
    for meta in plan.skeleton.metas():
        local = plan.skeleton.local(meta)
        if local is not None and id(local) in plan.shard_specs:
            shards[id(meta)] = local
    return shards
