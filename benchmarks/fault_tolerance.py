"""Training that survives a lost rank (issue 49): the main job killed and brought back.

    python benchmarks/fault_tolerance.py                      # 20 killed runs, then 4 -> 2 and 8 -> 4
    python benchmarks/fault_tolerance.py --runs 4 --part kills   [--seed 0] [--dir DIR] [--json FILE]

(from the repository root; the runs use this tree's python/ through PYTHONPATH)

**kills.** The main job (examples/train_gpt2.py, a tiny GPT-2: 2 layers, dim 64, sequences of 32,
30 steps, a checkpoint every 5, fp32 on CPU) on 4 processes, alternately pp=2 x tp=2 and
sdp=2 x tp=2, under `torchrun --standalone --max-restarts=3`. In each run one rank, drawn at
random, is SIGKILLed: half the runs after a random step (1-29) as rank 0 logs it, half while a
checkpoint (of a random save step) is being written, its `.incomplete` folder present. torchrun
restarts the workers, which resume from the newest complete checkpoint. Every run must finish, and
its final checkpoint (read with torch.distributed.checkpoint.format_utils.dcp_to_torch_save) is
compared with an uninterrupted run's of the same layout: the largest difference of any parameter
or optimizer tensor (goal: within 1e-6; bitwise where 0), and of any logged loss. "during a save"
is what the restarted job says: a warning naming the torn save. Seconds lost = the run's wall time
minus the uninterrupted run's (the mean of two), so it holds the restart, the
re-imports, smp.init, the resume and the steps redone since the checkpoint.

**fewer.** The job on its original layout killed whole while the save of step 20 is being written
(so it resumes from step 15), then started again on half the processes: 4 -> 2 (pp2 x tp2 ->
pp2 x tp1) and 8 -> 4 (pp2 x tp2 x rdp2 -> pp2 x tp2). The job keeps its checkpoint's global batch
and microbatch size (more microbatches per rank). The losses it logs after the resume and its final
checkpoint are compared with an uninterrupted run on the original layout (goal: within 1e-6).

Each run's folder (--dir, default a fresh one in /tmp) keeps its log.txt, log.csv and checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
import main_job_runs as runs  # noqa: E402  (the tests' helpers for the main job under torchrun)

STEPS, SAVE_EVERY = 30, 5
JOB = ["--layers", "2", "--dim", "64", "--seq-len", "32", "--steps", str(STEPS)]
JOB += ["--save-every", str(SAVE_EVERY), "--log-every", "1"]
LAYOUTS = {
    "pp2tp2": (4, ["--pp", "2", "--tp", "2"]),
    "sdp2tp2": (4, ["--sdp", "2", "--tp", "2", "--pp", "1"]),
    "pp2tp2rdp2": (8, ["--pp", "2", "--tp", "2"]),
    "pp2tp1": (2, ["--pp", "2", "--tp", "1"]),
}
FEWER = {"4 -> 2": ("pp2tp2", "pp2tp1"), "8 -> 4": ("pp2tp2rdp2", "pp2tp2")}
KILL_SAVE_OF = 20  # the fewer runs: killed while this step's checkpoint is written
ONCE = {"pp2tp2rdp2"}  # (8 processes on a small machine: one uninterrupted run)
TORN = "is a save that was killed before it completed"
TIMEOUT = 600


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="killed runs (alternating the two layouts)")
    p.add_argument("--part", choices=("all", "kills", "fewer"), default="all")
    p.add_argument("--seed", type=int, default=0, help="draws the ranks and steps killed")
    p.add_argument("--dir", default=None, help="where the runs' folders go (default: a fresh one in /tmp)")
    p.add_argument("--json", default=None, help="write every run's figures here")
    return p.parse_args()


class Run:
    """One launch of the job in its own folder; its wall time from start to exit."""

    def __init__(self, base: Path, name: str, layout: str, restarts: int = 3):
        self.folder = base / name
        self.folder.mkdir(parents=True)
        procs, flags = LAYOUTS[layout]
        self.start = time.perf_counter()
        self.proc = runs.torchrun(procs, self.folder, JOB + flags, restarts=restarts)

    def finish(self) -> float:
        runs.finish(self.proc, self.folder, timeout=TIMEOUT)
        return time.perf_counter() - self.start

    def close(self) -> None:
        if self.proc.poll() is None:  # (a failed wait: nothing of the job is left running)
            runs.kill_all(self.proc)


class Reference:
    """An uninterrupted run of a layout: its final state, losses and (mean) wall time."""

    def __init__(self, base: Path, layout: str, repeats: int):
        walls = []
        for i in range(repeats):
            run = Run(base, f"uninterrupted_{layout}_{i}", layout)
            try:
                walls.append(run.finish())
            finally:
                run.close()
        self.folder = run.folder
        self.walls = walls
        self.wall = statistics.mean(walls)
        self.state = runs.final_state(self.folder, STEPS)
        self.losses = runs.losses(self.folder)
        print(f"uninterrupted {layout}: {', '.join(f'{w:.1f}' for w in walls)} s", flush=True)


def compare(reference: Reference, folder: Path, after: int = 0) -> dict:
    """Largest differences from the uninterrupted run: final state, and the losses of steps > after."""
    difference = runs.max_difference(reference.state, runs.final_state(folder, STEPS))
    logged = runs.losses(folder)
    assert set(logged) == set(reference.losses), (sorted(logged), runs.tail(folder))
    loss = max(abs(logged[s] - reference.losses[s]) for s in logged if s > after)
    return {"max_param_diff": difference, "bitwise": difference == 0.0, "max_loss_diff": loss}


def killed_run(base: Path, i: int, layout: str, during_save: bool, rng: random.Random, ref) -> dict:
    run = Run(base, f"killed_{i:02d}_{layout}", layout)
    try:
        if during_save:
            save = rng.choice(range(SAVE_EVERY, STEPS, SAVE_EVERY))
            runs.during_a_save(run.folder, run.proc, timeout=TIMEOUT, after=save - 1)
        else:
            runs.at_step(run.folder, run.proc, rng.randint(1, STEPS - 1), timeout=TIMEOUT)
        resumed_from = runs.step_of(runs.newest(run.folder))
        logged = max(runs.losses(run.folder), default=0)
        torn_now = runs.saving(run.folder)
        ranks = runs.ranks(run.proc)
        rank = rng.choice(sorted(ranks))
        os.kill(ranks[rank], signal.SIGKILL)
        wall = run.finish()
    finally:
        run.close()
    log = (run.folder / "log.txt").read_text()
    row = {
        "run": i,
        "layout": layout,
        "killed_rank": rank,
        "aimed_at_save": during_save,
        "steps_logged_at_kill": logged,
        "saving_at_kill": torn_now,
        "during_save": TORN in log,
        "resumed_from": resumed_from,
        "restarts": log.count(" parameters, pp=") - 1,  # rank 0 prints it at each start
        "wall_s": wall,
        "seconds_lost": wall - ref.wall,
    }
    row |= compare(ref, run.folder)
    return row


def kills(base: Path, args: argparse.Namespace, references: dict) -> list[dict]:
    rng = random.Random(args.seed)
    rows = []
    for i in range(args.runs):
        layout = ("pp2tp2", "sdp2tp2")[i % 2]
        row = killed_run(base, i, layout, (i // 2) % 2 == 1, rng, references[layout])
        rows.append(row)
        print(format_kill(row), flush=True)
    return rows


def fewer(base: Path, references: dict) -> list[dict]:
    rows = []
    for name, (original, smaller) in FEWER.items():
        folder_name = f"fewer_{original}_to_{smaller}"
        run = Run(base, folder_name, original, restarts=0)
        try:
            runs.during_a_save(run.folder, run.proc, timeout=TIMEOUT, after=KILL_SAVE_OF - 1)
            resumed_from = runs.step_of(runs.newest(run.folder))
            runs.kill_all(run.proc)  # the whole job lost; it comes back on half the processes
        finally:
            run.close()
        procs, flags = LAYOUTS[smaller]
        start = time.perf_counter()
        proc = runs.torchrun(procs, run.folder, JOB + flags)
        runs.finish(proc, run.folder, timeout=TIMEOUT)
        row = {"resume": name, "from": original, "to": smaller, "resumed_from": resumed_from}
        row["wall_after_resume_s"] = time.perf_counter() - start
        row |= compare(references[original], run.folder, after=resumed_from)
        logged = runs.losses(run.folder)
        row["first_loss_after"] = (logged[resumed_from + 1], references[original].losses[resumed_from + 1])
        rows.append(row)
        print(format_fewer(row), flush=True)
    return rows


def format_kill(r: dict) -> str:
    return (
        f"| {r['run']} | {r['layout']} | {r['killed_rank']} | {r['steps_logged_at_kill']} | "
        f"{'yes' if r['during_save'] else 'no'} | {r['resumed_from']} | {r['restarts']} | "
        f"{r['wall_s']:.1f} | {r['seconds_lost']:.1f} | {r['max_param_diff']:.3g}"
        f"{' (bitwise)' if r['bitwise'] else ''} | {r['max_loss_diff']:.3g} |"
    )


def format_fewer(r: dict) -> str:
    first, ref = r["first_loss_after"]
    return (
        f"| {r['resume']} | {r['from']} -> {r['to']} | {r['resumed_from']} | {first:.8f} vs {ref:.8f} | "
        f"{r['max_loss_diff']:.3g} | {r['max_param_diff']:.3g}{' (bitwise)' if r['bitwise'] else ''} |"
    )


KILL_HEADER = (
    "| run | layout | rank killed | steps logged at the kill | during a save | resumed from step | "
    "restarts | wall s | seconds lost | max param diff | max loss diff |\n|" + "---|" * 11
)
FEWER_HEADER = (
    "| resume | layouts | from step | first loss after the resume vs uninterrupted | max loss diff "
    "after | max param diff |\n|" + "---|" * 6
)


def main() -> None:
    args = parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="smp_fault_tolerance_"))
    print(f"runs in {base}; load average {os.getloadavg()[0]:.1f}", flush=True)
    needed = set()
    if args.part in ("all", "kills"):
        needed |= {"pp2tp2", "sdp2tp2"}
    if args.part in ("all", "fewer"):
        needed |= {original for original, _ in FEWER.values()}
    started = time.perf_counter()
    references = {layout: Reference(base, layout, 1 if layout in ONCE else 2) for layout in sorted(needed)}
    result: dict = {"references": {k: v.walls for k, v in references.items()}}
    if args.part in ("all", "kills"):
        print(KILL_HEADER, flush=True)
        result["kills"] = kills(base, args, references)
    if args.part in ("all", "fewer"):
        print(FEWER_HEADER, flush=True)
        result["fewer"] = fewer(base, references)
    print(f"\n{time.perf_counter() - started:.0f} s in all; load average {os.getloadavg()[0]:.1f}")
    if "kills" in result:
        print(KILL_HEADER)
        for row in result["kills"]:
            print(format_kill(row))
        lost = [r["seconds_lost"] for r in result["kills"]]
        worst = max(r["max_param_diff"] for r in result["kills"])
        bitwise = sum(r["bitwise"] for r in result["kills"])
        saving = sum(r["during_save"] for r in result["kills"])
        print(
            f"{len(lost)} runs finished, {saving} killed during a save; seconds lost median "
            f"{statistics.median(lost):.1f} (min {min(lost):.1f}, max {max(lost):.1f}); largest "
            f"parameter difference {worst:.3g}; bitwise in {bitwise} of {len(lost)}"
        )
    if "fewer" in result:
        print(FEWER_HEADER)
        for row in result["fewer"]:
            print(format_fewer(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
