"""Context parallelism's traffic around attention (docs/context_parallel.md), per layer and
microbatch, on the link its group crosses.

A cp group is C ranks pp x tp apart (smp's placement puts C right after D: tp fastest, then pp,
then cp), so kernels.Group(cp, pp * tp) says whether it stays inside a node (NVLink) or crosses
nodes (the network), as the TP, sdp and data-parallel terms read it. Per layer, forward:

- "p2p" (ring attention): the rank's K and V pass around the ring, C - 1 steps, each while the
  block in hand is computed: (C - 1) x the rank's K and V bytes, the bytes of an all-gather of
  them. The backward passes K and V again and their gradients back: twice the forward's. On
  hardware that communicates beside compute only what outlasts attention's own compute is
  exposed: max(0, traffic - attention), forward and backward each.
- "all_gather": K and V gathered inside the op (the ring's bytes), not overlapped; its backward
  reduce-scatters their gradients (the same bytes again) and gathers them once more: 2x.
  An attention with dropout on its weights is run this way under "p2p" too (the ring draws no
  dropout); an eager one (softmax(QK^T)V written out) is read as sdpa, so runs as sdpa does.
- "a2a" (Ulysses): four all-to-alls (q, k and v to heads, the output back to the sequence),
  each moving (C - 1) / C of the rank's tensor; the backward the same four, reversed. Key/value
  heads that do not divide by C are repeated until they do. Not overlapped.

A checkpointed layer's recomputed forward exchanges again.
"""

from __future__ import annotations

import math

from smp.planner import kernels
from smp.planner.hardware import Hardware
from smp.planner.layout import Layout
from smp.planner.memory import Workload, compute_bytes, held
from smp.planner.model_facts import ModelFacts
from smp.planner.stage_work import attention, rank_tokens


def group(layout: Layout) -> kernels.Group:
    return kernels.Group(layout.cp, layout.pp * layout.tp)


def spans_nodes(layout: Layout, workload: Workload) -> bool:
    return group(layout).spans_nodes(workload.gpus_per_node, workload.gpus)


def comm_of(facts: ModelFacts, layout: Layout) -> str:
    """The exchange smp runs: an attention with dropout on its weights gathers its keys and values
    under "p2p" (the ring draws no dropout: passes/context_parallel/rules/attention.py)."""
    return "all_gather" if facts.attention_dropout and layout.cp_comm == "p2p" else layout.cp_comm


def layer_traffic(
    facts: ModelFacts, layout: Layout, workload: Workload, hw: Hardware, mb: int
) -> tuple[float, float]:
    """Seconds of one layer's cp traffic for one microbatch, (forward, backward), before overlap."""
    c = layout.cp
    if c == 1:
        return 0.0, 0.0
    g, per_node, gpus = group(layout), workload.gpus_per_node, workload.gpus
    tokens, elem = rank_tokens(layout, workload, mb), compute_bytes(layout)
    head_dim = facts.head_dim or facts.hidden // facts.heads
    heads, kv = max(1, facts.heads // layout.tp), max(1, facts.kv_heads // layout.tp)
    if comm_of(facts, layout) == "a2a":
        kv = kv if kv % c == 0 else math.lcm(kv, c)
        # An all-gather of a buffer moves (C - 1) / C of it per rank, as an all-to-all does.
        nbytes = [tokens * n * head_dim * elem for n in (heads, kv, kv, heads)]
        one = sum(kernels.all_gather(hw, b, g, per_node, gpus) for b in nbytes)
        return one, one
    kv_bytes = 2 * tokens * kv * head_dim * elem  # the rank's K and V
    forward = kernels.all_gather(hw, c * kv_bytes, g, per_node, gpus)
    return forward, 2 * forward


def layer_exposed(
    facts: ModelFacts, layout: Layout, workload: Workload, hw: Hardware, mb: int
) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's cp traffic the compute does not hide, the
    backward with a checkpointed layer's second exchange."""
    forward, backward = layer_traffic(facts, layout, workload, hw, mb)
    if comm_of(facts, layout) == "p2p" and hw.overlap:
        attn_f, attn_b = attention(facts, layout, workload, hw, mb)
        forward, backward = max(0.0, forward - attn_f), max(0.0, backward - attn_b)
    if layout.checkpoint_group:
        backward += forward
    return forward, backward


def logits_seconds(facts: ModelFacts, layout: Layout, workload: Workload, hw: Hardware, mb: int) -> float:
    """The last stage's gather of the logits' sequence cuts (they leave the model whole), not
    overlapped, and the copy putting the load-balanced chunks back in order."""
    nbytes = mb * facts.logits_elements / layout.tp * compute_bytes(layout)
    gather = kernels.all_gather(hw, nbytes, group(layout), workload.gpus_per_node, workload.gpus)
    return gather + kernels.memory_pass(hw, 2 * nbytes, 1)


def microbatch_seconds(
    facts: ModelFacts,
    layout: Layout,
    workload: Workload,
    hw: Hardware,
    mb: int,
    rank: int,
    gathers_logits: bool = True,
) -> tuple[float, float]:
    """(traffic, exposed) seconds of one microbatch's cp exchanges on pipeline rank `rank`: each
    layer's around attention, and on the last stage the logits' gather."""
    if layout.cp == 1:
        return 0.0, 0.0
    layers, _, last = held(layout, rank, facts.layers)
    forward, backward = layer_traffic(facts, layout, workload, hw, mb)
    if layout.checkpoint_group:
        backward += forward
    exposed = sum(layer_exposed(facts, layout, workload, hw, mb))
    logits = logits_seconds(facts, layout, workload, hw, mb) if last and gathers_logits else 0.0
    return layers * (forward + backward) + logits, layers * exposed + logits
