"""What the pipeline timeline costs: step time with it off and on, in the same job.

    torchrun --standalone --nproc_per_node=2 benchmarks/timeline_overhead.py [--rounds 8] [--steps 40]

Two processes, one pipeline of two stages, 4 microbatches ("interleaved", 1F1B), the small GPT
of the tests (tests/python/models.py). Each round trains a fresh model once with the timeline
off (no "timeline" key) and once on (recording every step, writing nothing while timed), in
an order that alternates between rounds; each run first takes --warmup steps (partitioning,
first touches), then times --steps steps. A step is zero_grad + @smp.step + optimizer.step,
started after a barrier; its wall time is the slowest rank's, its CPU time the sum of both
ranks' process CPU time (every thread: microbatch threads, Gloo's), which other load on the
machine barely moves. Reported per mode: the median step over all rounds, and the median over
rounds of the per-round ratio on/off (neighbours in time share the machine's drifts). The time
rank 0 takes to write the files (gather, JSON, PNG) for the recorded steps is reported apart:
it is paid once per write, not per step.

--modes off alone, run once with this tree's python/ and once with an older tree's on
PYTHONPATH, compares the timeline's off path with code that has no timeline at all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import smp
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from models import GPT, lm_loss  # noqa: E402


def run(mode: str, args, out: str) -> tuple[list[float], list[float], float | None]:
    """Step times and CPU times (s) of one fresh model under `mode`, and the write's time when on."""
    config = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "interleaved"}
    if mode == "on":
        config["timeline"] = {"path": out}
    smp.init(config)
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(layers=args.layers, dim=args.dim))
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(ids):
        loss = lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    times, cpu = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, 64, (args.batch, 16), generator=g)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        train_step(ids)
        optimizer.step()
        elapsed = torch.tensor(time.perf_counter() - t0)
        used = torch.tensor(time.process_time() - c0)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.all_reduce(used)  # CPU time of both ranks: what the timeline adds, whatever else runs
        if step >= args.warmup:
            times.append(elapsed.item())
            cpu.append(used.item())
    write_s = None
    if mode == "on":
        dist.barrier()
        t0 = time.perf_counter()
        smp.write_timeline()
        write_s = time.perf_counter() - t0
    smp.parallel_state.reset(keep_groups=True)
    return times, cpu, write_s


class _DoneWork:
    def is_completed(self) -> bool:
        return True


def event_costs(n: int = 200_000) -> dict[str, float]:
    """ns per call, in one process: the recorder's work per event, which the machine's other
    load moves far less than a whole step's time."""
    from smp.config_options import TimelineOptions
    from smp.services import timeline

    recorder = timeline.Recorder(TimelineOptions(), {"rank": 0, "stage": 0, "tp": 0, "rdp": 0}, 0)
    recorder.begin_step()
    off = None
    t0 = time.perf_counter_ns()
    for _ in range(n):
        if off is not None:  # what every event costs with the timeline off
            off.record("F", 0, 0)
    t_off = time.perf_counter_ns() - t0
    t0 = time.perf_counter_ns()
    for k in range(n):
        began = timeline.now()
        recorder.record("F", began, timeline.now(), microbatch=k, stage=0)
    t_action = time.perf_counter_ns() - t0
    recorder.take()
    pending, work = timeline.Pending(recorder), _DoneWork()
    t0 = time.perf_counter_ns()
    for k in range(n):
        pending.add(work, "send", timeline.now(), microbatch=k, stage=0, peer_stage=1, bytes=4096)
        pending.poll()
    t_message = time.perf_counter_ns() - t0
    return {"off_check": t_off / n, "action": t_action / n, "message": t_message / n}


def _median(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def _summary(runs: list[list[float]]) -> dict:
    """ms: the median step over all runs, and each run's median."""
    return {"median": _median([t for run in runs for t in run]), "runs": [_median(run) for run in runs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--modes", default="off,on", help="comma-separated: off, on")
    p.add_argument("--json", default=None, help="also write the results here (rank 0)")
    p.add_argument("--events-only", action="store_true", help="only the per-event costs (one process)")
    args = p.parse_args()
    if args.events_only:
        costs = event_costs()
        print(", ".join(f"{k} {v:.0f} ns" for k, v in costs.items()))
        return
    dist.init_process_group("smp")
    modes = args.modes.split(",")
    walls: dict[str, list[list[float]]] = {m: [] for m in modes}
    cpus: dict[str, list[list[float]]] = {m: [] for m in modes}
    writes = []
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                times, cpu, write_s = run(mode, args, out)
                walls[mode].append(times)
                cpus[mode].append(cpu)
                if write_s is not None:
                    writes.append(write_s)
    if dist.get_rank() == 0:
        result = {}
        for m in modes:
            result[m] = {"wall_ms": _summary(walls[m]), "cpu_ms": _summary(cpus[m])}
            w, c = result[m]["wall_ms"]["median"], result[m]["cpu_ms"]["median"]
            print(f"{m:>3}: median step {w:.2f} ms wall, {c:.2f} ms CPU (both ranks)")
        if "off" in modes and "on" in modes:
            for what, runs in (("wall", walls), ("cpu", cpus)):
                ratios = [_median(a) / _median(b) for a, b in zip(runs["on"], runs["off"], strict=True)]
                result[f"{what}_ratio_on_off"] = statistics.median(ratios)
                print(f"on/off {what}: {result[f'{what}_ratio_on_off']:.3f} (median of {len(ratios)} rounds)")
            result["write_s"] = statistics.median(writes)
            print(f"write ({args.steps + args.warmup} steps recorded): {result['write_s']:.2f} s on rank 0")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
