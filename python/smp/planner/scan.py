"""One model planned over several cluster sizes (`python -m smp.plan ... --scan-gpus 8,64,512`):
the recommended layout and its predicted throughput at each size, for weak scaling (the batch
grows with the GPUs: the job's batch per GPU is kept) and strong scaling (the job's global batch
is kept), and a picture of tokens/s per GPU against GPUs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from smp.planner import make_workload, plan_job
from smp.planner.model_facts import ModelFacts
from smp.planner.report import PlanResult, throughput_json

SCALINGS = ("weak", "strong")
WIDTH = 84  # the layout column


@dataclasses.dataclass(frozen=True)
class ScanPoint:
    scaling: str
    gpus: int
    global_batch: int
    result: PlanResult | None  # None: the batch cannot be formed at this size
    why: str = ""


def parse_sizes(text: str) -> list[int]:
    """'8,64,512' as [8, 64, 512]; a ValueError names the bad entry and the fix."""
    sizes = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(
                f"smp.plan: --scan-gpus entry {part!r} is not a positive integer; write GPU counts "
                "separated by commas, e.g. 8,64,512,4096"
            )
        sizes.append(int(part))
    return sizes


def scan(
    facts: ModelFacts,
    sizes: Sequence[int],
    seq_len: int,
    global_batch: int,
    reference_gpus: int,
    scalings: Sequence[str] = SCALINGS,
    *,
    hardware=None,
    gpus_per_node: int | None = None,
    gpu_memory=None,
    precision: str = "bf16",
    runtime: str = "smp",
) -> list[ScanPoint]:
    """Plans the job at each size. Weak scaling keeps global_batch / reference_gpus samples per
    GPU; strong scaling keeps global_batch. Every size is checked before anything is planned."""
    for gpus in sizes:  # a size that does not fill nodes is the user's mistake, not a scan result
        make_workload(seq_len, global_batch, gpus, gpus_per_node, gpu_memory, hardware)
    points = []
    for scaling in scalings:
        for gpus in sizes:
            batch, why = _batch(scaling, global_batch, reference_gpus, gpus)
            if why:
                points.append(ScanPoint(scaling, gpus, 0, None, why))
                continue
            workload = make_workload(seq_len, batch, gpus, gpus_per_node, gpu_memory, hardware)
            points.append(
                ScanPoint(scaling, gpus, batch, plan_job(facts, workload, None, precision, runtime))
            )
    return points


def _batch(scaling: str, global_batch: int, reference_gpus: int, gpus: int) -> tuple[int, str]:
    if scaling == "strong":
        return global_batch, ""
    batch, rest = divmod(global_batch * gpus, reference_gpus)
    if rest or batch < 1:
        per_gpu = global_batch / reference_gpus
        return 0, f"{per_gpu:g} samples per GPU do not make a whole batch on {gpus} GPUs"
    return batch, ""


def table(points: Sequence[ScanPoint]) -> str:
    lines = []
    for scaling in dict.fromkeys(p.scaling for p in points):
        kept = "batch per GPU kept" if scaling == "weak" else "global batch kept"
        lines += [f"{scaling} scaling ({kept}):", _header()]
        lines += [_row(p) for p in points if p.scaling == scaling]
        lines.append("")
    return "\n".join(lines).rstrip()


def _header() -> str:
    cols = ("GPUs", "batch", "step s", "tok/s/GPU", "TFLOP/s", "MFU", "GiB", "vs first")
    return f"{cols[0]:>6}{cols[1]:>8}  {'recommended layout':<{WIDTH}}" + "".join(
        f"{c:>10}" for c in cols[2:]
    )


def _row(p: ScanPoint) -> str:
    head = f"{p.gpus:>6}{p.global_batch or '-':>8}  "
    best = p.result.recommended_candidate if p.result else None
    if best is None:
        return head + (p.why or "none fits (see `python -m smp.plan` at this size for why)")
    t = best.time
    speedup = p.result.speedup or 1.0
    cells = (
        f"{t.total:>10.3g}{t.tokens_per_second_per_gpu:>10,.0f}{t.tflops_per_gpu:>10.1f}{t.mfu:>10.1%}"
        f"{best.breakdown.total / 2**30:>10.1f}{speedup:>9.2f}x"
    )
    return head + f"{best.layout.describe():<{WIDTH}}" + cells


def to_json(points: Sequence[ScanPoint]) -> list[dict]:
    out = []
    for p in points:
        best = p.result.recommended_candidate if p.result else None
        entry = {"scaling": p.scaling, "gpus": p.gpus, "global_batch": p.global_batch or None}
        if best is None:
            entry.update(recommended=None, why=p.why or "none fits")
        else:
            entry.update(
                recommended=best.layout.smp_config(),
                step_s=float(f"{best.time.total:.4g}"),
                speedup_over_first_fit=round(p.result.speedup or 1.0, 3),
                **throughput_json(best.time),
            )
        out.append(entry)
    return out


def plot(points: Sequence[ScanPoint], path: str, title: str) -> None:
    """tokens/s per GPU against GPUs, one line per scaling, as a PNG (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError(f"smp.plan: --plot needs matplotlib ({e}); pip install matplotlib") from e
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for scaling in dict.fromkeys(p.scaling for p in points):
        xs, ys = [], []
        for p in points:
            best = p.result.recommended_candidate if p.result and p.scaling == scaling else None
            if best is not None:
                xs.append(p.gpus)
                ys.append(best.time.tokens_per_second_per_gpu)
        ax.plot(xs, ys, marker="o", label=f"{scaling} scaling")
    ax.set_xscale("log", base=2)
    sizes = sorted({p.gpus for p in points})
    ax.set_xticks(sizes, [str(g) for g in sizes])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("predicted tokens/s per GPU")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
