"""Context parallelism: the longest sequence that trains within a fixed budget of activation memory.

    torchrun --standalone --nproc_per_node=C benchmarks/context_parallel_longest.py --budget-mib M

(C = 1, 2, 4; with the package installed, or PYTHONPATH=python from the repository root)

The model is context_parallel.py's (HF Llama, unmodified: grouped-query attention, rotary, sdpa),
one sequence per step. At C = 1 it runs in one process, smp without cp; at C > 1 with
context_parallel_degree=C (`--comm`, default p2p). Each candidate length trains one step (forward,
backward, AdamW), with the bytes every rank saves for backward counted (smp's counter for the
captured model, autograd's saved-tensor hooks for a model that runs whole; unique storages,
parameters left out); a length fits when the largest rank's peak is at most the budget. The
search doubles the length from --first while it fits, then bisects in steps of 128 tokens
(cp's load-balanced cut needs a multiple of 2 x C). Parameters, gradients and optimizer state do
not grow with the sequence and are not in the budget.

Reported: the longest length that fits, its saved MiB per rank, and each probe.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import smp
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from context_parallel import build, saved_peak  # noqa: E402  (the same model and meter)


def saved_bytes(step_args, seq: int, comm: str) -> tuple[int, float]:
    """(peak bytes saved for backward on the largest rank, loss) of one training step at `seq`."""
    world = int(os.environ["WORLD_SIZE"])
    smp.init({"context_parallel_degree": world, "cp_comm_type": comm} if world > 1 else {})
    try:
        dmodel = smp.DistributedModel(build(step_args))
        opt = smp.DistributedOptimizer(torch.optim.AdamW(dmodel.parameters(), lr=1e-3))

        @smp.step
        def train_step(ids):
            loss = dmodel(input_ids=ids, labels=ids, use_cache=False).loss
            dmodel.backward(loss)
            return loss

        ids = torch.randint(0, step_args.vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
        saved, loss = saved_peak(dmodel, lambda: train_step(ids).reduce_mean())
        opt.step()
        peak = torch.tensor([saved])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return int(peak.item()), float(loss)
    finally:
        smp.parallel_state.reset()


def longest(args) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    unit = math.lcm(128, 2 * world)  # the same steps at every C (cp cuts multiples of 2C)
    budget = args.budget_mib * 2**20
    probes = []

    def fits(seq: int) -> bool:
        peak, loss = saved_bytes(args, seq, args.comm)
        probes.append({"seq": seq, "saved_mib": peak / 2**20, "loss": loss, "fits": peak <= budget})
        if dist.get_rank() == 0:
            print(f"  S={seq:>6}: {peak / 2**20:8.2f} MiB saved per rank, loss {loss:.4f}", flush=True)
        return peak <= budget

    seq = max(unit, args.first // unit * unit)
    if not fits(seq):
        raise SystemExit(f"--first {seq} already needs more than --budget-mib {args.budget_mib}")
    good = seq
    while fits(2 * good):
        good *= 2
    bad = 2 * good
    while bad - good > unit:
        mid = (good + bad) // 2 // unit * unit
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    best = next(p for p in probes if p["seq"] == good)
    return {
        "cp": world,
        "comm": args.comm,
        "budget_mib": args.budget_mib,
        "longest": good,
        **best,
        "probes": probes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget-mib", type=float, required=True)
    parser.add_argument("--comm", default="p2p", choices=("p2p", "all_gather", "a2a"))
    parser.add_argument("--first", type=int, default=512)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--json", help="rank 0 also writes the result to this file")
    args = parser.parse_args()
    args.seq = 1 << 17  # the model's positions (rotary: no table grows with it)
    torch.set_num_threads(1)  # the processes share the machine's cores
    result = longest(args)
    if dist.get_rank() == 0:
        print(
            f"cp={result['cp']} ({result['comm']}): longest sequence within {args.budget_mib} MiB saved "
            f"per rank: {result['longest']} tokens ({result['saved_mib']:.2f} MiB)"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
