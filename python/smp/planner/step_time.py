"""The absolute time of one training step of a layout, on a Hardware, and where it goes.

A step is the pipeline's microbatches on the busiest pipeline rank, its bubble, the exposed part
of the data-parallel traffic, and the optimizer:

- per microbatch (stage_work.py): the rank's matmuls, memory-bound kernels and tensor-parallel
  collectives, forward and backward (a checkpointed layer's forward once more), plus adding the
  microbatch's gradients into the kept ones (runtime_costs.py) and the pipeline messages (the
  activation forward, its gradient backward; for each model chunk of the rank under Megatron's
  interleaving) at the link between stages;
- the bubble: the most idle rank's idle time per unit of its work in the schedule's own
  unit-time timeline (smp.schedules.unit_time_slots) times the pipeline's work; (pp - 1) / (v m)
  for Megatron's interleaved schedule of v model chunks per rank;
- data parallelism: the gradients averaged over the replicas (ring all-reduce at the link the
  group crosses: kernels.py); where the runtime averages buckets during the last microbatch's
  backward and the hardware communicates beside compute, only what outlasts that backward (at
  least the last bucket) is exposed. A sharded optimizer state's updated chunks are then gathered
  back (not overlapped);
- sharded data parallelism (sdp = N, FSDP2): per microbatch each layer is all-gathered in forward
  and again in backward in the compute dtype and its gradients reduce-scattered in fp32, the root
  unit gathered and reduce-scattered once; FSDP2 prefetches, so on overlapping hardware only what
  outlasts the microbatch's compute is exposed (at least one layer's gather). With replicas of the
  sdp group (rdp > N), the fp32 gradient shards are all-reduced over the rdp / N replicas once per
  microbatch (FSDP2 reduces in every backward);
- the optimizer: memory-bound, over the parameters the rank steps (its chunk where sharded).
- context parallelism (cp = C): the per-microbatch work above is the rank's 1/C of the tokens
  (stage_work.py); each layer's exchange around attention is context_costs.py's, its exposed part
  the "cp_comm" part. Gradients are averaged over the rdp x cp ranks holding the same parameters
  (sdp: sharded over sdp x cp, replicated over rdp / sdp), and a sharded optimizer state's chunks
  are 1/(rdp x cp).

- expert parallelism (ep, a mixture of experts): the rank's E/ep experts run top_k x tokens
  (stage_work.py); each MoE layer's dispatch and combine all-to-alls, forward and backward, are
  expert_costs.py's, not overlapped: the "ep_comm" part. The experts' gradients (1/ep of them) are
  averaged over the rdp/ep replicas holding the same experts (ep x pp x tp x cp ranks apart), the
  others over all of rdp.
"""

from __future__ import annotations

import dataclasses
import functools

from smp import schedules
from smp.planner import context_costs, expert_costs, kernels
from smp.planner import hardware as hardware_
from smp.planner.hardware import Hardware
from smp.planner.layout import Layout
from smp.planner.memory import (
    Workload,
    compute_bytes,
    held,
    microbatch_size,
    stage_experts,
    stage_parameters,
)
from smp.planner.model_facts import ModelFacts
from smp.planner.runtime_costs import SMP, RuntimeCosts
from smp.planner.stage_work import RankWork, dtype_of, rank_work

BUCKET_BYTES = 25 * 2**20  # smp's (and DDP's) gradient bucket


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one step; the parts add up to `total`."""

    matmul: float  # the busiest pipeline rank's matmuls, every microbatch, recompute included
    memory: float  # its memory-bound kernels and gradient accumulation
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float  # the exposed part of the data-parallel average and the sharded state's gather
    sdp_comm: float  # the exposed part of sdp's gathers and reduce-scatters
    optimizer: float
    ideal: float  # the step's model FLOPs over every GPU at the sustained matmul rate
    model_flops: float  # forward and backward FLOPs of the step, every GPU (no recompute)
    tokens: int  # tokens per step, every GPU
    gpus: int
    peak_flops: float  # one GPU's spec peak in the training dtype (for MFU)
    dp_traffic: float = 0.0  # seconds of data-parallel traffic, before overlap
    sdp_traffic: float = 0.0  # seconds of sdp traffic per step, before overlap
    cp_comm: float = 0.0  # the exposed part of cp's exchanges around attention
    cp_traffic: float = 0.0  # seconds of cp traffic per step, before overlap
    ep_comm: float = 0.0  # ep's all-to-alls around the experts (none overlapped)

    @property
    def compute(self) -> float:
        return self.matmul + self.memory

    @property
    def total(self) -> float:
        comm = self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm + self.dp_comm + self.sdp_comm
        return self.compute + comm + self.bubble + self.optimizer

    @property
    def relative(self) -> float:
        return self.total / self.ideal

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens / self.total / self.gpus

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (forward and backward, recompute not counted)."""
        return self.model_flops / self.total / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.total / self.gpus / self.peak_flops

    def parts(self) -> dict[str, float]:
        """Where the time goes, in seconds."""
        return {
            "matmul": self.matmul,
            "memory_bound": self.memory,
            "tp_comm": self.tp_comm,
            "cp_comm": self.cp_comm,
            "ep_comm": self.ep_comm,
            "pp_comm": self.pp_comm,
            "bubble": self.bubble,
            "dp_comm": self.dp_comm,
            "sdp_comm": self.sdp_comm,
            "optimizer": self.optimizer,
        }


def hardware_of(workload: Workload) -> Hardware:
    return workload.hardware or hardware_.load(None)


def estimate(facts: ModelFacts, layout: Layout, workload: Workload, runtime: RuntimeCosts = SMP) -> StepTime:
    hw = hardware_of(workload)
    mb = microbatch_size(layout, workload)
    works = [rank_work(facts, layout, workload, hw, r, mb, runtime) for r in range(layout.pp)]
    busiest = max(works, key=lambda w: w.total + _accumulate(facts, layout, hw, runtime, w.rank))
    accumulate = _accumulate(facts, layout, hw, runtime, busiest.rank)
    m = layout.microbatches
    message = _pipeline_message(facts, layout, workload, hw, runtime, mb)
    sdp_traffic = sdp_seconds(facts, layout, workload)
    sdp_exposed = _exposed_sdp(sdp_traffic, busiest, facts, layout, hw)
    cp_traffic, cp_exposed = context_costs.microbatch_seconds(
        facts, layout, workload, hw, mb, busiest.rank, runtime.gathers_logits
    )
    ep_seconds = expert_costs.microbatch_seconds(facts, layout, workload, hw, mb, busiest.rank)
    per_microbatch = busiest.total + accumulate + message + sdp_exposed + cp_exposed + ep_seconds
    bubble = bubble_fraction(layout, runtime) * m * per_microbatch
    dp_traffic, dp_exposed = _data_parallel(facts, layout, workload, hw, runtime, busiest)
    flops = model_flops(facts, workload)
    return StepTime(
        matmul=m * (busiest.forward.matmul + busiest.backward.matmul),
        memory=m * (busiest.forward.memory + busiest.backward.memory + accumulate),
        tp_comm=m * (busiest.forward.tp_comm + busiest.backward.tp_comm),
        pp_comm=m * message,
        bubble=bubble,
        dp_comm=dp_exposed,
        sdp_comm=m * sdp_exposed,
        optimizer=_optimizer(facts, layout, hw, runtime),
        ideal=flops / (workload.gpus * hw.peak(dtype_of(layout))),
        model_flops=flops,
        tokens=workload.global_batch * workload.seq_len,
        gpus=workload.gpus,
        peak_flops=hw.peak_tflops[dtype_of(layout)] * 1e12,
        dp_traffic=dp_traffic,
        sdp_traffic=m * sdp_traffic,
        cp_comm=m * cp_exposed,
        cp_traffic=m * cp_traffic,
        ep_comm=m * ep_seconds,
    )


def model_flops(facts: ModelFacts, workload: Workload) -> float:
    """Forward and backward (3 forwards) FLOPs of one step over every GPU."""
    per_token = facts.layers * facts.layer_flops_per_token + facts.head_flops_per_token
    return 3.0 * workload.global_batch * workload.seq_len * per_token


def bubble_fraction(layout: Layout, runtime: RuntimeCosts = SMP) -> float:
    """Idle time per unit of work on the most idle pipeline rank."""
    if layout.pp == 1:
        return 0.0
    if runtime.virtual_stages:
        return (layout.pp - 1) / (runtime.virtual_stages * layout.microbatches)
    return bubble_share(layout)


def bubble_share(layout: Layout) -> float:
    """The bubble read off the schedule's unit-time timeline (every action one slot)."""
    if layout.pp == 1:
        return 0.0
    return _timeline_bubble(layout.pipeline, layout.pp, layout.microbatches, layout.active)


@functools.lru_cache(maxsize=512)
def _timeline_bubble(pipeline: str, pp: int, microbatches: int, active: int) -> float:
    slots = schedules.unit_time_slots(pipeline, pp, microbatches, active)
    length = max(len(row) for row in slots)
    return max((length - busy) / busy for busy in (sum(a is not None for a in row) for row in slots))


def _accumulate(facts: ModelFacts, layout: Layout, hw: Hardware, runtime: RuntimeCosts, rank: int) -> float:
    """Adding one microbatch's gradients into the kept ones (FSDP2 reduce-scatters them instead)."""
    if layout.sdp > 1:
        return 0.0
    params = stage_parameters(facts, layout, rank)
    return kernels.memory_pass(hw, params * runtime.accumulate(layout.half))


def _pipeline_message(
    facts: ModelFacts, layout: Layout, workload: Workload, hw: Hardware, runtime: RuntimeCosts, mb: int
) -> float:
    """One microbatch's messages between stages: the activation forward and its gradient backward,
    at each of the rank's model chunks (Megatron's interleaved schedule: v of them)."""
    if layout.pp == 1:
        return 0.0
    nbytes = mb * workload.seq_len // layout.cp * facts.hidden * compute_bytes(layout)  # the rank's cut
    across = kernels.Group(layout.pp, layout.tp).spans_nodes(workload.gpus_per_node, workload.gpus)
    if runtime.scatter_gather and layout.tp > 1:
        gather = kernels.all_gather(
            hw, nbytes, kernels.Group(layout.tp, 1), workload.gpus_per_node, workload.gpus
        )
        one = kernels.send(hw, nbytes / layout.tp, across) + gather
    else:
        one = kernels.send(hw, nbytes, across)
    return 2 * max(1, runtime.virtual_stages) * one


def _data_parallel(
    facts: ModelFacts,
    layout: Layout,
    workload: Workload,
    hw: Hardware,
    runtime: RuntimeCosts,
    busiest: RankWork,
) -> tuple[float, float]:
    """(seconds of data-parallel traffic, the part of it the step waits for). The ranks holding the
    same parameters are rdp x cp (C right after D: tp x pp apart); sdp shards over blocks of
    sdp x cp of them, its replicas the rdp / sdp blocks."""
    shards = layout.sdp * layout.cp if layout.sdp > 1 else 1
    replicas = layout.dp_cp // shards
    params = max(stage_parameters(facts, layout, r) for r in range(layout.pp))
    per_node, gpus = workload.gpus_per_node, workload.gpus
    group = kernels.Group(replicas, layout.tp * layout.pp * shards)
    if layout.sdp > 1:  # the fp32 shards over the sdp groups' replicas, every microbatch
        traffic = layout.microbatches * kernels.all_reduce(hw, 4 * params / shards, group, per_node, gpus)
        window = layout.microbatches * busiest.backward.total
        last = traffic / layout.microbatches
    else:
        grads = params * runtime.averaged(layout.half)
        experts = max(stage_experts(facts, layout, r) for r in range(layout.pp)) if layout.ep > 1 else 0.0
        traffic = kernels.all_reduce(hw, grads * (1 - experts / params), group, per_node, gpus)
        if experts:  # over the replicas holding the same experts, ep blocks apart
            holders = kernels.Group(replicas // layout.ep, layout.tp * layout.pp * layout.cp * layout.ep)
            traffic += kernels.all_reduce(hw, grads * experts / params, holders, per_node, gpus)
            if layout.tp > 1:  # and over their tp ranks (each ran its part of the tokens)
                tp_group = kernels.Group(layout.tp, 1)
                traffic += kernels.all_reduce(hw, grads * experts / params, tp_group, per_node, gpus)
        window = busiest.backward.total
        last = kernels.all_reduce(hw, min(grads, BUCKET_BYTES), group, per_node, gpus)
    overlapped = runtime.overlapped_average and hw.overlap and replicas > 1
    exposed = max(traffic - window, last) if overlapped else traffic
    if layout.shard_optimizer_state and layout.dp_cp > 1:  # each rank's updated chunk, to the others
        publish = kernels.all_gather(hw, params * compute_bytes(layout), group, per_node, gpus)
        traffic, exposed = traffic + publish, exposed + publish
    return traffic, exposed


def _optimizer(facts: ModelFacts, layout: Layout, hw: Hardware, runtime: RuntimeCosts) -> float:
    params = max(stage_parameters(facts, layout, r) for r in range(layout.pp))
    if layout.sdp > 1:
        chunk = params / (layout.sdp * layout.cp)
    elif layout.shard_optimizer_state:
        chunk = params / layout.dp_cp
    else:
        chunk = params
    return kernels.memory_pass(hw, chunk * runtime.optimizer(layout.half))


def _exposed_sdp(traffic: float, busiest: RankWork, facts: ModelFacts, layout: Layout, hw: Hardware) -> float:
    """What of a microbatch's sdp traffic the compute does not hide (prefetched gathers)."""
    if traffic == 0.0 or not hw.overlap:
        return traffic
    layers = max(1, held(layout, busiest.rank, facts.layers)[0])
    return max(traffic - busiest.total, traffic / (2 * layers + 1))


def sdp_spans_nodes(layout: Layout, workload: Workload) -> bool:
    """Whether an sdp group crosses nodes: it spans sdp x cp x pp x tp consecutive ranks (tp fastest)."""
    group = kernels.Group(layout.sdp * layout.cp, layout.pp * layout.tp)
    return group.spans_nodes(workload.gpus_per_node, workload.gpus)


def sdp_seconds(facts: ModelFacts, layout: Layout, workload: Workload) -> float:
    """Seconds of one microbatch's all-gathers and reduce-scatters on the busiest pipeline rank."""
    if layout.sdp == 1:
        return 0.0
    hw = hardware_of(workload)
    group = kernels.Group(layout.sdp * layout.cp, layout.pp * layout.tp)
    # ep: each layer's experts are gathered and reduce-scattered over the rdp/ep replicas holding
    # them (ep data replicas apart), the rest over sdp.
    holders = kernels.Group(layout.rdp // layout.ep, layout.pp * layout.tp * layout.ep)
    experts = facts.layer_experts(layout.tp, layout.ep) if layout.ep > 1 else 0.0
    layer = facts.layer_per_rank(layout.tp, layout.ep) - experts
    busiest = 0.0
    for rank in range(layout.pp):
        layers = held(layout, rank, facts.layers)[0]
        root = stage_parameters(facts, layout, rank) - layers * (layer + experts)
        seconds = _gathered_and_reduced(hw, layout, workload, group, layers * layer, root)
        if experts:
            seconds += _gathered_and_reduced(hw, layout, workload, holders, layers * experts, 0.0)
        collectives = (2 * layers + 1) + (layers + 1)  # the gathers, the reduce-scatters: one was counted
        latency = kernels.half_ring_latency(hw, group, workload.gpus_per_node, workload.gpus)
        busiest = max(busiest, seconds + (collectives - 1) * latency)
    return busiest


def _gathered_and_reduced(
    hw, layout: Layout, workload: Workload, group: kernels.Group, layers: float, root: float
) -> float:
    """Seconds of the layers' parameters gathered twice (forward, backward) and the root's once, in
    the compute dtype, and all their gradients reduce-scattered once in fp32."""
    nbytes = (2 * layers + root) * compute_bytes(layout) + (layers + root) * 4
    return kernels.all_gather(hw, nbytes, group, workload.gpus_per_node, workload.gpus)
