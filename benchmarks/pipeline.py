"""Pipeline-parallel training step: smp against torch.distributed.pipelining, measured in the same run.

    torchrun --standalone --nproc_per_node=2 benchmarks/pipeline.py [--steps 20] [--json FILE]

Two processes, one pipeline of two stages. Three contestants train their own copy of the
same GPT (tests/python/models.py, same seed, same batches):

  smp     smp.DistributedModel + @smp.step, automatic partition, "interleaved" (1F1B) pipeline;
          its default process group is "smp" (which wraps gloo).
  peer    torch.distributed.pipelining: PipelineStage + Schedule1F1B over a plain "gloo" group,
          split between the same blocks as smp's partition. The two stage modules are built by
          hand: pipeline()'s tracer splits this model too, but it deep-copies the tied
          embedding/head weight into each stage and leaves summing their gradients to the user.
          Here the head holds its own copy and its gradient is summed with the embedding's
          after each step (what smp does for a parameter shared by two stages).
  single  each process trains the whole model alone (no communication), the m microbatches one
          after the other: T1, the work of one pipeline step done serially, measured while the
          other core is busy too, as in the pipelined runs.

A step is zero_grad + forward/backward of the m microbatches + Adam step. After warm-up, every
round runs one step of each contestant in rotating order, each started after a barrier. A
pipelined step lasts until its slowest rank is done (max over ranks). Per contestant the median
over rounds is reported, the minimum (other load on the machine only adds time), the median of
the per-round ratios smp/peer (neighbours in time share the machine's drifts), and the median
minor page faults per step (both ranks). Efficiency = (T1 / p) / step time, against the
1F1B bound m / (m + p - 1). The three losses are compared as a check that all train the same model.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import time

import smp
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from models import GPT, lm_loss  # noqa: E402

LR = 1e-4
CONTESTANTS = ("smp", "peer", "single")


class FirstStage(nn.Module):
    """Embeddings and blocks[:boundary] of a GPT (sharing the GPT's modules)."""

    def __init__(self, gpt: GPT, boundary: int):
        super().__init__()
        self.tok, self.pos = gpt.tok, gpt.pos
        self.blocks = nn.ModuleList(gpt.blocks[:boundary])

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    """blocks[boundary:], ln_f and the head, which gets its own copy of the tied weight."""

    def __init__(self, gpt: GPT, boundary: int):
        super().__init__()
        self.blocks = nn.ModuleList(gpt.blocks[boundary:])
        self.ln_f = gpt.ln_f
        self.head = nn.Linear(gpt.head.in_features, gpt.head.out_features, bias=False)
        self.head.weight = nn.Parameter(gpt.head.weight.detach().clone())

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def stage_boundary(plan) -> int:
    """The first block on stage 1 of smp's plan; fails if the peer cannot reproduce the split."""
    first, last = plan.stage_units[0], plan.stage_units[1]
    if not {"tok", "pos"} <= set(first) or not {"ln_f", "head"} <= set(last):
        sys.exit(f"smp put the embeddings or the head elsewhere than the peer can:\n{plan.report()}")
    blocks = [[int(u.split(".")[1]) for u in units if u.startswith("blocks.")] for units in (first, last)]
    if blocks[0] and blocks[1] and max(blocks[0]) >= min(blocks[1]):
        sys.exit(f"smp split inside a block; the peer splits between blocks only:\n{plan.report()}")
    return min(blocks[1])


def batch(step: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


def make_smp_step(gpt: GPT):
    model = smp.DistributedModel(gpt)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR))

    @smp.step
    def train_step(ids):
        loss = lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    def run(ids) -> float | None:
        opt.zero_grad()
        loss = train_step(ids).reduce_mean()
        opt.step()
        return loss.item() if smp.pp_rank() == smp.pp_size() - 1 else None

    return model, run


def make_peer_step(gpt: GPT, boundary: int, microbatches: int, group):
    """torch.distributed.pipelining's 1F1B over `group`, stage i on rank i."""
    rank = dist.get_rank(group)
    module = FirstStage(gpt, boundary) if rank == 0 else LastStage(gpt, boundary)
    tied = module.tok.weight if rank == 0 else module.head.weight
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), group=group)
    schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=lm_loss)
    opt = torch.optim.Adam(module.parameters(), lr=LR)

    def run(ids) -> float | None:
        opt.zero_grad()
        losses = []
        if rank == 0:
            schedule.step(ids)
        else:
            schedule.step(target=ids, losses=losses)
        dist.all_reduce(tied.grad, group=group)  # the tied embedding/head: sum both stages' parts
        opt.step()
        return torch.stack(losses).mean().item() if losses else None

    return run


def make_single_step(gpt: GPT, microbatches: int):
    opt = torch.optim.Adam(gpt.parameters(), lr=LR)

    def run(ids) -> float:
        opt.zero_grad()
        total = 0.0
        for mb in ids.chunk(microbatches):
            loss = lm_loss(gpt(mb), mb)
            (loss / microbatches).backward()
            total += loss.item()
        opt.step()
        return total / microbatches

    return run


def timed(run, ids, group) -> tuple[float, int, float | None]:
    """Seconds and minor page faults of one step of `run`, started together on all ranks."""
    dist.barrier(group=group)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    loss = run(ids)
    seconds = time.perf_counter() - start
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, loss


def measure(args) -> dict | None:
    torch.set_num_threads(1)  # two processes share the machine's cores
    smp.init({"pipeline_parallel_degree": 2, "microbatches": args.microbatches, "pipeline": "interleaved"})
    if smp.size() != 2:
        sys.exit("run with torchrun --nproc_per_node=2: one pipeline of two stages")
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    gpt = GPT(args.vocab, args.dim, args.heads, args.layers, args.seq)
    peer_gpt, single_gpt = copy.deepcopy(gpt), copy.deepcopy(gpt)

    smp_model, smp_run = make_smp_step(gpt)
    load = [os.getloadavg()[0]]
    warm = [batch(-1 - i, args) for i in range(args.warmup)]
    for ids in warm:  # the first step partitions the model
        smp_run(ids)
    boundary = stage_boundary(smp_model.partition_plan)
    runs = {
        "smp": smp_run,
        "peer": make_peer_step(peer_gpt, boundary, args.microbatches, gloo),
        "single": make_single_step(single_gpt, args.microbatches),
    }
    for ids in warm:
        runs["peer"](ids)
        runs["single"](ids)

    mine = {name: {"seconds": [], "faults": [], "losses": []} for name in CONTESTANTS}
    for step in range(args.steps):
        ids = batch(step, args)
        for name in CONTESTANTS[step % 3 :] + CONTESTANTS[: step % 3]:
            seconds, faults, loss = timed(runs[name], ids, gloo)
            mine[name]["seconds"].append(seconds)
            mine[name]["faults"].append(faults)
            mine[name]["losses"].append(loss)
    load.append(os.getloadavg()[0])
    ranks = [None, None]
    dist.all_gather_object(ranks, mine, group=gloo)
    if dist.get_rank() != 0:
        return None

    # A pipelined step lasts until its slowest rank is done; the single runs are independent samples.
    first, last = ranks
    samples = {
        name: list(map(max, first[name]["seconds"], last[name]["seconds"])) for name in ("smp", "peer")
    }
    samples["single"] = first["single"]["seconds"] + last["single"]["seconds"]
    faults = {  # both ranks together
        name: statistics.median(
            a + b for a, b in zip(first[name]["faults"], last[name]["faults"], strict=True)
        )
        for name in CONTESTANTS
    }
    t_smp, t_peer, t1 = (statistics.median(samples[name]) for name in CONTESTANTS)
    p, m = 2, args.microbatches
    reference = last["single"]["losses"]  # the pipelines' losses are on the last stage
    loss_gap = {
        name: max(abs(a - b) / abs(b) for a, b in zip(last[name]["losses"], reference, strict=True))
        for name in ("smp", "peer")
    }
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "partition": smp_model.partition_report(),
        "boundary": boundary,
        "smp_s": t_smp,
        "peer_s": t_peer,
        "single_s": t1,
        "ratio": t_smp / t_peer,
        "ratio_paired": statistics.median(
            a / b for a, b in zip(samples["smp"], samples["peer"], strict=True)
        ),
        "smp_efficiency": t1 / p / t_smp,
        "peer_efficiency": t1 / p / t_peer,
        "bound": m / (m + p - 1),
        "min_s": {name: min(v) for name, v in samples.items()},
        "page_faults": faults,
        "samples": samples,
        "load_average": load,
        "loss_gap": loss_gap,
    }


def report(r: dict) -> None:
    c, low = r["config"], r["min_s"]
    print(
        f"GPT vocab {c['vocab']} dim {c['dim']} heads {c['heads']} layers {c['layers']} seq {c['seq']}, "
        f"batch {c['batch']}, {c['microbatches']} microbatches, 2 stages, {c['steps']} rounds"
    )
    print(r["partition"])
    b = r["boundary"]
    print(f"peer split at smp's boundary: blocks.0-{b - 1} | blocks.{b}-{c['layers'] - 1}")
    print(f"{'step time':<44} {'median ms':>10} {'min ms':>8} {'page faults':>12}")
    labels = {
        "smp": "smp",
        "peer": "peer (pipelining Schedule1F1B, gloo)",
        "single": "single (one process, whole model) = T1",
    }
    for name, label in labels.items():
        median, fastest, faults = r[f"{name}_s"], low[name], r["page_faults"][name]
        print(f"{label:<44} {median * 1e3:>10.1f} {fastest * 1e3:>8.1f} {faults:>12.0f}")
    print(f"{'ratio smp/peer (target <= 1.0)':<44} {r['ratio']:>10.3f} {low['smp'] / low['peer']:>8.3f}")
    print(f"median over rounds of smp/peer in the same round: {r['ratio_paired']:.3f}")
    print(
        f"efficiency (T1/2)/step: smp {r['smp_efficiency']:.3f}, peer {r['peer_efficiency']:.3f} "
        f"(1F1B bound m/(m+p-1) = {r['bound']:.3f})"
    )
    print("1-minute load average of the machine at start and end: {:.2f}, {:.2f}".format(*r["load_average"]))
    gap = r["loss_gap"]
    print(f"max relative loss difference to the single process: smp {gap['smp']:.1e}, peer {gap['peer']:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (one step of each contestant)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each contestant first")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--json", help="rank 0 also writes the results to this file")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: smp partitions the model on its first step")
    if "RANK" not in os.environ:
        sys.exit("launch with: torchrun --standalone --nproc_per_node=2 benchmarks/pipeline.py")
    results = measure(args)
    if results is not None:
        report(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
