"""Context parallelism: smp's cp=C (each comm type) against data parallelism on the same C ranks.

    torchrun --standalone --nproc_per_node=C benchmarks/context_parallel.py [--seq 1024] [--json FILE]

(with the package installed, or PYTHONPATH=python from the repository root)

The model is Hugging Face's Llama as transformers builds it (grouped-query attention, rotary
positions, sdpa), unmodified, from a small config. C processes (C = 2 or 4); each layout trains its own copy
(same seed, same weights, same global batches of `--batch` sequences), one after the other (each
needs its own smp.init). Every layout gives each rank the same number of tokens per step:

  cpC-p2p, cpC-all_gather, cpC-a2a   context_parallel_degree=C: every rank reads the whole batch,
        each runs 1/C of every sequence (chunks r and 2C-1-r of 2C); attention across the ranks by
        cp_comm_type (ring; gathered keys and values; Ulysses all-to-all).
  dpC   plain data parallelism: each rank the whole sequences of 1/C of the batch.

The layouts run in turn, --rounds times over (neighbours in time share the machine's drifts).
Reported per layout: the median step time (the slower rank's), the median over rounds of its
ratio to dpC's in the same round, the peak bytes one rank saves for backward (and that as a share
of one process's on the whole batch: C x dpC's per rank, activations being linear in the batch),
and the losses' largest relative gap to dpC's (each layout's loss is the global batch's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import smp
import torch
import torch.distributed as dist

COMMS = ("p2p", "all_gather", "a2a")


def layouts(world: int) -> dict[str, dict]:
    cp = {f"cp{world}-{c}": {"context_parallel_degree": world, "cp_comm_type": c} for c in COMMS}
    return cp | {f"dp{world}": {}}


LR = 1e-3


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=2 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.seq,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model


def batch(step: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


def run_layout(name: str, args) -> dict:
    config = layouts(int(os.environ["WORLD_SIZE"]))[name]
    smp.init(config)
    dmodel = smp.DistributedModel(build(args))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(dmodel.parameters(), lr=LR))

    @smp.step
    def train_step(ids):
        loss = dmodel(input_ids=ids, labels=ids, use_cache=False).loss
        dmodel.backward(loss)
        return loss

    cp = smp.cp_size() > 1
    per = args.batch // smp.dp_size()  # (cp ranks share one data-parallel index: the whole batch)

    def step(s: int) -> float:
        ids = batch(s, args)[smp.dp_rank() * per : (smp.dp_rank() + 1) * per]
        opt.zero_grad()
        loss = train_step(ids).reduce_mean()
        opt.step()
        if not cp:  # the global batch's loss (under cp each rank has it already)
            dist.all_reduce(loss, group=smp.get_dp_process_group())
            loss /= smp.dp_size()
        return loss.item()

    step(-1)  # warm-up: smp captures and cuts on its first step
    times, losses = [], []
    for s in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        losses.append(step(s))
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(took.item())
    # Bytes saved for backward, in one more step (counting costs host time).
    saved, _ = saved_peak(dmodel, lambda: step(args.steps))
    smp.parallel_state.reset()
    return {"median_s": statistics.median(times), "losses": losses, "saved_peak": saved}


def saved_peak(dmodel, run):
    """(the peak bytes this rank saves for backward while `run()` trains, its result): smp's
    counter for a captured model (cp), autograd's hooks for one that runs whole on the caller's
    thread (dp), parameters left out (autograd saves them too; smp's counter does not)."""
    dmodel.track_saved_activations()
    packed = {}

    def pack(t: torch.Tensor):
        packed[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    params = sum(p.untyped_storage().nbytes() for p in dmodel.parameters())
    return max(dmodel.saved_activation_bytes()["peak"], sum(packed.values()) - params), result


def report(r: dict) -> None:
    dp = r["dp"]
    print(f"Llama {r['config']}")
    print(
        f"{'layout':<15} {'median step':>12} {'vs ' + dp:>7} {'saved MiB/rank':>15} "
        f"{'of one process':>15} {'loss gap':>9}"
    )
    for name, x in r["layouts"].items():
        print(
            f"{name:<15} {x['median_s'] * 1e3:>10.1f}ms {x['vs_dp']:>6.2f}x "
            f"{x['saved_peak'] / 2**20:>15.2f} {x['of_one_process']:>14.3f}x {x['loss_gap']:>9.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=0, help="sequences per step (default: C)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--json", help="rank 0 also writes the results to this file")
    args = parser.parse_args()
    args.batch = args.batch or int(os.environ.get("WORLD_SIZE", "2"))
    torch.set_num_threads(1)  # two processes share the machine's cores
    names = layouts(int(os.environ["WORLD_SIZE"]))
    dp = next(n for n in names if n.startswith("dp"))
    rounds = [{name: run_layout(name, args) for name in names} for _ in range(args.rounds)]
    per_rank_one = int(os.environ["WORLD_SIZE"]) * rounds[0][dp]["saved_peak"]  # one process, whole batch
    out = {}
    for name in names:
        runs = [r[name] for r in rounds]
        ratios = [x["median_s"] / r[dp]["median_s"] for x, r in zip(runs, rounds, strict=True)]
        out[name] = {
            "median_s": statistics.median(x["median_s"] for x in runs),
            "vs_dp": statistics.median(ratios),
            "rounds_vs_dp": ratios,
            "saved_peak": runs[0]["saved_peak"],
            "of_one_process": runs[0]["saved_peak"] / per_rank_one,
            "losses": runs[0]["losses"],
            "loss_gap": max(
                abs(a - b) / abs(b) for a, b in zip(runs[0]["losses"], rounds[0][dp]["losses"], strict=True)
            ),
        }
    result = {"config": vars(args), "dp": dp, "layouts": out}
    if dist.get_rank() == 0:
        report(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
