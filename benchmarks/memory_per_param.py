"""Bytes per parameter a rank holds while training, against the known floor (issue 33).

    python benchmarks/memory_per_param.py [--width 1024] [--blocks 12] [--modes all] [--json FILE]

Each mode is one launch of real processes (tests/python/harness.py `run_ranks`, CPU, smp backend):
a residual MLP of `--blocks` blocks, each x + fc2(relu(fc1(x))) at `--width` (2 x width^2 weights
per block: 25.2 M parameters at the defaults), Adam, a batch of 4 rows per rank (activations are
negligible next to the parameters). Per rank:

  held = peak resident set size over steps 2-3 (the kernel's VmHWM, reset by writing 5 to
         /proc/self/clear_refs after step 1, so the first step's one-time work is not counted)
         - what the process holds besides tensors: its resident set size after the last step
         less the bytes of every tensor storage alive then (found through the garbage
         collector), i.e. the interpreter, torch, smp, the modules the first step imported, the
         process group;
  bytes per parameter = held / the parameters this rank holds (its stage's, its shards).
glibc's malloc is told to map every block of 64 KiB or more on its own (mallopt M_MMAP_THRESHOLD,
which also stops its threshold from growing), so that a freed tensor leaves the resident set at
once: the resident set then follows what is allocated, and its peak the peak of that.

The floor is what the mode must hold per parameter: parameters in their dtype, one fp32 gradient,
Adam's two fp32 moments and, in bf16, the fp32 master, the last two divided by the
reduced-data-parallel degree R when the optimizer state is sharded:
  fp32:                 4 + 4 + 8 = 16          fp32, sharded:        4 + 4 + 8 / R
  bf16:                 2 + 4 + 12 = 18         bf16, sharded:        2 + 4 + 12 / R
With sharded gradients (ZeRO-2, "shard_gradients": true) the fp32 gradient is kept as this rank's
chunk too: fp32 4 + 12 / R, bf16 2 + 16 / R, plus the buckets being averaged (up to 3 of
--bucket-cap-mb: at this model's size, 25 MB buckets cost more than the chunk saves, which is why
smp turns it on by itself only where the saving is over twice that).
Targets (issue 33, R = 2): fp32 data parallel <= 16.5, bf16 with sharded state <= 12.5.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests", "python"), os.path.join(HERE, "..", "python")]

# name: (ranks, config, the floor as a function of R)
MODES = {
    "fp32 dp2": (2, {}, lambda r: 16.0),
    "fp32 dp2 sharded": (2, {"shard_optimizer_state": True}, lambda r: 8 + 8 / r),
    "bf16 dp2": (2, {"bf16": True}, lambda r: 18.0),
    "bf16 dp2 sharded": (2, {"bf16": True, "shard_optimizer_state": True}, lambda r: 6 + 12 / r),
    "fp32 dp2 sharded gradients": (
        2,
        {"shard_optimizer_state": True, "shard_gradients": True},
        lambda r: 4 + 12 / r,
    ),
    "bf16 dp2 sharded gradients": (
        2,
        {"bf16": True, "shard_optimizer_state": True, "shard_gradients": True},
        lambda r: 2 + 16 / r,
    ),
    "fp32 tp2": (2, {"tensor_parallel_degree": 2}, lambda r: 16.0),
    "fp32 pp2": (2, {"pipeline_parallel_degree": 2, "microbatches": 2}, lambda r: 16.0),
    "bf16 pp2 x tp2 x dp2 sharded": (
        8,
        {
            "pipeline_parallel_degree": 2,
            "tensor_parallel_degree": 2,
            "microbatches": 2,
            "bf16": True,
            "shard_optimizer_state": True,
        },
        lambda r: 6 + 12 / r,
    ),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def tensor_bytes() -> int:
    """Bytes of every tensor storage reachable from Python now (each storage once)."""
    import gc

    import torch

    storages = {}
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, torch.nn.Parameter) and not o.is_meta:
            try:
                st = o.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
            except RuntimeError:  # a fake tensor of a capture has no data
                pass
    return sum(storages.values())


def map_large_blocks() -> None:
    import ctypes

    M_MMAP_THRESHOLD = -3
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)


def rank_main(
    rank: int, world: int, config: dict, width: int, blocks: int, steps: int, cap: float = 25, first: int = 2
) -> dict:
    import smp
    import torch
    from torch import nn

    map_large_blocks()
    torch.set_num_threads(1)
    smp.init({"ddp": True, **config})

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    with smp.tensor_parallelism(enabled=config.get("tensor_parallel_degree", 1) > 1):
        model = smp.DistributedModel(MLP(), bucket_cap_mb=cap)
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @smp.step
    def train(x):
        loss = model(x).float().pow(2).mean()
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        optimizer.zero_grad()
        train(torch.randn(4 * max(1, config.get("microbatches", 1)), width, generator=g))
        optimizer.step()
        if step == first - 2:
            reset_peak()
    held = peak_bytes() - (rss_bytes() - tensor_bytes())
    local = sum(p.numel() for p in model.local_parameters())
    return {"rank": rank, "held": held, "params": local, "bytes_per_param": held / local}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--first", type=int, default=2, help="the first measured step (from 1)")
    p.add_argument("--bucket-cap-mb", type=float, default=25, help="DistributedModel(bucket_cap_mb=)")
    p.add_argument("--modes", default="all", help="comma-separated names of MODES, or all")
    p.add_argument("--json")
    args = p.parse_args()
    names = list(MODES) if args.modes == "all" else [m.strip() for m in args.modes.split(",")]
    unknown = [n for n in names if n not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {list(MODES)}")

    import memory_per_param
    from harness import run_ranks

    print("| mode | ranks | parameters per rank | bytes per parameter (max over ranks) | floor | held MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for name in names:
        world, config, floor = MODES[name]
        results = run_ranks(
            memory_per_param.rank_main,
            world,
            config,
            args.width,
            args.blocks,
            args.steps,
            args.bucket_cap_mb,
            args.first,
            timeout=900,
        )
        worst = max(results, key=lambda r: r["bytes_per_param"])
        rdp = world // (config.get("pipeline_parallel_degree", 1) * config.get("tensor_parallel_degree", 1))
        row = {"mode": name, "ranks": world, "floor": floor(rdp), **worst}
        rows.append(row)
        print(
            f"| {name} | {world} | {worst['params'] / 1e6:.2f} M | {worst['bytes_per_param']:.2f} | "
            f"{row['floor']:.1f} | {worst['held'] / 2**20:.0f} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
