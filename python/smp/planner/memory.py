"""Memory per GPU of one layout: smp's own buffers, part by part, on the fullest GPU.

What smp holds (python/smp/optim/flat_state.py, data_parallel/grad_sync.py, schedules/):
- parameters in the training precision (2 bytes under bf16/fp16, else 4);
- gradients: one fp32 gradient per parameter, in flat buffers kept across steps that the
  data-parallel average runs on in place (its buckets are ranges of them: no copies). bf16/fp16
  gradients are added into their fp32 buffer as they are produced and freed; the master chunk's
  gradient is a view of the buffer. With sharded gradients (ZeRO-2: sharded state and one
  microbatch, or "shard_gradients": true) only this rank's chunk of them, plus the buckets
  being averaged;
- optimizer: Adam/AdamW's two fp32 moments for this rank's chunk (1/rdp of the parameters when
  the state is sharded), and under bf16/fp16 the fp32 master chunk;
- activations: what autograd saves, per microbatch, times the microbatches alive on the stage:
  1F1B ("interleaved") keeps min(active_microbatches, pp - stage) alive on stage `stage`,
  "simple" keeps all, "zero_bubble_v" (two half-size stages per rank, rank 0 holding both ends)
  2 min(active, pp, m) half-stage ones on every rank. A checkpointed layer keeps its input
  instead, plus, while one region is recomputed in backward, that region's activations for one microbatch;
- working memory: the logits the last stage holds per microbatch alive and their gradient, and
  the gradient of one layer's largest activation;
- communication: pipeline send/receive buffers per microbatch alive and tensor-parallel
  collective buffers (the data-parallel average runs on the gradient buffers themselves).
Sharded data parallelism (sdp = N > 1, ZeRO-3 on torch FSDP2, smp/sharded_data/) replaces the
parameter, gradient and optimizer terms: the rank's part of the model (its TP shard of its stage)
is held as 1/N shards in fp32 (parameters, which are also the masters under bf16; gradients;
optimizer state), plus what is gathered whole: up to SDP_LIVE_LAYERS layers' parameters and, in
backward, their gradients in the compute dtype (bf16 or fp32), the root unit's (embeddings, final
norm, head) for the whole forward and backward, and one layer's fp32 reduce-scatter input.
Activations are as without sdp. Either runtime: smp's sdp is FSDP2's buffers.
Context parallelism (cp = C): each rank holds 2 of the 2C chunks of every sequence, so every
activation term (saved, recomputed, working, pipeline and TP buffers) is 1/C of cp = 1's, except the
logits, which leave the model whole (their fp32 gradient is the rank's cut). Parameters are whole on
every cp rank; what is sharded over the data replicas (the optimizer state and ZeRO-2 gradients,
sdp's shards) is sharded over their cp ranks too: rdp x cp ranks (sdp: sdp x cp).
Expert parallelism (ep = N, a mixture of experts): each rank holds E/N whole experts of every MoE
layer, so the experts' parameters, fp32 gradients, masters and optimizer state are 1/N (the rest as
above, replicated; with shard_optimizer_state the experts' state is cut across the rdp/N replicas
holding the same experts, the rest across rdp; under sdp FSDP2 shards the experts over those
replicas, the rest over sdp); an ep layout's all-to-all keeps a send and a
receive buffer of top_k x tokens x hidden (one MoE layer's dispatch) beside the saved activations,
which hold the dispatched tokens (model_facts / moe_facts: top_k x hidden per token and MoE layer)
at any ep.
SMP v1 (runtime "smp_v1", the implementation the seed's reference table was measured on) kept
bf16/fp16 gradients in the parameters' dtype and reduced them in place: see Runtime below.
The peak is parameters + optimizer state + the larger of the backward (gradients being
accumulated, activations, working memory, pipeline/TP buffers) and the step's end (every gradient
copy, the buckets). The stated margin is added on top: 1 GiB for the CUDA context and library
workspaces plus 10% of the peak for the caching allocator's fragmentation.
"""

from __future__ import annotations

import dataclasses
import math

from smp import schedules
from smp.planner.hardware import Hardware
from smp.planner.layout import Layout
from smp.planner.model_facts import ModelFacts
from smp.planner.units import GiB

ADAM_MOMENTS = 2  # Adam/AdamW; an optimizer with other state scales this term
# Layers gathered at once under sdp: the one computing and the one prefetched (FSDP2's own
# prefetch). smp's sdp_max_live_parameters can let small layers prefetch two ahead
# (sharded_data/units.py prefetch_depth): one more layer than counted here.
SDP_LIVE_LAYERS = 2


@dataclasses.dataclass(frozen=True)
class Runtime:
    """How an implementation holds gradients: smp's (above), or SMP v1's, on which the Best
    Practices seed measured its reference table."""

    name: str
    fp32_accumulation: bool  # an fp32 gradient beside a bf16/fp16 parameter's own
    bucket_copies: bool  # data-parallel buckets copy the gradients (else averaged in place)
    gradient_sharding: bool = False  # keeps each rank's chunk of the gradients only (ZeRO-2)


SMP = Runtime("smp", fp32_accumulation=True, bucket_copies=False, gradient_sharding=True)
# Sharded gradients hold the buckets being averaged: up to 3 of DistributedModel's default 25 MB.
SHARDED_GRADIENT_BUCKETS = 3 * 25 * 2**20
# SMP v1 accumulated bf16/fp16 gradients in the parameters' dtype (its `_fp32_grad_accumulation`
# defaulted to off) and reduced them in place; masters and moments were sharded as in smp.
SMP_V1 = Runtime("smp_v1", fp32_accumulation=False, bucket_copies=False)
RUNTIMES = {r.name: r for r in (SMP, SMP_V1)}
CONTEXT_BYTES = 1 * GiB
FRAGMENTATION = 0.10


@dataclasses.dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch: int  # samples per optimizer step, over every GPU
    gpus: int
    gpus_per_node: int
    gpu_memory: int  # bytes
    hardware: Hardware | None = None  # the step time's figures (None: hardware.DEFAULT)


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Bytes on one GPU (the fullest one: `stage` is its pipeline stage)."""

    stage: int
    parameters: float
    gradients: float
    optimizer_state: float
    masters: float
    activations: float  # saved for backward, over the microbatches alive
    recompute: float  # one checkpointed region's activations while it is recomputed
    working: float
    communication: float
    peak: float
    margin: float
    microbatch_size: int
    microbatches_alive: int
    gathered: float = 0.0  # sdp: layers and root gathered whole in backward, with their gradients

    @property
    def total(self) -> float:
        return self.peak + self.margin

    @property
    def validated(self) -> float:
        """The part the CPU validation measures: parameters, every gradient copy, optimizer
        state with masters, and the peak of saved activations, without the recompute working
        set, which the saved-tensor meter does not see (see docs/benchmarks.md)."""
        return self.parameters + self.gradients + self.optimizer_state + self.masters + self.activations


def microbatch_size(layout: Layout, workload: Workload) -> int:
    """Samples per microbatch of a model replica (a TP group reads one batch, either way)."""
    per_replica, rest = divmod(workload.global_batch, layout.rdp)
    if rest or per_replica < 1:
        raise ValueError(
            f"smp.plan: the global batch {workload.global_batch} does not split over {layout.rdp} model "
            f"replicas (rdp); choose a global batch that is a multiple of {layout.rdp}"
        )
    size, rest = divmod(per_replica, layout.microbatches)
    if rest or size < 1:
        raise ValueError(
            f"smp.plan: a replica's batch of {per_replica} does not split into {layout.microbatches} "
            f"microbatches; choose microbatches dividing {per_replica}"
        )
    return size


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers per stage, split evenly (the first stages take the remainder)."""
    return [layers // pp + (1 if s < layers % pp else 0) for s in range(pp)]


def held(layout: Layout, rank: int, layers: int) -> tuple[int, bool, bool]:
    """(layers, whether it holds the first stage (the embeddings), whether it holds the last (the
    head)) of pipeline rank `rank`: one stage per rank, or under "zero_bubble_v" two half-size
    stages in a V (rank r: stages r and 2p-1-r), so that rank 0 holds both ends."""
    stages = schedules.rank_stages(layout.pipeline, rank, layout.pp)
    split = stage_layers(layers, schedules.num_stages(layout.pipeline, layout.pp))
    return sum(split[s] for s in stages), 0 in stages, len(split) - 1 in stages


def alive(layout: Layout, stage: int) -> int:
    """Microbatches whose activations a pipeline rank holds at once, in units of the rank's whole
    share of the layers (the schedule's own bound, smp.schedules.Kind.held)."""
    return schedules.Schedule(layout.pipeline, layout.pp, layout.microbatches, layout.active).held(stage)


def estimate(facts: ModelFacts, layout: Layout, workload: Workload, runtime: Runtime = SMP) -> Breakdown:
    """The fullest GPU's breakdown."""
    mb = microbatch_size(layout, workload)
    stages = [_stage(facts, layout, workload, runtime, s, mb) for s in range(layout.pp)]
    return max(stages, key=lambda b: b.total)


def stage_parameters(facts: ModelFacts, layout: Layout, stage: int) -> float:
    """Parameters pipeline rank `stage`'s ranks hold each (tensor-parallel shards counted as shards,
    E/ep of each MoE layer's experts)."""
    tp = layout.tp
    layers, first, last = held(layout, stage, facts.layers)
    n = layers * facts.layer_per_rank(tp, layout.ep)
    if first:
        n += facts.before.per_rank(tp)
    if last:
        n += facts.after.per_rank(tp)
        if not first:
            n += facts.tied.per_rank(tp)  # the shared weight's replica on the last stage
    return n


def stage_experts(facts: ModelFacts, layout: Layout, stage: int) -> float:
    """The routed experts' part of stage_parameters: E/ep experts of each MoE layer held."""
    return held(layout, stage, facts.layers)[0] * facts.layer_experts(layout.tp, layout.ep)


def _stage(
    facts: ModelFacts, layout: Layout, workload: Workload, runtime: Runtime, stage: int, mb: int
) -> Breakdown:
    p = stage_parameters(facts, layout, stage)
    if layout.sdp > 1:
        experts = stage_experts(facts, layout, stage) if layout.ep > 1 else 0.0
        state = _sharded_state(facts, layout, stage, p, experts)
    else:
        experts = stage_experts(facts, layout, stage) if layout.ep > 1 else 0.0
        state = _replicated_state(layout, runtime, p, experts)
    saved, recompute, working, comm = _activation_terms(facts, layout, workload, stage, mb)
    comm += state.reduce_scatter
    backward = state.accumulation + state.gathered + saved + recompute + working + comm
    at_step = state.at_step + state.buckets
    peak = state.parameters + state.optimizer + state.masters + max(backward, at_step)
    return Breakdown(
        stage=stage,
        parameters=state.parameters,
        gradients=state.at_step,
        optimizer_state=state.optimizer,
        masters=state.masters,
        activations=saved,
        recompute=recompute,
        working=working,
        communication=comm + state.buckets,
        peak=peak,
        margin=CONTEXT_BYTES + FRAGMENTATION * peak,
        microbatch_size=mb,
        microbatches_alive=alive(layout, stage),
        gathered=state.gathered,
    )


@dataclasses.dataclass(frozen=True)
class _ModelState:
    """Bytes of the parameters, their gradients and the optimizer's state on one GPU."""

    parameters: float
    optimizer: float
    masters: float
    accumulation: float  # gradients held through the backward
    at_step: float  # every gradient copy at the optimizer step
    buckets: float  # the data-parallel buckets' copies at the step
    gathered: float = 0.0  # sdp: whole layers and root in backward
    reduce_scatter: float = 0.0  # sdp: a layer's fp32 gradient being reduce-scattered


def _replicated_state(layout: Layout, runtime: Runtime, p: float, experts: float = 0.0) -> _ModelState:
    """Whole parameters; the optimizer state (and, ZeRO-2, the gradients) of 1/rdp of them with
    shard_optimizer_state. `experts`: of p, this rank's experts (ep), whose state is cut across the
    rdp/ep replicas holding the same experts instead."""
    chunk = p  # this rank's optimizer chunk
    if layout.shard_optimizer_state:
        chunk = (p - experts) / layout.dp_cp + experts / (layout.rdp // layout.ep)
    accumulation, at_step, buckets = _gradient_terms(layout, runtime, p, chunk)
    return _ModelState(
        parameters=p * compute_bytes(layout),
        optimizer=chunk * 4 * ADAM_MOMENTS,
        masters=chunk * 4 if layout.half else 0.0,
        accumulation=accumulation,
        at_step=at_step,
        buckets=buckets,
    )


def _sharded_state(
    facts: ModelFacts, layout: Layout, stage: int, p: float, experts: float = 0.0
) -> _ModelState:
    """sdp: every per-parameter term is a 1/sdp shard, plus what is gathered whole. `experts`: of
    p, this rank's experts (ep), sharded over the rdp/ep replicas holding them instead."""
    # (the per-parameter terms are linear in the count: an expert counts as 1/(rdp/ep) of
    # sdp_shards' ranks' share)
    p = p - experts + experts * sdp_shards(layout) / (layout.rdp // layout.ep) if experts else p
    grads = sdp_gradients(layout, p)
    return _ModelState(
        parameters=sdp_parameters(layout, p),
        optimizer=sdp_optimizer_state(layout, p),
        masters=0.0,  # the fp32 shards are the masters; bf16 is only the gathered copies' dtype
        accumulation=grads,
        at_step=grads,
        buckets=0.0,
        gathered=sdp_live_layers(facts, layout, stage) + sdp_root(facts, layout, stage),
        reduce_scatter=sdp_reduce_scatter(facts, layout),
    )


def compute_bytes(layout: Layout) -> int:
    """Bytes of a parameter or activation element in the training precision."""
    return 2 if layout.half else 4


def sdp_shards(layout: Layout) -> int:
    """Ranks a parameter is sharded over under sdp: a block of sdp replicas with their cp ranks."""
    return layout.sdp * layout.cp


def sdp_parameters(layout: Layout, p: float) -> float:
    """The fp32 parameter shard (FSDP2 keeps fp32 shards under bf16 too: no separate masters)."""
    return 4 * p / sdp_shards(layout)


def sdp_gradients(layout: Layout, p: float) -> float:
    """The fp32 gradient shard (reduce-scattered in fp32), kept across the step."""
    return 4 * p / sdp_shards(layout)


def sdp_optimizer_state(layout: Layout, p: float) -> float:
    """The optimizer's state of the parameter shard (Adam: two fp32 moments)."""
    return 4 * ADAM_MOMENTS * p / sdp_shards(layout)


def sdp_live_layers(facts: ModelFacts, layout: Layout, stage: int) -> float:
    """The layers gathered at once (the one computing, the one prefetched), in backward with their
    unsharded gradients, both in the compute dtype."""
    live = min(SDP_LIVE_LAYERS, held(layout, stage, facts.layers)[0])
    return live * facts.layer_per_rank(layout.tp, layout.ep) * 2 * compute_bytes(layout)


def sdp_root(facts: ModelFacts, layout: Layout, stage: int) -> float:
    """The root unit (embeddings, final norm, head: the stage's parameters outside its layers),
    gathered from its forward to the end of the backward, and its unsharded gradient, which is
    reduce-scattered only when the backward ends (the head's is made at its start)."""
    layers = held(layout, stage, facts.layers)[0]
    root = stage_parameters(facts, layout, stage) - layers * facts.layer_per_rank(layout.tp, layout.ep)
    return root * 2 * compute_bytes(layout)


def sdp_reduce_scatter(facts: ModelFacts, layout: Layout) -> float:
    """FSDP2 copies a layer's gradients into one fp32 buffer to reduce-scatter them (the root's is
    reduce-scattered after the backward, when the activations are gone)."""
    return 4 * facts.layer_per_rank(layout.tp, layout.ep)


def _shards_gradients(layout: Layout, p: float) -> bool:
    """smp's choice (data_parallel/grad_sync.py GradSync.can_shard): asked for, or on by itself
    where the chunk saves over twice the buckets in flight."""
    mode = layout.gradient_sharding
    if mode is None:
        return p * 4 * (1 - 1 / layout.dp_cp) > 2 * SHARDED_GRADIENT_BUCKETS
    return mode


def _gradient_terms(layout: Layout, runtime: Runtime, p: float, chunk: float) -> tuple[float, float, float]:
    """(the gradients accumulated in backward, every gradient copy at the step, the data-parallel
    buckets' copies) in bytes, for `p` parameters of which this rank steps `chunk`."""
    if runtime.gradient_sharding and _shards_gradients(layout, p):
        # This rank's chunk, and the buckets being averaged (data_parallel/grad_sync.py).
        accumulation = at_step = chunk * 4 + SHARDED_GRADIENT_BUCKETS
    elif layout.half and runtime.fp32_accumulation:
        # One fp32 buffer: no copy in the parameters' dtype; the master chunk's gradient is a view.
        accumulation = at_step = p * 4
    elif layout.half:
        accumulation = p * 2
        at_step = accumulation + chunk * 4
    else:
        accumulation = at_step = p * 4
    copies = layout.dp_cp > 1 and runtime.bucket_copies
    return accumulation, at_step, accumulation if copies else 0.0


def _activation_terms(
    facts: ModelFacts, layout: Layout, workload: Workload, stage: int, mb: int
) -> tuple[float, float, float, float]:
    """(saved activations, recompute working set, working memory, pipeline and TP buffers) of one
    stage, in bytes: each cp rank's cut of the sequences (1/cp), the logits whole."""
    elem, tp, cut = compute_bytes(layout), layout.tp, 1 / layout.cp
    n_layers, first, last = held(layout, stage, facts.layers)
    per_layer = facts.saved_layer.per_rank(elem, tp)
    ends = 0.0
    if first:
        ends += facts.saved_before.per_rank(elem, tp)
    if last:
        ends += facts.saved_after.per_rank(elem, tp)
    group = layout.checkpoint_group
    if group:
        regions = math.ceil(n_layers / group)
        kept = min(regions, layout.activation_loading_horizon) if layout.offload_activations else regions
        per_mb = ends + kept * facts.saved_layer_input.per_rank(elem, tp)
        recompute = min(group, n_layers) * per_layer * mb  # one region, one microbatch, in backward
    else:
        per_mb, recompute = ends + n_layers * per_layer, 0.0
    n_alive = alive(layout, stage)
    saved = per_mb * mb * n_alive * cut
    recompute *= cut
    boundary = mb * workload.seq_len * facts.hidden * elem * cut  # one activation crossing a boundary
    working = 2 * boundary  # the gradient of a layer's output and of its input, in backward
    if last:
        logits = mb * facts.logits_elements / tp
        working += logits * elem * n_alive + logits * 4 * cut  # held logits (whole); their fp32 gradient
    comm = 0.0
    if layout.pp > 1:
        comm += 2 * boundary * n_alive  # received input, sent output
    if tp > 1:
        comm += 2 * boundary  # a collective's input and output
    if layout.ep > 1 and facts.experts:
        comm += 2 * facts.top_k * boundary  # one all-to-all's send and receive buffers
    return saved, recompute, working, comm
