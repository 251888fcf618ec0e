"""Tensor parallelism's part of parallelization: the tensor-parallel pass over each captured
mode, and the shards put in the module in place of the full parameters."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import fx, nn

import smp.passes as passes
from smp import params as param_facts
from smp.passes.fx_utils import COMPUTE_OPS
from smp.tensor_parallel import coverage

# Captured graphs keyed by the modules' train/eval flags, each with its partition plan.
Modes = dict[tuple[bool, ...], tuple[passes.CapturedGraph, passes.PartitionPlan]]


def shard_modes(
    modes: Modes,
    module: nn.Module,
    group: dist.ProcessGroup,
    marked: set[str],
    combined_batch: int | None,
    colocate_shared: bool,
) -> tuple[Modes, dict[int, passes.ShardSpec], coverage.CoverageReport, dict[str, str]]:
    """Runs the tensor-parallel pass on each captured mode (they share shards and decisions) and
    puts the shards in `module`; returns the modes with plans covering the rewritten graphs,
    id(local shard) -> how it was cut, how much of the marked modules was cut, and what stays
    replicated and why (the decisions later captures of other input shapes follow).

    combined_batch: without prescaled_batch, the rows the group runs together (the pass cuts
    each output back to this rank's rows); None when the group reads one batch.
    """
    result = None
    sharded: Modes = {}
    for flags, (captured, plan) in modes.items():
        result = passes.tensor_parallel(
            captured.graph_module,
            group,
            marked,
            scatter_batch=combined_batch,
            shards=result.shards if result else None,
            replicated=result.replicated if result else None,
        )
        gm = captured.graph_module
        stages = stages_after_rewrite(gm, plan.node_stage)
        sharded[flags] = (captured, passes.plan_from_assignment(gm, stages, plan.num_stages, colocate_shared))
    for key, reason in result.replicated.items():
        warnings.warn(f"smp tensor parallelism: {key} stays replicated: {reason}", stacklevel=4)
    report = coverage.coverage(module, marked, result, group.size())
    if report.sharded_share < coverage.WARN_BELOW:
        warnings.warn(
            f"{report}\nsmp tensor parallelism: less than {coverage.WARN_BELOW:.0%} of the marked matrix "
            "parameters are sharded, so tensor parallelism saves little memory on this model "
            "(model.tensor_parallel_report() lists what stayed whole and why)",
            stacklevel=4,
        )
    return sharded, install_shards(module, result), report, dict(result.replicated)


def shard_following(
    captured: passes.CapturedGraph,
    plan: passes.PartitionPlan,
    group: dist.ProcessGroup,
    marked: set[str],
    combined_batch: int | None,
    shards: dict[int, nn.Parameter],
    replicated: dict[str, str],
    colocate_shared: bool,
) -> passes.PartitionPlan:
    """The tensor-parallel pass on a later capture (another input signature), reusing the first
    capture's shards (`shards`: id(full tensor of this capture) -> the local shard) and decisions;
    returns the plan covering the rewritten graph."""
    passes.tensor_parallel(
        captured.graph_module,
        group,
        marked,
        scatter_batch=combined_batch,
        shards=dict(shards),
        replicated=dict(replicated),
    )
    gm = captured.graph_module
    stages = stages_after_rewrite(gm, plan.node_stage)
    return passes.plan_from_assignment(gm, stages, plan.num_stages, colocate_shared)


def install_shards(module: nn.Module, result: passes.TensorParallelResult) -> dict[int, passes.ShardSpec]:
    """Puts each sharded parameter's local shard in the module in place of the full one, whose
    storage is freed (an optimizer built on the full one follows it to the shard)."""
    for owner in module.modules():
        for name, p in list(owner._parameters.items()):
            if p is not None and id(p) in result.shards:
                owner._parameters[name] = result.shards[id(p)]
                if not param_facts.is_moved(p):
                    param_facts.mark_moved(p, result.shards[id(p)])
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    named = module.named_parameters(remove_duplicate=False)
    return {id(p): result.specs[path] for path, p in named if path in result.specs}


def stages_after_rewrite(gm: fx.GraphModule, before: dict[str, int]) -> dict[str, int]:
    """Stages for a rewritten graph: each node runs where the original node it serves ran
    (`smp_tp_origin`); nodes serving the output run on the latest stage of their inputs."""
    stages: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        origin = node.meta.get("smp_tp_origin", node.name)
        inputs = [stages[n.name] for n in node.all_input_nodes if n.name in stages]
        stages[node.name] = before[origin] if origin in before else max(inputs, default=0)
    return stages
