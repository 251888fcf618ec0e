"""The Best Practices seed's procedure, walked to its end: go down its list in order, each step
carrying on from the layout the last one reached, and rank every layout that fits by its step
time (step_time.py). The seed stopped at the first configuration that fits; that one is kept as
`first_fit`, and the recommendation says how much faster the fastest fit is.

1. Large GPU instances: not a config key; the walk plans for the GPU memory given and says so.
2. Shard the optimizer state over the data-parallel ranks.
3. Checkpoint activations: every transformer layer ("each"), then two layers per region
   ("group_2": fewer inputs kept, a larger region recomputed). Later steps keep "each", the
   seed's reference choice.
3a. Expert parallelism, for a mixture of experts whose replicated experts do not fit (the layout
   so far, its sharded optimizer state kept): ep = 2, 4, ... (powers of
   two dividing rdp and the experts per layer), each evaluated (more ep, fewer expert replicas to
   average: the fastest that fits is not always the first); each rank holds E/ep of every
   MoE layer's experts; where none fits, sdp over the widest ep (each block of experts sharded over
   the replicas holding it). The next steps start from the layout without ep, ranked beside it;
   where the replicated experts did not fit, steps 4 (tensor parallelism) and 5 (pipeline) also
   try each of their layouts with the widest ep its rdp allows (experts whole per ep rank; smp
   does not run sdp over a captured model with ep, so sdp layouts keep ep only without tp and pp).
4. Split the model's state, where SMP's later best practice put sharded data parallelism first:
   - sharded data parallelism (sdp, in place of the sharded optimizer state, checkpointing kept),
     every degree dividing rdp, degrees whose group stays inside a node first, each kind smallest
     first. Not where the layers themselves do not fit one GPU (even sdp = rdp does not fit: what
     is left is per layer, which only tensor parallelism cuts), nor under fp16 (the seeds' fp16 jobs
     keep SMP v1's sharded optimizer state; plan bf16 to consider sdp);
   - tensor parallelism: a power of two (2, 4, 8, ...) at most the GPUs per node, dividing the
     attention heads (and key/value heads), with prescaled_batch on; then sdp over the largest
     TP layout.
5a. Context parallelism, where the model's state fits but one sequence's activations do not (the
   layout so far, one sequence per microbatch, does not fit while its parameters, gradients and
   optimizer state do): cp = 2, 4, ... (C dividing the GPUs left after tp, the sequence dividing
   into 2C chunks), ring attention ("p2p") and, where the heads per TP rank divide by C, Ulysses
   ("a2a"); at each degree the replica's batch in one microbatch, then one sequence per
   microbatch; raised until one fits. Pipeline stages cut the layers, not a layer's activations
   of a sequence: cp comes before them. Where none fits, the pipeline step carries the largest cp.
5. Pipeline parallelism across nodes (the largest TP degree from step 4 stays inside a node):
   pp = 2, 4, ...; for each, microbatches from the smallest that fills the pipeline up
   (smaller microbatches, less memory each), then, while none of them fits, fewer
   active_microbatches (fewer in flight only saves memory: never faster).
6. Offload activations to the CPU (with checkpointing and pipelining, CUDA only), where nothing
   fits before it (it only saves memory).
"""

from __future__ import annotations

import dataclasses

from smp.planner import memory, step_time
from smp.planner.layout import Layout, cp_problem, ep_problem, sdp_problem
from smp.planner.model_facts import ModelFacts
from smp.planner.units import GiB

MAX_MICROBATCH_CHOICES = 3  # per pipeline degree: the walk lists every layout it tries
SDP_STEP = "4. sharded data parallelism"


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
        "gathered layers (sdp)": b.gathered,
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
    wants_ep: bool = False  # the replicated experts did not fit: tp and pp layouts try ep too

    @property
    def fitted(self) -> bool:
        return any(c.fits for c in self.candidates)

    def attempt(self, step: str, layout: Layout) -> bool:
        try:
            candidate = evaluate(self.facts, layout, self.workload, self.runtime, step)
        except ValueError as e:  # a batch that does not split: that layout is not possible here
            self.notes.append(f"{step}: {layout.describe()} skipped ({e})")
            return False
        self.candidates.append(candidate)
        return candidate.fits

    def attempt_with_ep(self, step: str, layout: Layout) -> bool:
        """`layout` and, where the walk wants ep, the same with the widest ep its rdp allows."""
        fits = self.attempt(step, layout)
        served = self.wants_ep and layout.cp == 1 and (layout.sdp == 1 or layout.pp == layout.tp == 1)
        degrees = ep_degrees(layout, self.facts.experts) if served else []
        if degrees:
            fits |= self.attempt(f"{step}, {EP_STEP} {degrees[-1]}", layout.replace(ep=degrees[-1]))
        return fits

    def probe(self, layout: Layout) -> Candidate | None:
        """`layout` evaluated without listing it (None where its batch does not split)."""
        try:
            return evaluate(self.facts, layout, self.workload, self.runtime)
        except ValueError:
            return None


def walk(facts: ModelFacts, workload: memory.Workload, runtime: memory.Runtime, precision: str) -> Walk:
    w = Walk(facts, workload, runtime)
    half = {"fp16": {"fp16": True}, "bf16": {"bf16": True}, "fp32": {}}[precision]
    start = Layout(rdp=workload.gpus, **half)
    steps = (
        _data_parallel,
        _large_gpus,
        _shard,
        _checkpoint,
        _expert_parallel,
        _sharded_data_parallel,
        _tensor_parallel,
        _sharded_with_tensor_parallel,
        _context_parallel,
        _pipeline,
        _offload,
    )
    for step in steps:
        start = step(w, start)
    return w


def first_fit(candidates) -> Candidate | None:
    """The seed's answer: the first layout in its order that fits."""
    return next((c for c in candidates if c.fits), None)


def fastest_fit(candidates) -> Candidate | None:
    """The recommendation: the layout that fits with the shortest step (the earlier on a tie)."""
    fits = [c for c in candidates if c.fits]
    return min(fits, key=lambda c: c.time.total) if fits else None


def _data_parallel(w: Walk, layout: Layout) -> Layout:
    w.attempt("data parallelism only", layout)
    return layout


def _large_gpus(w: Walk, layout: Layout) -> Layout:
    w.notes.append(
        f"1. large GPU instances: planning for the {w.workload.gpu_memory / GiB:.0f} GiB per GPU given; the "
        "seed recommends the largest (ml.p4d, ml.p3dn); with more memory per GPU more layouts fit"
    )
    return layout


def _shard(w: Walk, layout: Layout) -> Layout:
    if layout.rdp == 1:
        w.notes.append(
            "2. sharded optimizer state: skipped, one data-parallel rank has nothing to shard with"
        )
        return layout
    sharded = layout.replace(shard_optimizer_state=True)
    w.attempt("2. shard optimizer state", sharded)
    return sharded


def _checkpoint(w: Walk, layout: Layout) -> Layout:
    each = layout.replace(checkpointing="each")
    w.attempt("3. activation checkpointing (each layer)", each)
    w.attempt("3. activation checkpointing (group_2)", layout.replace(checkpointing="group_2"))
    return each


def _sharded_data_parallel(w: Walk, layout: Layout, step: str = SDP_STEP) -> Layout:
    """Every usable sdp degree, in order; the layout carries on unchanged (sdp is not carried on:
    it replaces shard_optimizer_state, and TP and PP start from the sharded state)."""
    base = layout.replace(shard_optimizer_state=False, shard_gradients=None)
    degrees = sdp_degrees(base, w.workload)
    usable = [n for n in degrees if not sdp_problem(base.replace(sdp=n))]
    if not usable:
        why = sdp_problem(base.replace(sdp=degrees[0])) if degrees else "one data-parallel rank"
        w.notes.append(f"{step}: skipped ({why})")
        return layout
    widest = w.probe(base.replace(sdp=max(usable)))  # the least memory sdp can reach
    if widest is None or not widest.fits:
        detail = widest.reason.removeprefix("does not fit: ") if widest else "cannot split the batch"
        then = "tensor parallelism cuts the layers" if layout.tp == 1 else "pipeline stages next"
        even = f"even sdp={max(usable)} {detail}"
        w.notes.append(f"{step}: skipped, the layers themselves do not fit one GPU: {even}; {then}")
        return layout
    for n in usable:
        w.attempt(f"{step} {n}", base.replace(sdp=n))
    return layout


def sdp_degrees(layout: Layout, workload: memory.Workload) -> list[int]:
    """The sdp degrees above 1 dividing rdp: those whose groups stay inside a node (NVLink) first,
    each kind smallest first."""
    divisors = [n for n in range(2, layout.rdp + 1) if layout.rdp % n == 0]
    return sorted(divisors, key=lambda n: (step_time.sdp_spans_nodes(layout.replace(sdp=n), workload), n))


def _sharded_with_tensor_parallel(w: Walk, layout: Layout) -> Layout:
    if layout.tp == 1:  # no TP layout to shard: step 4's sdp already tried these
        return layout
    return _sharded_data_parallel(w, layout, f"4. tensor parallelism {layout.tp}, sharded data parallelism")


def _tensor_parallel(w: Walk, layout: Layout) -> Layout:
    best, tp = layout, 2
    while tp <= w.workload.gpus_per_node:
        why = _tp_unusable(w, tp)
        if why:
            w.notes.append(f"4. tensor parallelism {tp}: skipped ({why})")
        else:
            best = layout.replace(tp=tp, rdp=w.workload.gpus // (tp * layout.cp), prescaled_batch=True)
            w.attempt_with_ep(f"4. tensor parallelism {tp}", best)
        tp *= 2
    return best


def _tp_unusable(w: Walk, tp: int) -> str:
    facts, gpus = w.facts, w.workload.gpus
    if facts.heads % tp or facts.kv_heads % tp:
        return f"{tp} does not divide the {facts.heads} heads / {facts.kv_heads} key-value heads"
    if gpus % tp:
        return f"{tp} does not divide the {gpus} GPUs"
    return ""


def _pipeline(w: Walk, layout: Layout) -> Layout:
    last, pp = layout, 2
    while pp <= w.facts.layers and w.workload.gpus % (pp * layout.tp * layout.cp) == 0:
        rdp = w.workload.gpus // (pp * layout.tp * layout.cp)
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
        fitted = False
        for i, m in enumerate(choices):
            last = staged.replace(microbatches=m, active_microbatches=None)
            step = f"5. pipeline {pp} across nodes" if i == 0 else f"5. pipeline {pp}, more microbatches"
            fitted |= w.attempt_with_ep(f"{step} (m={m})", last)
        # Fewer microbatches in flight only save memory: tried while none of this degree fits.
        for active in range(last.active - 1, 0, -1):
            if fitted:
                break
            last = last.replace(active_microbatches=active)
            fitted = w.attempt_with_ep(f"5. pipeline {pp}, fewer active microbatches ({active})", last)
        pp *= 2
    return last


def _offload(w: Walk, layout: Layout) -> Layout:
    if w.fitted:
        return layout  # offloading only saves memory: not tried where a layout already fits
    if layout.pp == 1 or layout.microbatches == 1:
        w.notes.append("6. offloading activations: skipped (it needs pipelining with several microbatches)")
        return layout
    offloaded = layout.replace(offload_activations=True, active_microbatches=None)
    w.attempt("6. offload activations (CUDA)", offloaded)
    return offloaded


EP_STEP = "3a. expert parallelism"


def _expert_parallel(w: Walk, layout: Layout) -> Layout:
    """ep where the replicated experts do not fit (see the module's docstring); the layout carries
    on without it."""
    if not w.facts.experts:
        return layout  # a dense model: nothing to say
    base = layout
    replicated = w.probe(base)
    if replicated is not None and replicated.fits:
        w.notes.append(f"{EP_STEP}: skipped (the experts fit replicated: {replicated.reason})")
        return layout
    degrees = ep_degrees(base, w.facts.experts)
    if not degrees:
        w.notes.append(
            f"{EP_STEP}: skipped (no power of two above 1 divides both rdp {base.rdp} and the "
            f"{w.facts.experts} experts)"
        )
        return layout
    w.wants_ep = True
    fits = [w.attempt(f"{EP_STEP} {n}", base.replace(ep=n)) for n in degrees]  # each ranked
    if not any(fits):
        # The widest ep, its non-experts sharded over sdp and each block of experts over the
        # replicas holding it (FSDP2), before the steps that start from the layout without ep.
        widest = base.replace(ep=degrees[-1])
        _sharded_data_parallel(w, widest, f"{EP_STEP} {degrees[-1]}, sharded data parallelism")
        w.notes.append(
            f"{EP_STEP}: none fits up to ep={degrees[-1]} alone; the next steps start from the "
            "layout without ep, their tp and pp layouts also tried with ep"
        )
    return layout


def ep_degrees(layout: Layout, experts: int) -> list[int]:
    """The ep degrees the walk tries: powers of two above 1 dividing rdp and the experts."""
    degrees, n = [], 2
    while n <= min(layout.rdp, experts):
        if not ep_problem(layout.replace(ep=n), experts):
            degrees.append(n)
        n *= 2
    return degrees


CP_STEP = "5a. context parallelism"
CP_COMMS = ("p2p", "a2a")  # the ring (smp's default), then Ulysses where the heads divide


def _context_parallel(w: Walk, layout: Layout) -> Layout:
    """cp where one sequence's activations are what does not fit (see the module's docstring)."""
    why = _cp_not_needed(w, layout)
    if why:
        w.notes.append(f"{CP_STEP}: skipped ({why})")
        return layout
    widest, c = layout, 2
    left = w.workload.gpus // (layout.pp * layout.tp)
    while c <= left:
        fitted = False
        for comm in CP_COMMS:
            cut = layout.replace(cp=c, cp_comm=comm, rdp=left // c, microbatches=1, active_microbatches=None)
            why = cp_unusable(w, cut)
            if why:
                w.notes.append(f"{CP_STEP} {c} {comm}: skipped ({why})")
                continue
            widest = cut if widest.cp < c else widest
            ok = w.attempt(f"{CP_STEP} {c} {comm}", cut)
            m = w.workload.global_batch // cut.rdp
            if not ok and m > 1 and w.workload.global_batch % cut.rdp == 0:
                step = f"{CP_STEP} {c} {comm}, one sequence per microbatch (m={m})"
                ok = w.attempt(step, cut.replace(microbatches=m))
            fitted |= ok
        if fitted:
            return layout  # the pipeline step starts from the layout without cp, ranked beside it
        c *= 2
    return widest


def _cp_not_needed(w: Walk, layout: Layout) -> str:
    """Why cp is not tried ("" where the model's state fits and one sequence's activations do not)."""
    per_replica = w.workload.global_batch // layout.rdp
    one = w.probe(layout.replace(microbatches=max(1, per_replica), active_microbatches=None))
    if one is None:
        return "the batch does not split over the replicas"
    if one.fits:
        return "one sequence per microbatch fits without it"
    b = one.breakdown
    state = b.parameters + b.gradients + b.optimizer_state + b.masters + b.gathered
    if state * (1 + memory.FRAGMENTATION) + memory.CONTEXT_BYTES > w.workload.gpu_memory:
        return f"the model's state alone ({state / GiB:.1f} GiB) does not fit: pipeline stages cut it"
    return ""


def cp_unusable(w: Walk, layout: Layout) -> str:
    """Why `layout`'s cp degree is not proposed ("" where it can be)."""
    left = w.workload.gpus // (layout.pp * layout.tp)
    if left % layout.cp:
        return f"{layout.cp} does not divide the {left} GPUs left after pp x tp"
    return cp_problem(layout, w.workload.seq_len, w.facts.heads)
