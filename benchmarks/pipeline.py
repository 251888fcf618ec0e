"""Pipeline-parallel training step: smp against torch.distributed.pipelining, measured in the same run.

    torchrun --standalone --nproc_per_node=2 benchmarks/pipeline.py [--schedule zero_bubble]
        [--peers 1f1b,izb,zbv] [--steps 20] [--json FILE]

p processes (2 or 4), one pipeline of p stages. The contestants train their own copy of the
same GPT (tests/python/models.py, same seed, same batches):

  smp     smp.DistributedModel + @smp.step, automatic partition, the --schedule pipeline
          ("interleaved" = 1F1B, "zero_bubble" = ZB-H1, "zero_bubble_v" = ZB-V with 2 stages per
          rank, "simple"); its default process group is
          "smp" (which wraps gloo).
  1f1b    torch.distributed.pipelining: PipelineStage + Schedule1F1B over a plain "gloo" group,
          split between the same blocks as smp's partition (against smp's zero_bubble_v, each
          rank's two smp stages joined in one). The stage modules are built by
          hand: pipeline()'s tracer splits this model too, but it deep-copies the tied
          embedding/head weight into each stage and leaves summing their gradients to the user.
          Here the head holds its own copy and its gradient is summed with the embedding's
          after each step (what smp does for a parameter shared by two stages).
  izb     ScheduleInterleavedZeroBubble, 2 stages per rank (stage i on rank i % p), split where
          smp's zero_bubble_v split its 2p stages, else the blocks split evenly over the 2p stages
          (torch's zero-bubble schedules need several stages per rank; smp's zero_bubble has one).
  zbv     ScheduleZBVZeroBubble, 2 stages per rank in a V (rank r holds stages r and 2p-1-r), split
          as izb: the same stages on the same ranks as smp's zero_bubble_v.
  single  each process trains the whole model alone (no communication), the m microbatches one
          after the other: T1, the work of one pipeline step done serially, measured while the
          other cores are busy too, as in the pipelined runs.

A step is zero_grad + forward/backward of the m microbatches + Adam step. After warm-up, every
round runs one step of each contestant in rotating order, each started after a barrier. A
pipelined step lasts until its slowest rank is done (max over ranks). Per contestant the median
over rounds is reported, the minimum (other load on the machine only adds time), the median of
the per-round ratios smp/peer (neighbours in time share the machine's drifts), and the median
minor page faults per step (all ranks). Efficiency = (T1 / p) / step time, against the
1F1B bound m / (m + p - 1). The losses are compared as a check that all train the same model.
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
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from models import GPT, lm_loss  # noqa: E402

LR = 1e-4


class Chunk(nn.Module):
    """blocks[lo:hi] of a GPT (sharing its modules), with the embeddings if first and ln_f and
    the head if last; the head gets its own copy of the tied weight (summed by sum_tied)."""

    def __init__(self, gpt: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok, self.pos = gpt.tok, gpt.pos
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        if last:
            self.ln_f = gpt.ln_f
            self.head = nn.Linear(gpt.head.in_features, gpt.head.out_features, bias=False)
            self.head.weight = nn.Parameter(gpt.head.weight.detach().clone())

    def forward(self, x):
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def stage_boundaries(plan) -> list[int]:
    """The first block of each stage of smp's plan (stages + 1 entries, the last = layers); fails if
    the peer cannot reproduce the split."""
    units, p = plan.stage_units, plan.num_stages
    if not {"tok", "pos"} <= set(units[0]) or not {"ln_f", "head"} <= set(units[p - 1]):
        sys.exit(f"smp put the embeddings or the head elsewhere than the peer can:\n{plan.report()}")
    blocks = [sorted(int(u.split(".")[1]) for u in us if u.startswith("blocks.")) for us in units]
    bounds = [0]
    for s in range(1, p):
        bounds.append(blocks[s][0] if blocks[s] else bounds[-1])
    flat = [b for bs in blocks for b in bs]
    if flat != sorted(flat):
        sys.exit(f"smp split blocks out of order; the peer splits between blocks only:\n{plan.report()}")
    return bounds + [len(flat)]


def batch(step: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


class GPTWithLoss(GPT):
    """The same GPT, whose forward returns the loss (--loss-in-model): what docs/pipeline.md advises
    ("return only what the step needs"), so the pipeline sends every rank a scalar instead of the logits, and
    the step function on the other ranks computes no loss from them."""

    def forward(self, ids):
        return lm_loss(super().forward(ids), ids)


def make_smp_step(gpt: GPT):
    model = smp.DistributedModel(gpt)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR))
    loss_in_model = isinstance(gpt, GPTWithLoss)

    @smp.step
    def train_step(ids):
        out = model(ids)
        loss = out if loss_in_model else lm_loss(out, ids)
        model.backward(loss)
        return loss

    def run(ids) -> float | None:
        opt.zero_grad()
        loss = train_step(ids).reduce_mean()
        opt.step()
        return loss.item() if smp.pp_rank() == smp.pp_size() - 1 else None

    return model, run


PEERS = {  # contestant -> (torch schedule, stages per rank, placement of stage i)
    "1f1b": (Schedule1F1B, 1, "loop"),
    "izb": (ScheduleInterleavedZeroBubble, 2, "loop"),
    "zbv": (ScheduleZBVZeroBubble, 2, "v"),
}


def peer_stage_ids(rank: int, p: int, per_rank: int, placement: str) -> list[int]:
    if per_rank == 1:
        return [rank]
    if placement == "v":  # ZBV: rank r holds stages r and 2p-1-r
        return [rank, 2 * p - 1 - rank]
    return [rank + i * p for i in range(per_rank)]  # interleaved: stage i on rank i % p


def make_peer_step(gpt: GPT, name: str, bounds: list[int], microbatches: int, group):
    """torch.distributed.pipelining's schedule `name` over `group`, split where smp split (`bounds`)
    when smp cut as many stages (smp's zero_bubble_v: 2 per rank); one stage per rank against smp's
    2 per rank: each rank's two stages joined; 2 per rank against smp's one: the blocks split
    evenly (layers / stages each)."""
    cls, per_rank, placement = PEERS[name]
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    n = p * per_rank
    if len(bounds) - 1 == 2 * n:
        bounds = bounds[::2]
    elif len(bounds) - 1 != n:
        layers = bounds[-1]
        bounds = [round(i * layers / n) for i in range(n + 1)]
    ids = peer_stage_ids(rank, p, per_rank, placement)
    modules = {i: Chunk(gpt, bounds[i], bounds[i + 1], i == 0, i == n - 1) for i in ids}
    stages = [PipelineStage(modules[i], i, n, torch.device("cpu"), group=group) for i in ids]
    schedule = cls(stages[0] if per_rank == 1 else stages, n_microbatches=microbatches, loss_fn=lm_loss)
    params = [q for m in modules.values() for q in m.parameters()]
    opt = torch.optim.Adam(params, lr=LR)
    tied = [m.tok.weight for m in modules.values() if m.first] + [
        m.head.weight for m in modules.values() if m.last
    ]

    def run(ids_) -> float | None:
        opt.zero_grad()
        losses = []
        args = (ids_,) if 0 in modules else ()
        kwargs = {"target": ids_, "losses": losses} if n - 1 in modules else {}
        schedule.step(*args, **kwargs)
        sum_tied(tied, gpt, group)
        opt.step()
        return torch.stack(losses).mean().item() if losses else None

    return run


def sum_tied(tied: list[torch.Tensor], gpt: GPT, group) -> None:
    """The tied embedding/head: every holder gets the sum of all holders' gradients (what smp does
    for a parameter shared by two stages)."""
    total = torch.zeros_like(gpt.head.weight)
    for w in tied:
        total += w.grad
    dist.all_reduce(total, group=group)
    for w in tied:
        w.grad.copy_(total)


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
    torch.set_num_threads(1)  # the processes share the machine's cores
    p = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    config = {"pipeline_parallel_degree": p, "microbatches": args.microbatches, "pipeline": args.schedule}
    if args.ordered:  # the path CUDA tensors take (NCCL's), here over Gloo on one tag
        config["ordered_messages"] = True
    if args.timeline:  # smp's steps after the warm-up, as a Chrome trace and a picture
        config["timeline"] = {"path": args.timeline, "start": args.warmup + 2, "steps": 4}
    smp.init(config)
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    gpt = GPT(args.vocab, args.dim, args.heads, args.layers, args.seq)
    copies = {name: copy.deepcopy(gpt) for name in args.peers + ["single"]}
    if args.loss_in_model:  # smp's copy returns its loss (the same weights, modules and names)
        gpt.__class__ = GPTWithLoss

    smp_model, smp_run = make_smp_step(gpt)
    load = [os.getloadavg()[0]]
    warm = [batch(-1 - i, args) for i in range(args.warmup)]
    for ids in warm:  # the first step partitions the model
        smp_run(ids)
    bounds = stage_boundaries(smp_model.partition_plan)
    runs = {"smp": smp_run, "single": make_single_step(copies["single"], args.microbatches)}
    for name in args.peers:
        runs[name] = make_peer_step(copies[name], name, bounds, args.microbatches, gloo)
    contestants = ["smp", *args.peers, "single"]
    for ids in warm:
        for name in contestants[1:]:
            runs[name](ids)

    mine = {name: {"seconds": [], "faults": [], "losses": []} for name in contestants}
    for step in range(args.steps):
        ids = batch(step, args)
        r = step % len(contestants)
        for name in contestants[r:] + contestants[:r]:
            seconds, faults, loss = timed(runs[name], ids, gloo)
            mine[name]["seconds"].append(seconds)
            mine[name]["faults"].append(faults)
            mine[name]["losses"].append(loss)
    load.append(os.getloadavg()[0])
    ranks = [None] * p
    dist.all_gather_object(ranks, mine, group=gloo)
    if dist.get_rank() != 0:
        return None

    # A pipelined step lasts until its slowest rank is done; the single runs are independent samples.
    pipelined = contestants[:-1]
    samples = {
        name: [max(x) for x in zip(*(r[name]["seconds"] for r in ranks), strict=True)] for name in pipelined
    }
    samples["single"] = [t for r in ranks for t in r["single"]["seconds"]]
    faults = {
        name: statistics.median(sum(x) for x in zip(*(r[name]["faults"] for r in ranks), strict=True))
        for name in contestants
    }
    medians = {name: statistics.median(samples[name]) for name in contestants}
    t1, m = medians["single"], args.microbatches
    reference = ranks[0]["single"]["losses"]

    def losses_of(name):  # the rank holding the last stage reports the loss
        return next(r[name]["losses"] for r in ranks if r[name]["losses"][0] is not None)

    loss_gap = {
        name: max(abs(a - b) / abs(b) for a, b in zip(losses_of(name), reference, strict=True))
        for name in pipelined
    }
    paired = {
        name: statistics.median(a / b for a, b in zip(samples["smp"], samples[name], strict=True))
        for name in args.peers
    }
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "stages": p,
        "partition": smp_model.partition_report(),
        "bounds": bounds,
        "median_s": medians,
        "min_s": {name: min(v) for name, v in samples.items()},
        "paired_smp_over": paired,
        "efficiency": {name: t1 / p / medians[name] for name in pipelined},
        "bound_1f1b": m / (m + p - 1),
        "page_faults": faults,
        "samples": samples,
        "load_average": load,
        "loss_gap": loss_gap,
    }


LABELS = {
    "smp": "smp",
    "1f1b": "torch Schedule1F1B",
    "izb": "torch ScheduleInterleavedZeroBubble (2/rank)",
    "zbv": "torch ScheduleZBVZeroBubble (2/rank, V)",
    "single": "single (one process, whole model) = T1",
}


def report(r: dict) -> None:
    c, p = r["config"], r["stages"]
    print(
        f"GPT vocab {c['vocab']} dim {c['dim']} heads {c['heads']} layers {c['layers']} seq {c['seq']}, "
        f"batch {c['batch']}, {c['microbatches']} microbatches, {p} stages, {c['steps']} rounds, "
        f"smp schedule {c['schedule']!r}"
    )
    print(r["partition"])
    print(f"smp's stage boundaries (blocks), which peers with as many stages use: {r['bounds']}")
    if c.get("loss_in_model"):
        print("smp's model returns its loss (--loss-in-model): the pipeline sends a scalar, not the logits")
    print(f"{'step time':<48} {'median ms':>10} {'min ms':>8} {'efficiency':>10} {'page faults':>12}")
    for name, median in r["median_s"].items():
        eff = r["efficiency"].get(name)
        eff = f"{eff:.3f}" if eff is not None else ""
        print(
            f"{LABELS[name]:<48} {median * 1e3:>10.1f} {r['min_s'][name] * 1e3:>8.1f} {eff:>10} "
            f"{r['page_faults'][name]:>12.0f}"
        )
    for name, ratio in r["paired_smp_over"].items():
        plain = r["median_s"]["smp"] / r["median_s"][name]
        print(f"smp / {LABELS[name]}: medians {plain:.3f}, paired {ratio:.3f}")
    print(f"efficiency = (T1/{p})/step; 1F1B bound m/(m+p-1) = {r['bound_1f1b']:.3f}")
    print("1-minute load average of the machine at start and end: {:.2f}, {:.2f}".format(*r["load_average"]))
    gaps = ", ".join(f"{name} {gap:.1e}" for name, gap in r["loss_gap"].items())
    print(f"max relative loss difference to the single process: {gaps}")


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
    parser.add_argument("--schedule", default="interleaved", help="smp's pipeline schedule")
    parser.add_argument(
        "--ordered",
        action="store_true",
        help="smp sends on the ordered path (one tag, one global posting order: NCCL's) instead of tags",
    )
    parser.add_argument(
        "--peers",
        default="1f1b,izb,zbv",
        help=f"torch.distributed.pipelining schedules to run, of {','.join(PEERS)}",
    )
    parser.add_argument(
        "--loss-in-model",
        action="store_true",
        help="smp's model returns the loss instead of the logits (docs/pipeline.md's advice: the pipeline "
        "then sends every rank a scalar, and no other rank computes the loss); the torch contestants "
        "are unchanged (their loss_fn runs on the last stage only)",
    )
    parser.add_argument(
        "--timeline", help="record 4 of smp's steps into this directory (smp.services.timeline)"
    )
    parser.add_argument("--json", help="rank 0 also writes the results to this file")
    args = parser.parse_args()
    args.peers = [x for x in args.peers.split(",") if x]
    if unknown := set(args.peers) - set(PEERS):
        parser.error(f"--peers: unknown {sorted(unknown)}; use some of {','.join(PEERS)}")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: smp partitions the model on its first step")
    if "RANK" not in os.environ:
        sys.exit("launch with: torchrun --standalone --nproc_per_node=2 (or 4) benchmarks/pipeline.py")
    results = measure(args)
    if results is not None:
        report(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
