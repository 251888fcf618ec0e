"""Soak: do long runs grow? RSS, threads and open file descriptors over thousands of steps.

    python benchmarks/soak.py [--steps 5000] [--every 100] [--warmup 500] [--json FILE]

Four CPU processes (started here, no torchrun), pipeline_parallel_degree=2 x rdp 2 with
sharded optimizer state, train the GPT test model (tests/python/models.py, 2 microbatches).
Every `--every` steps each rank samples, from /proc/self, its resident set size (VmRSS), its
thread count (Threads: the OS's, so Gloo's and smp's threads count) and its open file
descriptors. Growth is reported per rank from the first sample at or after `--warmup` steps (the
allocator's arenas and the microbatch thread pool fill during warm-up) to the last sample, plus
the least-squares slope over that stretch, so a steady leak shows even under allocator noise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 4


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def sample() -> dict:
    return {
        "rss_mib": _proc_status("VmRSS") / 1024,
        "threads": _proc_status("Threads"),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def _rank(rank: int, port: int, steps: int, every: int, results) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import smp
    import torch
    from models import GPT, lm_loss

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "shard_optimizer_state": True})
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(layers=2))
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(ids):
        loss = lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    gen = torch.Generator().manual_seed(100 + smp.rdp_rank())
    samples = []
    start = time.monotonic()
    for i in range(steps + 1):
        if i % every == 0:
            samples.append({"step": i, "seconds": time.monotonic() - start, **sample()})
        if i == steps:
            break
        ids = torch.randint(0, 64, (4, 16), generator=gen)
        optimizer.zero_grad()
        train_step(ids)
        optimizer.step()
    results.put((rank, samples))
    smp.barrier()


def _growth(samples: list[dict], warmup: int, key: str) -> tuple[float, float]:
    """(last - first after warm-up, least-squares slope per 1000 steps over that stretch)."""
    tail = [s for s in samples if s["step"] >= warmup]
    xs, ys = [s["step"] for s in tail], [s[key] for s in tail]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return ys[-1] - ys[0], slope * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--json", help="write every sample here")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args.steps, args.every, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    by_rank = dict(results.get() for _ in range(WORLD))
    for p in procs:
        p.join()
    seconds = max(s[-1]["seconds"] for s in by_rank.values())
    print(f"{args.steps} steps in {seconds:.0f} s ({1000 * seconds / args.steps:.1f} ms/step)")
    print(f"growth from step {args.warmup} to {args.steps} (last - first; slope per 1000 steps):")
    print("rank | RSS MiB at warm-up | RSS growth MiB | RSS slope | threads | fds")
    for rank in range(WORLD):
        samples = by_rank[rank]
        first = next(s for s in samples if s["step"] >= args.warmup)
        rss, rss_slope = _growth(samples, args.warmup, "rss_mib")
        threads, _ = _growth(samples, args.warmup, "threads")
        fds, _ = _growth(samples, args.warmup, "fds")
        print(
            f"{rank} | {first['rss_mib']:.1f} | {rss:+.2f} | {rss_slope:+.3f} | "
            f"{first['threads']} -> {first['threads'] + threads:.0f} | "
            f"{first['fds']} -> {first['fds'] + fds:.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(by_rank, f)


if __name__ == "__main__":
    main()
