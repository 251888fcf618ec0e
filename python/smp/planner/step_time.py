"""A relative step time: how far a layout is from the ideal (the step's FLOPs spread evenly over
every GPU with nothing else to do). Meant to rank layouts, not to predict seconds.

Stated assumptions (A100 p4d nodes, as in the seed's reference table):
- a GPU sustains 125 TFLOP/s in bf16/fp16 (40% of its 312 peak), 8 times less in fp32;
- backward costs two forwards; a checkpointed layer runs its forward once more;
- the pipeline bubble: the most idle rank's idle time per unit of its work in the schedule's own
  unit-time timeline (smp.schedules.unit_time_slots): (pp - 1) / microbatches for 1F1B
  and GPipe, less for the zero-bubble schedules;
- ring collectives move 2 (n - 1) / n of the buffer per rank; within a node at 150 GB/s per GPU
  (NVLink, one direction), across nodes at 50 GB/s per node (EFA, 400 Gbps) shared by its GPUs;
- tensor parallelism all-reduces each layer's output twice forward and twice backward;
  pipeline stages send one activation per microbatch each way; data parallelism all-reduces
  the fp32 gradients once a step; none of it overlaps with compute (an upper bound);
- sharded data parallelism (sdp = N, FSDP2) replaces that all-reduce: per microbatch, each layer
  is all-gathered in forward and again in backward (it was resharded) in the compute dtype and
  its gradients reduce-scattered in fp32, the root unit gathered and reduce-scattered once; each
  moves (N - 1) / N of the bytes per rank. With replicas of the sdp group (rdp > N), the fp32
  gradient shards are all-reduced over the rdp / N replicas, per microbatch too (FSDP2 reduces
  in every backward; the walk's sdp layouts have one microbatch: once a step). An sdp group is N
  blocks of pp x tp consecutive ranks (topology.py): inside a node where that divides the node.
"""

from __future__ import annotations

import dataclasses

from smp import schedules
from smp.planner.layout import Layout
from smp.planner.memory import Workload, compute_bytes, held, microbatch_size, stage_parameters
from smp.planner.model_facts import ModelFacts

HALF_FLOPS = 125e12
FP32_FLOPS = HALF_FLOPS / 8
NVLINK_BYTES = 150e9
EFA_BYTES_PER_NODE = 50e9


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute: float  # seconds, the busiest stage, recompute included
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float  # the gradients' all-reduce over the replicas (under sdp, of the sdp groups)
    ideal: float  # the step's forward and backward FLOPs over every GPU, no overheads
    sdp_comm: float = 0.0  # sharded data parallelism's all-gathers and reduce-scatters

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp_comm + self.pp_comm + self.dp_comm + self.sdp_comm

    @property
    def relative(self) -> float:
        return self.total / self.ideal


def _link(span_nodes: bool, gpus_per_node: int) -> float:
    """Bytes per second per rank of a ring: NVLink inside a node, a GPU's share of EFA across nodes."""
    return EFA_BYTES_PER_NODE / gpus_per_node if span_nodes else NVLINK_BYTES


def _ring(bytes_: float, n: int, bandwidth: float) -> float:
    """An all-reduce: a reduce-scatter, then an all-gather."""
    return 2 * _half_ring(bytes_, n, bandwidth)


def _half_ring(bytes_: float, n: int, bandwidth: float) -> float:
    """An all-gather or a reduce-scatter of a `bytes_` buffer (the whole, not a shard)."""
    return 0.0 if n <= 1 else (n - 1) / n * bytes_ / bandwidth


def estimate(facts: ModelFacts, layout: Layout, workload: Workload) -> StepTime:
    flops = HALF_FLOPS if layout.half else FP32_FLOPS
    elem = compute_bytes(layout)
    mb = microbatch_size(layout, workload)
    tokens = mb * workload.seq_len
    layers = max(held(layout, r, facts.layers)[0] for r in range(layout.pp))
    forward = tokens * (layers * facts.layer_flops_per_token + facts.head_flops_per_token / layout.pp)
    forward /= layout.tp
    recompute = tokens * layers * facts.layer_flops_per_token / layout.tp if layout.checkpoint_group else 0.0
    per_microbatch = (3 * forward + recompute) / flops
    m, pp = layout.microbatches, layout.pp
    compute = m * per_microbatch
    bubble = compute * bubble_share(layout)
    per_node = workload.gpus_per_node
    boundary = tokens * facts.hidden * elem
    tp_link = _link(layout.tp > per_node, per_node)
    tp_comm = m * layers * 4 * _ring(boundary, layout.tp, tp_link)
    pp_link = _link(layout.tp * pp > per_node, per_node)
    pp_comm = 0.0 if pp == 1 else 2 * m * boundary / pp_link
    grad_bytes = 4 * _stage_params(facts, layout) / layout.sdp  # sdp: the shard, over its replicas
    dp_link = _link(layout.tp * pp * layout.rdp > per_node, per_node)
    syncs = m if layout.sdp > 1 else 1  # FSDP2 reduces every backward; smp's buffers once a step
    dp_comm = syncs * _ring(grad_bytes, layout.rdp // layout.sdp, dp_link)
    sdp_comm = m * sdp_traffic(facts, layout, workload)
    total_flops = (
        3
        * workload.global_batch
        * workload.seq_len
        * (facts.layers * facts.layer_flops_per_token + facts.head_flops_per_token)
    )
    ideal = total_flops / (workload.gpus * flops)
    return StepTime(compute, bubble, tp_comm, pp_comm, dp_comm, ideal, sdp_comm)


def bubble_share(layout: Layout) -> float:
    """Idle time per unit of work on the most idle pipeline rank, from the schedule's unit-time
    timeline (every action one slot)."""
    if layout.pp == 1:
        return 0.0
    slots = schedules.unit_time_slots(layout.pipeline, layout.pp, layout.microbatches, layout.active)
    length = max(len(row) for row in slots)
    return max((length - busy) / busy for busy in (sum(a is not None for a in row) for row in slots))


def _stage_params(facts: ModelFacts, layout: Layout) -> float:
    """The parameters of the fullest pipeline rank (the head side counted: an untied head's
    gradients are averaged too)."""
    return max(stage_parameters(facts, layout, r) for r in range(layout.pp))


def sdp_spans_nodes(layout: Layout, workload: Workload) -> bool:
    """Whether an sdp group crosses nodes: it spans sdp x pp x tp consecutive ranks (tp fastest)."""
    group = layout.sdp * layout.pp * layout.tp
    return workload.gpus > workload.gpus_per_node and workload.gpus_per_node % group != 0


def sdp_traffic(facts: ModelFacts, layout: Layout, workload: Workload) -> float:
    """Seconds of one microbatch's all-gathers and reduce-scatters on the busiest pipeline rank."""
    if layout.sdp == 1:
        return 0.0
    link = _link(sdp_spans_nodes(layout, workload), workload.gpus_per_node)
    layer = facts.layer.per_rank(layout.tp)
    busiest = 0.0
    for rank in range(layout.pp):
        layers = held(layout, rank, facts.layers)[0]
        root = stage_parameters(facts, layout, rank) - layers * layer
        gathered = (2 * layers * layer + root) * compute_bytes(layout)  # layers twice, the root once
        reduced = (layers * layer + root) * 4  # every gradient, once, in fp32
        busiest = max(busiest, _half_ring(gathered + reduced, layout.sdp, link))
    return busiest
