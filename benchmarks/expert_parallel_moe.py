"""Expert parallelism on a mixture-of-experts model: smp's ep against its other layouts, same run.

    torchrun --standalone --nproc_per_node=2 benchmarks/expert_parallel_moe.py [--steps 10] [--json FILE]

(with the package installed, or PYTHONPATH=python from the repository root)

The model is Hugging Face's Mixtral as transformers builds it (3-D expert banks, top-2 routing),
from a small config where the experts hold most of the parameters. Two processes; each layout
trains its own copy (same seed, same weights, same global batches), one after the other (each needs
its own smp.init), in rounds:

  ep2   expert_parallel_degree=2: each rank holds half of every layer's experts whole, tokens
        all-to-all'ed to them and back; the rest replicated, each rank on half the batch.
  dp    plain data parallelism: the whole model on each rank (experts replicated), half the batch.
  tp2   tensor_parallel_degree=2 (today's path for experts): every expert cut in two, attention too;
        both ranks read the whole batch (prescaled).

The layouts run in turn, --rounds times over. Reported per layout: the median step time (the
slower rank's), the median over rounds of its ratio to ep2 in the same round, the expert and
total parameter bytes one rank holds, and the losses' largest relative gap to dp's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import smp
import torch
import torch.distributed as dist
from tensor_parallel_moe import LR, batch, build  # the same Mixtral, batches and lr as tp's

LAYOUTS = {
    "ep2": {"expert_parallel_degree": 2},
    "dp": {},
    "tp2": {"tensor_parallel_degree": 2, "prescaled_batch": True},
}


def run_layout(name: str, args) -> dict:
    config = LAYOUTS[name]
    smp.init(config)
    tp = "tensor_parallel_degree" in config
    with smp.tensor_parallelism(tp):
        model = build(args)
    dmodel = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.Adam(dmodel.parameters(), lr=LR))

    @smp.step
    def train_step(ids):
        loss = dmodel(input_ids=ids, labels=ids, use_cache=False).loss
        dmodel.backward(loss)
        return loss

    per = args.batch if tp else args.batch // smp.dp_size()
    shard = 0 if tp else smp.dp_rank()

    def step(s: int) -> float:
        ids = batch(s, args)[shard * per : (shard + 1) * per]
        opt.zero_grad()
        loss = train_step(ids).reduce_mean()
        opt.step()
        if not tp:  # the global batch's loss
            dist.all_reduce(loss, group=smp.get_dp_process_group())
            loss /= smp.dp_size()
        return loss.item()

    step(-1)  # warm-up: smp places (and for tp captures and shards) on its first step
    times, losses = [], []
    for s in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        losses.append(step(s))
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(took.item())
    named = dict(dmodel.local_named_parameters())
    expert_bytes = sum(p.numel() * p.element_size() for n, p in named.items() if ".experts." in n)
    total_bytes = sum(p.numel() * p.element_size() for p in named.values())
    smp.parallel_state.reset()
    return {
        "median_s": statistics.median(times),
        "losses": losses,
        "expert_bytes": expert_bytes,
        "bytes": total_bytes,
    }


def report(r: dict) -> None:
    print(f"Mixtral {r['config']}")
    print(
        f"{'layout':<6} {'median step':>12} {'vs ep2':>7} {'expert MiB/rank':>16} "
        f"{'all MiB/rank':>13} {'loss gap':>9}"
    )
    for name, x in r["layouts"].items():
        print(
            f"{name:<6} {x['median_s'] * 1e3:>10.1f}ms {x['vs_ep2']:>6.2f}x "
            f"{x['expert_bytes'] / 2**20:>16.2f} {x['bytes'] / 2**20:>13.2f} {x['loss_gap']:>9.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--json", help="rank 0 also writes the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two processes share the machine's cores
    # The layouts run in turn, --rounds times over: each ratio is taken within a round (neighbours
    # in time share the machine's drifts), and its median over the rounds reported.
    rounds = [{name: run_layout(name, args) for name in LAYOUTS} for _ in range(args.rounds)]
    layouts = {}
    for name in LAYOUTS:
        runs = [r[name] for r in rounds]
        layouts[name] = {
            **runs[0],
            "median_s": statistics.median(x["median_s"] for x in runs),
            "rounds_s": [x["median_s"] for x in runs],
            "vs_ep2": statistics.median(
                x["median_s"] / r["ep2"]["median_s"] for x, r in zip(runs, rounds, strict=True)
            ),
            "loss_gap": max(
                abs(a - b) / abs(b) for a, b in zip(runs[0]["losses"], rounds[0]["dp"]["losses"], strict=True)
            ),
        }
    result = {"config": vars(args), "layouts": layouts}
    if dist.get_rank() == 0:
        report(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
