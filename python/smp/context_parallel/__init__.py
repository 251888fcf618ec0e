"""Context parallelism's part of parallelization: the context-parallel pass (smp.passes.
context_parallel) over each captured mode and each later signature's capture, with the pipeline
partition carried over to the nodes it adds.

The ranks of a cp group read the same batch (smp's data helpers shard by the data replicas, which
a cp group's ranks share); the pass cuts the sequence from there. Parameters stay whole on every
cp rank; their gradients are averaged over the data replicas and the cp ranks together
(smp.groups.ParallelGroups.rdp): the pass's collectives make the gradients summed over the cp group
C times the whole sequence's.
"""

from __future__ import annotations

import torch.distributed as dist

import smp.passes as passes
from smp.tensor_parallel.shard import Modes, stages_after_rewrite


def cut_modes(modes: Modes, group: dist.ProcessGroup, comm: str, colocate_shared: bool) -> Modes:
    """The context-parallel pass on each captured mode; the modes with plans covering the
    rewritten graphs."""
    return {
        flags: (captured, cut_following(captured, plan, group, comm, colocate_shared))
        for flags, (captured, plan) in modes.items()
    }


def cut_following(
    captured: passes.CapturedGraph,
    plan: passes.PartitionPlan,
    group: dist.ProcessGroup,
    comm: str,
    colocate_shared: bool,
) -> passes.PartitionPlan:
    """The context-parallel pass on one capture; the plan covering the rewritten graph."""
    passes.context_parallel(captured.graph_module, group, comm)
    gm = captured.graph_module
    stages = stages_after_rewrite(gm, plan.node_stage)
    return passes.plan_from_assignment(gm, stages, plan.num_stages, colocate_shared)
