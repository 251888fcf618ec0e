"""Pipeline parallelism's part of parallelization: which stage runs each op, and which
parameters and buffers this rank keeps."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx, nn

import smp.passes as passes
from smp import params as param_facts
from smp.config import Config
from smp.passes.fx_utils import COMPUTE_OPS, fetch_attr


def plan_stages(
    captured: passes.CapturedGraph,
    example_inputs: list,
    config: Config,
    num_stages: int,
    module_partitions: dict[str, int],
    trace_execution_times: bool,
) -> passes.PartitionPlan:
    """Assigns every op of the captured graph to a stage (automatically, or by the manual
    partitions); every rank adopts global rank 0's plan."""
    gm = captured.graph_module
    seconds = None
    if trace_execution_times and num_stages > 1:
        seconds = passes.cost.measure_seconds(gm, example_inputs)
    passes.cost.annotate(gm, seconds)
    if num_stages == 1:
        every = {n.name: 0 for n in gm.graph.nodes if n.op in COMPUTE_OPS}
        return passes.plan_from_assignment(gm, every, 1)
    colocate = config.colocate_shared_parameters
    if config.auto_partition:
        try:
            plan = passes.auto_partition(gm, num_stages, config.memory_weight, colocate)
        except passes.PartitionError as error:
            if num_stages == config.pipeline_parallel_degree:
                raise
            raise passes.PartitionError(
                f"{error} (the {config.pipeline!r} schedule cuts 2 x pipeline_parallel_degree = "
                f"{num_stages} stages; use another schedule, a lower pipeline_parallel_degree, or a "
                "model with more modules)"
            ) from error
    else:
        plan = passes.manual_partition(gm, num_stages, module_partitions, config.default_partition, colocate)
    # Measured times differ between ranks: everyone adopts global rank 0's assignment.
    agreed = [plan.node_stage]
    dist.broadcast_object_list(agreed, src=0)
    if agreed[0] != plan.node_stage:
        plan = passes.plan_from_assignment(gm, agreed[0], num_stages, colocate)
    return plan


def keep_local(
    module: nn.Module,
    gm: fx.GraphModule,
    pipes: list[passes.PipelineGraph],
    plans: list[passes.PartitionPlan],
    own: tuple[int, ...],
) -> None:
    """Frees every parameter and buffer that this rank's stages (`own`) do not use in any mode (the
    rank of stage 0 also keeps the ones no stage uses), and drops the other stages' graphs."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    keep: set[int] = set()
    used: set[int] = set()
    for pipe, plan in zip(pipes, plans, strict=True):
        for s in pipe.stages:
            ids = {id(t) for t in attr_tensors(s.module)}
            used |= ids
            if s.index in own:
                keep |= ids | {id(params[name]) for name in plan.stage_parameters[s.index]}
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for name, t in list(table.items()):
                if t is None or id(t) in keep or (0 in own and id(t) not in used):
                    continue
                if isinstance(t, nn.Parameter):
                    param_facts.mark_nonlocal(t)
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                table[name] = None
    for pipe in pipes:
        for s in pipe.stages:
            if s.index not in own:
                s.module = None


def attr_tensors(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The parameters and buffers a graph module reads."""
    return [fetch_attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
