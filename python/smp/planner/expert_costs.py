"""Expert parallelism's traffic (docs/expert_parallel.md), per MoE layer and microbatch, on the
link its group crosses.

An ep group is ep consecutive data-parallel replicas (smp cuts them as sdp does), so its ranks are
pp x tp x cp apart: kernels.Group(ep, pp * tp * cp) says whether it stays inside a node (NVLink) or
crosses nodes, as the TP, cp and data-parallel terms read it. Per MoE layer, forward: the dispatch
(smp::moe_dispatch) sends each of the rank's top_k x T (token, expert) pairs to its expert's rank,
the combine (smp::moe_combine) brings the outputs back: two all-to-alls of top_k x T x hidden
elements, each moving (ep - 1) / ep of them (the router sending evenly), as an all-gather of that
buffer does. The backward sends both gradients: twice the forward's. A checkpointed layer's
recomputed forward exchanges again. Under tp each rank of a tp group exchanges its 1/tp of the
group's tokens, and the parts are gathered over the tp group (the outputs forward, the inputs'
gradients backward). Nothing overlaps them (the splits are read on the host).
"""

from __future__ import annotations

from smp.planner import kernels
from smp.planner.hardware import Hardware
from smp.planner.layout import Layout
from smp.planner.memory import Workload, compute_bytes, held
from smp.planner.model_facts import ModelFacts
from smp.planner.stage_work import expert_tokens, rank_tokens


def group(layout: Layout) -> kernels.Group:
    return kernels.Group(layout.ep, layout.pp * layout.tp * layout.cp)


def spans_nodes(layout: Layout, workload: Workload) -> bool:
    return group(layout).spans_nodes(workload.gpus_per_node, workload.gpus)


def layer_traffic(
    facts: ModelFacts, layout: Layout, workload: Workload, hw: Hardware, mb: int
) -> tuple[float, float]:
    """Seconds of one MoE layer's all-to-alls for one microbatch, (forward, backward)."""
    if layout.ep == 1 or not facts.experts:
        return 0.0, 0.0
    tokens = rank_tokens(layout, workload, mb)
    nbytes = facts.top_k * expert_tokens(layout, tokens) * facts.hidden * compute_bytes(layout)
    per_node, gpus = workload.gpus_per_node, workload.gpus
    one = kernels.all_gather(hw, nbytes, group(layout), per_node, gpus)
    forward = 2 * one  # dispatch and combine
    backward = 2 * forward
    if layout.tp > 1:  # the tp ranks' parts gathered (forward: outputs; backward: input gradients)
        gather = kernels.all_gather(
            hw, tokens * facts.hidden * compute_bytes(layout), kernels.Group(layout.tp, 1), per_node, gpus
        )
        forward, backward = forward + gather, backward + gather
    return forward, backward


def microbatch_seconds(
    facts: ModelFacts, layout: Layout, workload: Workload, hw: Hardware, mb: int, rank: int
) -> float:
    """Seconds of one microbatch's ep all-to-alls on pipeline rank `rank` (all exposed)."""
    if layout.ep == 1 or not facts.experts:
        return 0.0
    moe_layers = held(layout, rank, facts.layers)[0] * facts.moe_layers / facts.layers
    forward, backward = layer_traffic(facts, layout, workload, hw, mb)
    if layout.checkpoint_group:
        backward += forward
    return moe_layers * (forward + backward)
