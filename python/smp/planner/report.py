"""The planner's answer: as JSON-ready dicts and as a table for people."""

from __future__ import annotations

import dataclasses
from typing import Any

from smp.planner import memory
from smp.planner.model_facts import ModelFacts
from smp.planner.units import GiB, gib
from smp.planner.walk import Candidate

_PARTS = (
    "parameters",
    "gradients",
    "optimizer_state",
    "masters",
    "activations",
    "recompute",
    "working",
    "communication",
    "gathered",
)


def breakdown_json(b: memory.Breakdown) -> dict[str, Any]:
    out: dict[str, Any] = {f"{part}_gib": gib(getattr(b, part)) for part in _PARTS}
    out.update(
        activations_per_microbatch_gib=gib(b.activations / b.microbatches_alive),
        peak_gib=gib(b.peak),
        margin_gib=gib(b.margin),
        total_gib=gib(b.total),
        stage=b.stage,
        microbatch_size=b.microbatch_size,
        microbatches_alive=b.microbatches_alive,
    )
    return out


def candidate_json(c: Candidate) -> dict[str, Any]:
    t = c.time
    return {
        "step": c.step,
        "config": c.layout.smp_config(),
        "memory_gib": gib(c.breakdown.peak),
        "fits": c.fits,
        "reason": c.reason,
        "breakdown": breakdown_json(c.breakdown),
        "step_time": {
            "relative": round(t.relative, 3),
            "seconds": round(t.total, 4),
            "compute_s": round(t.compute, 4),
            "bubble_s": round(t.bubble, 4),
            "tp_comm_s": round(t.tp_comm, 4),
            "pp_comm_s": round(t.pp_comm, 4),
            "dp_comm_s": round(t.dp_comm, 4),
            "sdp_comm_s": round(t.sdp_comm, 4),
        },
    }


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """`recommended` is a ready smp config (plus "activation_checkpointing") or None; `candidates`
    every layout the walk evaluated, in order; `evaluated` the one layout asked about (--layout)."""

    facts: ModelFacts
    workload: memory.Workload
    runtime: str
    candidates: tuple[Candidate, ...] = ()
    notes: tuple[str, ...] = ()
    evaluated: Candidate | None = None

    @property
    def recommended_candidate(self) -> Candidate | None:
        return next((c for c in self.candidates if c.fits), None)

    @property
    def recommended(self) -> dict[str, Any] | None:
        c = self.recommended_candidate
        return c.layout.smp_config() if c else None

    def to_json(self) -> dict[str, Any]:
        if self.evaluated is not None:
            e = self.evaluated
            return {
                "evaluated": {
                    "config": e.layout.smp_config(),
                    "memory_gib": gib(e.breakdown.peak),
                    "fits": e.fits,
                    "breakdown": breakdown_json(e.breakdown),
                }
            }
        return {"recommended": self.recommended, "candidates": [candidate_json(c) for c in self.candidates]}

    def table(self) -> str:
        w, f = self.workload, self.facts
        lines = [
            f"model: {f.parameters / 1e9:.2f}B parameters, {f.layers} layers, hidden {f.hidden}, "
            f"{f.heads} heads, vocab {f.vocab} ({f.source})",
            f"job: {w.gpus} GPUs ({w.gpus_per_node} per node, {w.gpu_memory / GiB:.0f} GiB each), "
            f"global batch {w.global_batch}, sequence {w.seq_len}; memory model: {self.runtime}",
            "",
            _header(),
        ]
        rows = [self.evaluated] if self.evaluated is not None else list(self.candidates)
        lines += [_row(c) for c in rows]
        lines.append("")
        lines += [f"  {c.step}: {c.reason}" for c in rows]
        lines += [f"  note: {n}" for n in self.notes]
        if self.evaluated is None:
            rec = self.recommended
            lines.append("")
            lines.append(f"recommended: {rec}" if rec else "recommended: none fits; see the reasons above")
        lines.append(
            "GiB per GPU on its fullest stage; margin = 1 GiB + 10% of the peak; work includes sdp's "
            "gathered layers; time = step time over the ideal (assumptions: smp/planner/step_time.py)"
        )
        return "\n".join(lines)


def _header() -> str:
    cols = ("params", "grads", "optim", "activ", "work", "comm", "peak", "+margin", "fits", "time")
    return f"{'layout':<72}" + "".join(f"{c:>8}" for c in cols)


def _row(c: Candidate) -> str:
    b = c.breakdown
    cells = [
        b.parameters,
        b.gradients,
        b.optimizer_state + b.masters,
        b.activations,
        b.working + b.gathered,  # sdp's gathered layers are working memory, in one column
        b.communication,
    ]
    cells += [b.peak, b.total]
    text = "".join(f"{x / GiB:>8.1f}" for x in cells)
    return f"{c.layout.describe():<72}{text}{'yes' if c.fits else 'no':>8}{c.time.relative:>8.2f}"
