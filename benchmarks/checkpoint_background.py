"""The background-save part of benchmarks/checkpoint.py (issue 49, item 4): how long training stalls
for a save with `async_save=True` against a synchronous save of the same state, where the stall
comes from, and the host memory the background save holds while it writes.

Each round: steps without a save (their median is the plain step time), one synchronous partial
save (its time is the training's stall for it), then one background save per writer (smp's
default, a thread of the training process, `async_save=True`; a writer process of its own,
`async_save="process"`): the pause until the call returns (the buffers copied to host memory; the
parameters and optimizer state are copied by the save's thread during the next steps), training
steps while it writes (each one's excess over the plain step time is stall too), and the wait once
every rank's writer is done. stall = pause + the steps' excess + the wait; the goal is at most 10%
of the synchronous save's. The last line is the two writers' ratio, measured in the same run.

Where a step's time goes, from the training thread's /proc schedstat (kernel accounting, so it
holds on a busy machine): on a processor (cpu), runnable but waiting for one (queued: the
machine's other work, the writer thread among it), and neither (blocked: waiting for peers in a
collective, or for the GIL while the writer thread holds it). The writer's own processor time is
`PendingSave.cpu_seconds` (its thread's and its process's).

Memory: `PendingSave.staged_bytes` (the copy of this rank's state), and the process's resident set
(VmRSS) sampled after the call and after each step while writing, less its value before the call;
the writer process's own memory (its private pages: not the libraries it shares, nor the staging).
Each figure is the largest over ranks.
"""

from __future__ import annotations

import statistics
import time

import smp
import torch
import torch.distributed as dist

PLAIN_STEPS = 3
PARTS = ("cpu", "queued", "blocked")


def rss() -> int:
    """This process's resident set, bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def private_bytes(pid: int | None) -> int:
    """The memory process `pid` holds of its own (private pages: not the libraries it shares with
    the training process, nor the shared staging it maps), bytes; 0 for None."""
    if pid is None:
        return 0
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except FileNotFoundError:
        return 0
    return total


def launches(n: int):
    """A step of `n` tiny tensor ops: each an interpreter round trip and a few microseconds of
    work, as a GPU host's training thread launching kernels (the device's work is elsewhere)."""
    x = torch.zeros(64)

    def step() -> None:
        for _ in range(n):
            x.add_(1.0)

    return step


def _schedstat() -> tuple[float, float]:
    """This thread's time on a processor and waiting for one, seconds."""
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, queued, _ = f.read().split()
    return int(on_cpu) / 1e9, int(queued) / 1e9


def _largest(value: float) -> float:
    t = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _everyone_done(pending) -> bool:
    finished = torch.tensor(int(pending.done()))
    dist.all_reduce(finished, op=dist.ReduceOp.MIN)  # every rank steps until all are done
    return bool(finished.item())


class Accounted:
    """fn's time on the slowest rank (`timed`), and this thread's cpu / queued / blocked split of it."""

    def __init__(self, timed):
        self.timed = timed

    def __call__(self, fn) -> dict:
        parts = {}

        def run() -> None:
            cpu, queued, wall = *_schedstat(), time.perf_counter()
            fn()
            cpu2, queued2 = _schedstat()
            parts["cpu"], parts["queued"] = cpu2 - cpu, queued2 - queued
            parts["blocked"] = time.perf_counter() - wall - parts["cpu"] - parts["queued"]

        wall = self.timed(run)
        return {"wall": wall} | {k: _largest(v) for k, v in parts.items()}


def _sum(rows: list[dict]) -> dict:
    return {k: sum(r[k] for r in rows) for k in rows[0]}


# (name, save_checkpoint's async_save): the thread writer (the default) and the process writer
WRITERS = (("thread", True), ("process", "process"))


def measure(repeats: int, folder: str, model, opt, step, timed) -> dict[str, list[dict]]:
    """`repeats` rounds per writer, the writers one after the other (alternating them would drop
    the kept staging buffers at every round: a thread's are private memory, a process's shared);
    `step` trains one step, `timed(fn)` is fn's time on the slowest rank. Each round: plain
    steps, a synchronous save, then a background save."""
    accounted = Accounted(timed)
    by_writer: dict[str, list[dict]] = {}
    for name, how in WRITERS:
        rounds = by_writer.setdefault(name, [])
        for _ in range(repeats):
            plain_rows = [accounted(step) for _ in range(PLAIN_STEPS)]
            plain = {k: statistics.median(r[k] for r in plain_rows) for k in plain_rows[0]}
            cpu = time.thread_time()
            sync = accounted(lambda: smp.save_checkpoint(folder, "sync", model=model, optimizer=opt))
            sync_cpu = _largest(time.thread_time() - cpu)
            row = {"plain_step": plain, "sync_save": sync, "sync_save_cpu_s": sync_cpu}
            rounds.append(row | _background(how, folder, model, opt, step, timed, accounted, plain, sync))
        smp.checkpoint.release_staging()  # the next writer starts from fresh buffers, as this one did
    return by_writer


def _background(how, folder, model, opt, step, timed, accounted, plain, sync) -> dict:
    before = rss()
    started = []

    def start(started=started) -> None:
        saving = smp.save_checkpoint(folder, "background", model=model, optimizer=opt, async_save=how)
        started.append(saving)

    pause = accounted(start)
    pending = started.pop()
    peak, writer_peak = rss(), private_bytes(pending.writer_pid)
    during = []
    while True:
        during.append(accounted(step))
        peak, writer_peak = max(peak, rss()), max(writer_peak, private_bytes(pending.writer_pid))
        if _everyone_done(pending):
            break
    wait = timed(pending.wait)
    excess = {k: v - len(during) * plain[k] for k, v in _sum(during).items()}
    stall = pause["wall"] + excess["wall"] + wait
    return {
        "pause": pause,
        "steps_during": [d["wall"] for d in during],
        "excess": excess,
        "wait_s": wait,
        "stall_s": stall,
        "stall_vs_sync": stall / sync["wall"],
        "writer_cpu_s": _largest(pending.cpu_seconds),
        "staged_bytes": _largest(pending.staged_bytes),
        "rss_growth_bytes": _largest(peak - before),
        "writer_private_bytes": _largest(writer_peak),
    }


def _split(d: dict) -> str:
    return " / ".join(f"{d[k]:.3f}" for k in PARTS)


def report(by_writer: dict[str, list[dict]]) -> None:
    for name, how in WRITERS:
        print(f"background save (async_save={how!r}: a {name} writes) against a synchronous save:")
        print(
            f"{'round':>5} {'sync s':>7} {'pause s':>7} {'plain step':>10} {'steps while writing':>20} "
            f"{'excess s':>8} {'wait s':>6} {'stall s':>7} {'stall/sync':>10} {'staged MB':>9} "
            f"{'RSS+ MB':>7} {'writer own MB':>13}"
        )
        for i, r in enumerate(by_writer[name]):
            during = ", ".join(f"{d:.3f}" for d in r["steps_during"])
            print(
                f"{i:>5} {r['sync_save']['wall']:7.3f} {r['pause']['wall']:7.3f} "
                f"{r['plain_step']['wall']:10.3f} {during:>20} {r['excess']['wall']:8.3f} "
                f"{r['wait_s']:6.3f} {r['stall_s']:7.3f} {r['stall_vs_sync']:10.3f} "
                f"{r['staged_bytes'] / 1e6:9.1f} {r['rss_growth_bytes'] / 1e6:7.1f} "
                f"{r['writer_private_bytes'] / 1e6:13.1f}"
            )
        print("where the time went (training thread, s: cpu / queued for a processor / blocked):")
        for i, r in enumerate(by_writer[name]):
            print(
                f"{i:>5} sync save {_split(r['sync_save'])} (cpu {r['sync_save_cpu_s']:.3f}); "
                f"pause {_split(r['pause'])}; steps' excess {_split(r['excess'])}; "
                f"writer cpu {r['writer_cpu_s']:.3f}"
            )
    later = {}
    for name, _ in WRITERS:
        ratios = [r["stall_vs_sync"] for r in by_writer[name]]
        later[name] = statistics.median(ratios[1:] or ratios)  # the first also allocates the buffers
        print(
            f"{name} writer: stall / synchronous save: median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f}; rounds after the first {later[name]:.3f}; "
            "goal <= 0.10)"
        )
    print(
        "process writer's stall / thread writer's (medians of the rounds after the first): "
        f"{later['process'] / later['thread']:.3f}"
    )
