"""Stages for another capture of a partitioned model: its other train/eval mode, or inputs of
another signature. Each follows the first capture's partition, by node names (same shapes) or by
module paths (names shift when shapes change the traced code)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx

from .fx_utils import COMPUTE_OPS, module_stack
from .partition import PartitionPlan, plan_from_assignment


def follow_partition(
    gm: fx.GraphModule, reference: PartitionPlan, colocate_shared: bool = False
) -> PartitionPlan:
    """Stages for another capture of the same model (its eval-mode graph, say) that follow `reference`.

    A node named as in the reference graph keeps its stage; a node the reference lacks
    (or one whose inputs now come from a later stage) runs on the latest stage of its inputs.
    """
    stage: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op in COMPUTE_OPS:
            inputs = [stage[p.name] for p in node.all_input_nodes if p.name in stage]
            stage[node.name] = max([reference.node_stage.get(node.name, 0)] + inputs)
    return plan_from_assignment(gm, stage, reference.num_stages, colocate_shared)


def module_stages(gm: fx.GraphModule, plan: PartitionPlan) -> dict[str, int]:
    """Module path -> the stage all of its ops run on, for the modules a plan keeps on one stage."""
    stages: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        if node.name in plan.node_stage:
            for path in module_stack(node):
                stages.setdefault(path, set()).add(plan.node_stage[node.name])
    return {path: next(iter(s)) for path, s in stages.items() if len(s) == 1}


def follow_modules(
    gm: fx.GraphModule, module_stage: Mapping[str, int], num_stages: int, colocate_shared: bool = False
) -> PartitionPlan:
    """Stages for a capture of the same model with other input shapes, following another capture's
    modules (`module_stages`): node names shift when shapes change the traced code (masks built
    differently), module paths do not. A node runs on the stage of the innermost module holding it
    that the reference kept on one stage, else on the latest stage of its inputs (0 without any)."""
    stage: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        inputs = [stage[p.name] for p in node.all_input_nodes if p.name in stage]
        anchored = [module_stage[path] for path in module_stack(node) if path in module_stage]
        stage[node.name] = max(anchored[-1:] + inputs, default=0)
    return plan_from_assignment(gm, stage, num_stages, colocate_shared)
