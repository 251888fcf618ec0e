"""all_reduce through "smp" against the plain backend it wraps, measured in the same run.

    python benchmarks/backend.py                 # 2 CPU processes: smp vs gloo
    python benchmarks/backend.py --cuda          # 1 GPU process: smp vs nccl

All groups live in the same processes: the default group is smp, and two more
groups over the same ranks use the plain backend ("plain" and "plain-again").
They are measured interleaved, one operation at a time: each sample runs one
synchronous all_reduce on every group, in rotating order, and times each, so
slow drifts of the machine hit all groups alike. The figure per group is the
median over samples. plain-again/plain is an A/A comparison: the noise floor of
the method, printed beside smp/plain. Bus bandwidth = bytes * 2(n-1)/n / time (nccl-tests'
definition; at world size 1 it is reported as algorithm bandwidth, bytes/time).
Prints per size: latency of each, the ratio smp/plain, and the time smp adds per
call. Targets: ratio <= 1.05 from 1 MiB up, < 10 us added at small sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KIB = 1024
DEFAULT_SIZES = [4 * KIB * 4**i for i in range(8)]  # 4 KiB .. 64 MiB


def iters_for(nbytes: int, budget_bytes: int) -> int:
    return max(9, min(1000, budget_bytes // nbytes))


def time_one(tensor, group, sync) -> float:
    start = time.perf_counter()
    dist.all_reduce(tensor, group=group)
    sync()
    return time.perf_counter() - start


def measure(rank, world_size, init_file, args, results):
    import smp  # noqa: F401  (registers the backend)

    cuda = args.cuda
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("smp", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    plain_name = "nccl" if cuda else "gloo"
    plain = dist.new_group(list(range(world_size)), backend=plain_name)
    plain_again = dist.new_group(list(range(world_size)), backend=plain_name)
    groups = {"smp": dist.group.WORLD, "plain": plain, "plain-again": plain_again}
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    rows = []
    for nbytes in args.sizes:
        tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        iters = iters_for(nbytes, args.budget_mib * 1024 * 1024)
        for group in groups.values():  # warm up connections and caches
            for _ in range(3):
                time_one(tensor, group, sync)
        samples = {name: [] for name in groups}
        names = list(groups)
        dist.barrier()
        for i in range(iters):
            for name in names[i % 3 :] + names[: i % 3]:  # rotate who goes first
                samples[name].append(time_one(tensor, groups[name], sync))
        # Every rank took part; rank 0's clock is the one reported.
        t = {name: statistics.median(v) for name, v in samples.items()}
        factor = 2 * (world_size - 1) / world_size if world_size > 1 else 1.0
        rows.append(
            {
                "bytes": nbytes,
                "iters": iters,
                "smp_us": t["smp"] * 1e6,
                "plain_us": t["plain"] * 1e6,
                "smp_busbw_gbps": nbytes * factor / t["smp"] / 1e9,
                "plain_busbw_gbps": nbytes * factor / t["plain"] / 1e9,
                "ratio": t["smp"] / t["plain"],
                "aa_ratio": t["plain-again"] / t["plain"],
                "added_us": (t["smp"] - t["plain"]) * 1e6,
            }
        )
    dist.destroy_process_group()
    if rank == 0:
        results.put(rows)


def human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def report(rows, plain_name: str, world_size: int, device: str) -> None:
    print(f"all_reduce float32, {world_size} process(es), {device}: smp vs {plain_name} (median of samples)")
    header = (
        f"{'size':>8} {'iters':>5} {'smp us':>10} {plain_name + ' us':>10} "
        f"{'smp GB/s':>9} {plain_name + ' GB/s':>10} {'smp/' + plain_name:>9} {'A/A':>6} {'added us':>9}"
    )
    print(header)
    for r in rows:
        print(
            f"{human(r['bytes']):>8} {r['iters']:>5} {r['smp_us']:>10.1f} {r['plain_us']:>10.1f} "
            f"{r['smp_busbw_gbps']:>9.3f} {r['plain_busbw_gbps']:>10.3f} "
            f"{r['ratio']:>9.3f} {r['aa_ratio']:>6.3f} {r['added_us']:>9.1f}"
        )
    big = [r["ratio"] for r in rows if r["bytes"] >= 1 << 20]
    small = [r["added_us"] for r in rows if r["bytes"] <= 64 * KIB]
    if big:
        aa = [abs(r["aa_ratio"] - 1) for r in rows if r["bytes"] >= 1 << 20]
        print(
            f"worst ratio from 1 MiB up: {max(big):.3f} (target <= 1.05); "
            f"A/A noise floor there: +/-{max(aa):.3f}"
        )
    if small:
        print(f"worst added time up to 64 KiB: {max(small):.1f} us (target < 10 us)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cuda", action="store_true", help="one GPU process: smp vs nccl")
    parser.add_argument("--world-size", type=int, default=None, help="default: 2 on CPU, 1 on GPU")
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="message sizes in bytes")
    parser.add_argument("--budget-mib", type=int, default=512, help="bytes per group per size, in MiB")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.cuda and not torch.cuda.is_available():
        sys.exit("--cuda needs a visible GPU")
    world_size = args.world_size or (1 if args.cuda else 2)
    if args.cuda and world_size != 1:
        sys.exit("NCCL refuses two ranks on one GPU: use --world-size 1 with --cuda")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=measure, args=(r, world_size, os.path.join(tmp, "store"), args, results))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        rows = results.get(timeout=3600)
        for p in procs:
            p.join(timeout=60)
    plain_name = "nccl" if args.cuda else "gloo"
    report(rows, plain_name, world_size, "cuda" if args.cuda else "cpu")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plain": plain_name, "world_size": world_size, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
