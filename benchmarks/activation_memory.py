"""Activation checkpointing: memory saved and time paid, GPT at pp=2 on CPU.

    python benchmarks/activation_memory.py [--steps 10] [--json FILE]

For each strategy (none, each, group_2, contiguous) a fresh `torchrun --nproc_per_node=2` job
trains the same GPT (tests/python/models.py; 8 blocks, dim 256, sequence 256, batch 16 in 4
microbatches, "interleaved" 1F1B) with every block of `blocks` checkpointed by
smp.set_activation_checkpointing. A fresh job per strategy keeps peak RSS honest (it only grows).

Per strategy and stage it reports:
  saved   peak bytes autograd holds for backward on the stage (smp's saved-tensor meter: tensors
          saved by ops, plus the inputs checkpointed regions keep), over the measured steps;
  rss     peak resident memory growth of the stage's process during training (ru_maxrss at the
          end minus the RSS before the first step);
  step    median step time (max over the two stages) after 2 warm-up steps.
Ratios are against "none" in the same run. The ideal recompute cost is one extra forward of the
checkpointed blocks: about 1.33x the step time of none when backward costs twice a forward.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

STRATEGIES = ("none", "each", "group_2", "contiguous")
HERE = os.path.dirname(os.path.abspath(__file__))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(strategy: str, steps: int, out: str) -> None:
    import smp
    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
    from models import GPT, lm_loss

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(vocab=512, dim=256, heads=8, layers=8, seq=256))
    if strategy != "none":
        smp.set_activation_checkpointing(model.get_module().blocks, strategy=strategy)
    model.track_saved_activations()
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(ids):
        loss = lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 512, (16, 256), generator=g) for _ in range(steps + 2)]
    rss_before = _rss_bytes()
    times, losses = [], []
    for i, ids in enumerate(batches):
        torch.distributed.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        loss = train_step(ids).reduce_mean()
        opt.step()
        elapsed = torch.tensor(time.perf_counter() - start)
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        if i >= 2:
            times.append(elapsed.item())
            losses.append(loss.item())
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        "stage": smp.pp_rank(),
        "saved": model.saved_activation_bytes()["peak"],
        "rss": rss_peak - rss_before,
        "step": statistics.median(times),
        "loss": losses[-1] if smp.pp_rank() == 1 else None,
    }
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, result)
    if smp.rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=STRATEGIES)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in STRATEGIES:
            out = os.path.join(tmp, f"{strategy}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            cmd += [__file__, "--worker", strategy, "--steps", str(args.steps), "--out", out]
            subprocess.run(cmd, check=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
            with open(out) as f:
                results[strategy] = json.load(f)
    base = results["none"]
    head = ("saved MiB", "x none", "rss MiB", "x none", "step s", "x none")
    print(f"{'strategy':<11} {'stage':>5} " + " ".join(f"{h:>9}" for h in head))
    for strategy, stages in results.items():
        for r, b in zip(stages, base, strict=True):
            cells = (r["saved"] / 2**20, r["saved"] / b["saved"], r["rss"] / 2**20, r["rss"] / b["rss"])
            cells += (r["step"], r["step"] / b["step"])
            print(f"{strategy:<11} {r['stage']:>5} " + " ".join(f"{c:>9.3f}" for c in cells))
    losses = {s: next(r["loss"] for r in stages if r["loss"] is not None) for s, stages in results.items()}
    print("final losses (all strategies train the same model):", losses)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
