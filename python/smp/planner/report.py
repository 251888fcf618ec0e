"""The planner's answer: as JSON-ready dicts and as a table for people."""

from __future__ import annotations

import dataclasses
from typing import Any

from smp.planner import memory, step_time
from smp.planner.model_facts import ModelFacts
from smp.planner.units import GiB, gib
from smp.planner.walk import Candidate, fastest_fit, first_fit

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


def step_time_json(t: step_time.StepTime) -> dict[str, Any]:
    out: dict[str, Any] = {"seconds": _round(t.total), "relative": round(t.relative, 3)}
    out.update({f"{part}_s": _round(seconds) for part, seconds in t.parts().items()})
    return out


def throughput_json(t: step_time.StepTime) -> dict[str, Any]:
    return {
        "tokens_per_s_per_gpu": round(t.tokens_per_second_per_gpu, 1),
        "tflops_per_gpu": round(t.tflops_per_gpu, 2),
        "mfu": round(t.mfu, 4),
    }


def _round(seconds: float) -> float:
    return float(f"{seconds:.4g}")


def candidate_json(c: Candidate) -> dict[str, Any]:
    return {
        "step": c.step,
        "config": c.layout.smp_config(),
        "memory_gib": gib(c.breakdown.peak),
        "fits": c.fits,
        "reason": c.reason,
        "breakdown": breakdown_json(c.breakdown),
        "step_time": step_time_json(c.time),
        "throughput": throughput_json(c.time),
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
        """The fastest layout that fits."""
        return fastest_fit(self.candidates)

    @property
    def first_fit(self) -> Candidate | None:
        """The Best Practices seed's answer: the first layout in its order that fits."""
        return first_fit(self.candidates)

    @property
    def speedup(self) -> float | None:
        """How much faster the recommendation's step is than the seed's first fit's."""
        best, first = self.recommended_candidate, self.first_fit
        return first.time.total / best.time.total if best and first else None

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
                    "step_time": step_time_json(e.time),
                    "throughput": throughput_json(e.time),
                }
            }
        first = self.first_fit
        return {
            "recommended": self.recommended,
            "first_fit": first.layout.smp_config() if first else None,
            "speedup_over_first_fit": round(self.speedup, 3) if self.speedup else None,
            "hardware": self.workload.hardware.name if self.workload.hardware else None,
            "candidates": [candidate_json(c) for c in self.candidates],
        }

    def table(self) -> str:
        w, f = self.workload, self.facts
        hw = w.hardware
        lines = [
            f"model: {f.parameters / 1e9:.2f}B parameters, {f.layers} layers, hidden {f.hidden}, "
            f"{f.heads} heads, vocab {f.vocab} ({f.source})",
            f"job: {w.gpus} GPUs ({w.gpus_per_node} per node, {w.gpu_memory / GiB:.0f} GiB each), "
            f"global batch {w.global_batch}, sequence {w.seq_len}; memory model: {self.runtime}",
        ]
        if hw is not None:
            lines.append(f"hardware: {hw.name}: {hw.description}")
        lines += ["", _header()]
        rows = [self.evaluated] if self.evaluated is not None else list(self.candidates)
        lines += [_row(c) for c in rows]
        lines.append("")
        lines += [f"  {c.step}: {c.reason}" for c in rows]
        lines += [f"  note: {n}" for n in self.notes]
        lines.append("")
        lines += self._conclusion()
        lines.append(
            "GiB per GPU on its fullest stage; margin = 1 GiB + 10% of the peak; work includes sdp's "
            "gathered layers; step s, tokens/s and model TFLOP/s per GPU, MFU of the spec peak "
            "(assumptions: smp/planner/step_time.py, figures: smp/planner/hardware_presets.py)"
        )
        return "\n".join(lines)

    def _conclusion(self) -> list[str]:
        if self.evaluated is not None:
            return [f"where the time goes: {time_split(self.evaluated.time)}"]
        best, first = self.recommended_candidate, self.first_fit
        if best is None:
            return ["recommended: none fits; see the reasons above"]
        lines = [
            f"recommended (the fastest that fits): {best.layout.describe()}: {best.time.total:.3g} s a step, "
            f"{best.time.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, MFU {best.time.mfu:.1%}",
            f"  {self.speedup:.2f}x the Best Practices order's first fit ({first.layout.describe()}, "
            f"{first.time.total:.3g} s)",
            f"  where the time goes: {time_split(best.time)}",
            f"  config: {self.recommended}",
        ]
        return lines


def time_split(t: step_time.StepTime) -> str:
    """The step's parts as shares of it, largest first (those under 0.5% left out)."""
    parts = sorted(t.parts().items(), key=lambda kv: -kv[1])
    return ", ".join(
        f"{name} {seconds / t.total:.0%}" for name, seconds in parts if seconds / t.total >= 0.005
    )


def _header() -> str:
    cols = ("params", "grads", "optim", "activ", "work", "comm", "peak", "+margin", "fits")
    speed = ("step s", "tok/s/GPU", "TFLOP/s", "MFU")
    return f"{'layout':<84}" + "".join(f"{c:>8}" for c in cols) + "".join(f"{c:>10}" for c in speed)


def _row(c: Candidate) -> str:
    b, t = c.breakdown, c.time
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
    speed = f"{t.total:>10.3g}{t.tokens_per_second_per_gpu:>10,.0f}{t.tflops_per_gpu:>10.1f}{t.mfu:>10.1%}"
    return f"{c.layout.describe():<84}{text}{'yes' if c.fits else 'no':>8}{speed}"
