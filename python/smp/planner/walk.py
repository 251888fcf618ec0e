"""The Best Practices seed's procedure: go down its list in order and stop at the first
configuration that fits.

1. Large GPU instances: not a config key; the walk plans for the GPU memory given and says so.
2. Shard the optimizer state over the data-parallel ranks.
3. Checkpoint activations: every transformer layer ("each"), then two layers per region
   ("group_2": fewer inputs kept, a larger region recomputed). Later steps keep "each", the
   seed's reference choice.
4. Tensor parallelism: a power of two (2, 4, 8, ...) at most the GPUs per node, dividing the
   attention heads (and key/value heads), with prescaled_batch on.
5. Pipeline parallelism across nodes (the largest TP degree from step 4 stays inside a node):
   pp = 2, 4, ...; for each, microbatches from the smallest that fills the pipeline up
   (smaller microbatches, less memory each), then fewer active_microbatches.
6. Offload activations to the CPU (with checkpointing and pipelining, CUDA only).
"""

from __future__ import annotations

import dataclasses

from smp.planner import memory, step_time
from smp.planner.layout import Layout
from smp.planner.model_facts import ModelFacts
from smp.planner.units import GiB

MAX_MICROBATCH_CHOICES = 3  # per pipeline degree: the walk lists every layout it tries


@dataclasses.dataclass(frozen=True)
class Candidate:
    step: str
    layout: Layout
    breakdown: memory.Breakdown
    time: step_time.StepTime
    fits: bool
    reason: str


def evaluate(
    facts: ModelFacts,
    layout: Layout,
    workload: memory.Workload,
    runtime: memory.Runtime,
    step: str = "evaluated",
) -> Candidate:
    breakdown = memory.estimate(facts, layout, workload, runtime)
    fits = breakdown.total <= workload.gpu_memory
    return Candidate(
        step,
        layout,
        breakdown,
        step_time.estimate(facts, layout, workload),
        fits,
        _reason(breakdown, workload, fits),
    )


def _reason(b: memory.Breakdown, workload: memory.Workload, fits: bool) -> str:
    cap = workload.gpu_memory / GiB
    need = f"{b.total / GiB:.1f} GiB (peak {b.peak / GiB:.1f} + margin {b.margin / GiB:.1f})"
    if fits:
        return f"fits: {need} of {cap:.0f} GiB"
    parts = {
        "parameters": b.parameters,
        "gradients": b.gradients,
        "optimizer state": b.optimizer_state + b.masters,
        "activations": b.activations,
        "communication": b.communication,
    }
    largest = sorted(parts.items(), key=lambda kv: -kv[1])[:2]
    named = ", ".join(f"{k} {v / GiB:.1f}" for k, v in largest)
    return f"does not fit: needs {need} on stage {b.stage}, over {cap:.0f} GiB (largest: {named} GiB)"


@dataclasses.dataclass
class Walk:
    facts: ModelFacts
    workload: memory.Workload
    runtime: memory.Runtime
    candidates: list[Candidate] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def attempt(self, step: str, layout: Layout) -> bool:
        try:
            candidate = evaluate(self.facts, layout, self.workload, self.runtime, step)
        except ValueError as e:  # a batch that does not split: that layout is not possible here
            self.notes.append(f"{step}: {layout.describe()} skipped ({e})")
            return False
        self.candidates.append(candidate)
        return candidate.fits


def walk(facts: ModelFacts, workload: memory.Workload, runtime: memory.Runtime, precision: str) -> Walk:
    w = Walk(facts, workload, runtime)
    half = {"fp16": {"fp16": True}, "bf16": {"bf16": True}, "fp32": {}}[precision]
    start = Layout(rdp=workload.gpus, **half)
    for step in (_data_parallel, _large_gpus, _shard, _checkpoint, _tensor_parallel, _pipeline, _offload):
        start = step(w, start)
        if start is None:
            break
    return w


def _data_parallel(w: Walk, layout: Layout) -> Layout | None:
    return None if w.attempt("data parallelism only", layout) else layout


def _large_gpus(w: Walk, layout: Layout) -> Layout:
    w.notes.append(
        f"1. large GPU instances: planning for the {w.workload.gpu_memory / GiB:.0f} GiB per GPU given; the "
        "seed recommends the largest (ml.p4d, ml.p3dn); with more memory per GPU the walk may stop earlier"
    )
    return layout


def _shard(w: Walk, layout: Layout) -> Layout | None:
    if layout.rdp == 1:
        w.notes.append(
            "2. sharded optimizer state: skipped, one data-parallel rank has nothing to shard with"
        )
        return layout
    sharded = layout.replace(shard_optimizer_state=True)
    return None if w.attempt("2. shard optimizer state", sharded) else sharded


def _checkpoint(w: Walk, layout: Layout) -> Layout | None:
    each = layout.replace(checkpointing="each")
    if w.attempt("3. activation checkpointing (each layer)", each):
        return None
    if w.attempt("3. activation checkpointing (group_2)", layout.replace(checkpointing="group_2")):
        return None
    return each


def _tensor_parallel(w: Walk, layout: Layout) -> Layout | None:
    best, tp = layout, 2
    while tp <= w.workload.gpus_per_node:
        why = _tp_unusable(w, tp)
        if why:
            w.notes.append(f"4. tensor parallelism {tp}: skipped ({why})")
        else:
            best = layout.replace(tp=tp, rdp=w.workload.gpus // tp, prescaled_batch=True)
            if w.attempt(f"4. tensor parallelism {tp}", best):
                return None
        tp *= 2
    return best


def _tp_unusable(w: Walk, tp: int) -> str:
    facts, gpus = w.facts, w.workload.gpus
    if facts.heads % tp or facts.kv_heads % tp:
        return f"{tp} does not divide the {facts.heads} heads / {facts.kv_heads} key-value heads"
    if gpus % tp:
        return f"{tp} does not divide the {gpus} GPUs"
    return ""


def _pipeline(w: Walk, layout: Layout) -> Layout | None:
    last, pp = layout, 2
    while pp <= w.facts.layers and w.workload.gpus % (pp * layout.tp) == 0:
        rdp = w.workload.gpus // (pp * layout.tp)
        staged = layout.replace(pp=pp, rdp=rdp, prescaled_batch=layout.tp > 1)
        per_replica = w.workload.global_batch // rdp
        choices = [m for m in range(pp, per_replica + 1) if per_replica % m == 0][:MAX_MICROBATCH_CHOICES]
        if w.workload.global_batch % rdp or not choices:
            w.notes.append(
                f"5. pipeline {pp}: skipped (a replica's batch of {w.workload.global_batch / rdp:g} "
                f"cannot fill {pp} stages)"
            )
            pp *= 2
            continue
        for i, m in enumerate(choices):
            last = staged.replace(microbatches=m, active_microbatches=None)
            step = f"5. pipeline {pp} across nodes" if i == 0 else f"5. pipeline {pp}, more microbatches"
            if w.attempt(f"{step} (m={m})", last):
                return None
        for active in range(min(pp + 2, last.microbatches) - 1, 0, -1):
            last = last.replace(active_microbatches=active)
            if w.attempt(f"5. pipeline {pp}, fewer active microbatches ({active})", last):
                return None
        pp *= 2
    return last


def _offload(w: Walk, layout: Layout) -> Layout | None:
    if layout.pp == 1 or layout.microbatches == 1:
        w.notes.append("6. offloading activations: skipped (it needs pipelining with several microbatches)")
        return layout
    offloaded = layout.replace(offload_activations=True, active_microbatches=None)
    return None if w.attempt("6. offload activations (CUDA)", offloaded) else offloaded
