"""Tensor-parallel training step: smp against DTensor tensor parallelism, measured in the same run.

    torchrun --standalone --nproc_per_node=2 benchmarks/tensor_parallel.py [--steps 20] [--json FILE]
        [--prescaled | --no-prescaled] [--smp-model split|fused] [--ops-cpu]
    python benchmarks/tensor_parallel.py [--ops-cpu]     # world size 1: the op-level timing alone

(with the package installed, or PYTHONPATH=python from the repository root)

Two processes, one tensor-parallel group of two. Each contestant trains its own copy of the same
GPT (same seed, same initial weights, same batches):

  smp         smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True}), the model built under
              `with smp.tensor_parallelism():` (everything marked), smp.DistributedModel,
              smp.DistributedOptimizer(Adam), an @smp.step function calling model(ids), lm_loss and
              model.backward(loss). smp's process groups use its "smp" backend (which wraps gloo).
  peer        torch.distributed.tensor.parallel over a plain "gloo" group (DeviceMesh.from_group):
              ColwiseParallel on q, k, v and the MLP up projection, RowwiseParallel on the attention
              output and the MLP down projection, and PrepareModuleInput on the attention module
              (Replicate -> Replicate, kept a DTensor), as torchtitan's plan does, so q, k and v share
              one input and one all-reduce of its gradient; the heads made local (heads //= 2).
  peer_plain  the same without PrepareModuleInput: q, k and v each turn the plain input into a
              DTensor, so each all-reduces its own input gradient, as smp does.
  single      each process trains the whole model alone (no communication) while the other does
              the same: the work of one step done serially, both cores busy.

The model is tests/python/models.py's GPT with this file's attention: separate q, k and v projections
(the test GPT fuses them in one `qkv` Linear followed by .split(d): smp shards that correctly as
three blocks, but a plain ColwiseParallel on a fused qkv would hand rank 0 all of q and half of k).
Its attention reshapes with a stored head_dim, so lowering `heads` to the local count (torchtitan's
`n_heads //= tp`) is all DTensor needs; otherwise it computes exactly what the test GPT computes.
With --smp-model fused, smp trains the test GPT itself instead (one fused qkv Linear, its weight
the concatenation [q; k; v] of the same initial weights), while the peers keep q, k and v separate:
smp then needs one all-reduce of the attention input's gradient, as the peer does.

Both contestants shard the same layers: q, k, v, the MLP up projection (weights, and the up bias)
by output features; the attention output and MLP down projections by input features (their biases
replicated, added after the all-reduce); the token and position embeddings by rows (vocab-parallel:
each rank looks up its rows, then an all-reduce); the head by output features (vocab) with its
logits gathered, since the loss is computed outside the model. The head's weight is tied to the
token embedding: both shard it by rows (dim 0), the same split, so it stays one parameter. In smp
the pass sees one tensor read by an embedding and a linear with the same ShardSpec; for DTensor the
head is re-tied to the token embedding's DTensor parameter after parallelize_module (which would
otherwise have distributed the two references separately). LayerNorms stay replicated in both.

prescaled_batch: with --prescaled (the default) both ranks of the TP group read the same batch.
With --no-prescaled (SMP's default) smp's rank r reads rows r*B/2.. of the batch, and smp gathers
the group's batches along dim 0 and cuts the logits back to each rank's rows; the peers, which
have no such mode, read the whole batch. The model computes the same thing in both modes.

A step is zero_grad + forward/backward + Adam step. After warm-up, every round runs one step of each
contestant in rotating order, each started after a barrier; a TP step lasts until its slower rank is
done (max over ranks). Per contestant: the median over rounds, the minimum (other load only adds
time), the median of the per-round ratios against the peer (neighbours in time share the machine's
drifts), and the median time in forward (model call and loss), backward, the optimizer step and the
rest (zero_grad, smp's step machinery and its wait for the gradient all-reduce). After the timed
rounds one more step of each counts the collectives it issues (smp: smp.backend_stats of its
groups, by group; peers: CommDebugMode). The losses of the timed rounds are compared with the single
process's as a check that all train the same model.

Op level: at world size 1 (a group of one), torch.ops.smp.column_parallel_linear against
torch.nn.functional.linear, forward and forward+backward, timed with CUDA events, when CUDA is
available; otherwise skipped with a note (--ops-cpu times the same on CPU with perf_counter).
In the two-process run, rank 0 does this after the steps, on a group of its own.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time

import smp
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import models  # noqa: E402
from models import GPT, lm_loss  # noqa: E402

LR = 1e-4
TP = 2
CONTESTANTS = ("smp", "peer", "peer_plain", "single")
PHASES = ("forward", "backward", "optimizer", "other")


# --- the model: tests/python/models.py's GPT with q, k and v separate (this attention) ---------------


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads  # heads: this rank's count under DTensor
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            f(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def build(args) -> GPT:
    torch.manual_seed(0)
    return GPT(args.vocab, args.dim, args.heads, args.layers, args.seq, attention=Attention)


def batch(step: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


# --- contestants: each returns run(ids) -> (loss, {phase: seconds}) --------------------------------


def fused_copy(reference: GPT, args) -> nn.Module:
    """tests/python/models.py's GPT (fused qkv) with the reference's weights (qkv = [q; k; v])."""
    with smp.tensor_parallelism():
        fused = models.GPT(args.vocab, args.dim, args.heads, args.layers, args.seq)
    state = reference.state_dict()
    for i in range(args.layers):
        parts = [state.pop(f"blocks.{i}.attn.{name}.weight") for name in "qkv"]
        state[f"blocks.{i}.attn.qkv.weight"] = torch.cat(parts)
    fused.load_state_dict(state)
    return fused


def make_smp_step(gpt: GPT, prescaled: bool):
    model = smp.DistributedModel(gpt)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR))
    marks: list[float] = []

    @smp.step
    def train_step(ids):
        marks.append(time.perf_counter())
        loss = lm_loss(model(ids), ids)
        marks.append(time.perf_counter())
        model.backward(loss)
        marks.append(time.perf_counter())
        return loss

    def run(ids):
        if not prescaled:  # this rank's rows; smp runs the group's rows together
            ids = ids.chunk(smp.tp_size())[smp.tp_rank()]
        opt.zero_grad()
        marks.clear()
        loss = train_step(ids).reduce_mean()
        before_opt = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        phases = {
            "forward": marks[1] - marks[0],
            "backward": marks[2] - marks[1],
            "optimizer": end - before_opt,
        }
        return loss.item(), phases

    return model, run


def parallelize_peer(gpt: GPT, mesh: DeviceMesh, prepare_attention_input: bool) -> GPT:
    """DTensor tensor parallelism on the layers smp shards (see the module docstring)."""
    for block in gpt.blocks:
        plan = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(),
        }
        if prepare_attention_input:
            plan["attn"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
            )
        parallelize_module(block, mesh, plan)
        block.attn.heads //= mesh.size()
    parallelize_module(
        gpt,
        mesh,
        {
            "tok": RowwiseParallel(input_layouts=Replicate()),
            "pos": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    # Tied weight: both were sharded on dim 0 from the same full tensor; keep one parameter.
    assert gpt.tok.weight.placements == gpt.head.weight.placements
    gpt.head.weight = gpt.tok.weight
    return gpt


def make_eager_step(gpt: nn.Module):
    """A plain training step (the DTensor peers and the single process)."""
    opt = torch.optim.Adam(gpt.parameters(), lr=LR)

    def run(ids):
        opt.zero_grad()
        t0 = time.perf_counter()
        loss = lm_loss(gpt(ids), ids)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        return loss.item(), {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2}

    return run


def timed(run, ids, group):
    """Seconds of one step of `run`, started together on both ranks, its loss and phase times."""
    dist.barrier(group=group)
    start = time.perf_counter()
    loss, phases = run(ids)
    seconds = time.perf_counter() - start
    phases["other"] = seconds - sum(phases.values())  # zero_grad, smp's step machinery, waits
    return seconds, loss, phases


def smp_launched() -> dict[str, int]:
    """Collectives launched so far on each of smp's groups (by the first kind naming the group)."""
    st = smp.parallel_state.state()
    groups = {}
    for kind, group in [*st.process_groups.items(), ("messaging", st.messaging_group)]:
        groups.setdefault(group, getattr(kind, "name", kind).lower())
    return {name: smp.backend_stats(group)["cpu"]["launched"] for group, name in groups.items()}


def count_collectives(runs, ids, group) -> dict:
    """Collectives one step issues: smp from its backend's counters, the DTensor peers from
    CommDebugMode (the functional collectives DTensor calls, forward and backward)."""
    counts = {}
    dist.barrier(group=group)
    before = smp_launched()
    runs["smp"](ids)
    after = smp_launched()
    per_group = {name: after[name] - before[name] for name in after if after[name] > before[name]}
    counts["smp"] = {"total": sum(per_group.values()), **per_group}
    for name in ("peer", "peer_plain"):
        dist.barrier(group=group)
        with CommDebugMode() as mode:
            runs[name](ids)
        per_op = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
        counts[name] = {"total": mode.get_total_counts(), **per_op}
    return counts


def measure(args) -> dict | None:
    torch.set_num_threads(1)  # two processes share the machine's cores
    smp.init({"tensor_parallel_degree": TP, "prescaled_batch": args.prescaled})
    if smp.size() != TP:
        sys.exit(f"run with torchrun --nproc_per_node={TP}: one tensor-parallel group of {TP}")
    gloo = dist.new_group(backend="gloo")
    mesh = DeviceMesh.from_group(gloo, "cpu")
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        gpt = build(args)
    reference = build(args)  # the same seed: the same weights, unmarked
    same = zip(gpt.state_dict().values(), reference.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in same)
    if args.smp_model == "fused":
        gpt = fused_copy(reference, args)
    smp_model, smp_run = make_smp_step(gpt, args.prescaled)
    runs = {
        "smp": smp_run,
        "peer": make_eager_step(parallelize_peer(copy.deepcopy(reference), mesh, True)),
        "peer_plain": make_eager_step(parallelize_peer(copy.deepcopy(reference), mesh, False)),
        "single": make_eager_step(reference),
    }
    load = [os.getloadavg()[0]]
    warm = [batch(-1 - i, args) for i in range(args.warmup)]
    for name in CONTESTANTS:  # smp captures and shards the model on its first step
        for ids in warm:
            runs[name](ids)
    distributed = sorted(
        n for n, p in smp_model.local_named_parameters() if smp_model.is_distributed_parameter(p)
    )

    mine = {name: {"seconds": [], "losses": [], "phases": []} for name in CONTESTANTS}
    for step in range(args.steps):
        ids = batch(step, args)
        k = step % len(CONTESTANTS)
        for name in CONTESTANTS[k:] + CONTESTANTS[:k]:
            seconds, loss, phases = timed(runs[name], ids, gloo)
            mine[name]["seconds"].append(seconds)
            mine[name]["losses"].append(loss)
            mine[name]["phases"].append(phases)
    load.append(os.getloadavg()[0])
    # Not timed: these steps train on, with a batch of their own, after the loss record.
    collectives = count_collectives(runs, batch(10**6, args), gloo)
    ranks = [None] * TP
    dist.all_gather_object(ranks, mine, group=gloo)
    if dist.get_rank() != 0:
        return None

    samples = {
        name: [max(s) for s in zip(*(r[name]["seconds"] for r in ranks), strict=True)]
        for name in CONTESTANTS
        if name != "single"
    }
    samples["single"] = [s for r in ranks for s in r["single"]["seconds"]]  # independent samples
    phases = {
        name: {
            phase: statistics.median(p[phase] for r in ranks for p in r[name]["phases"]) for phase in PHASES
        }
        for name in CONTESTANTS
    }
    # smp's loss under --no-prescaled is each rank's rows: the batch's loss is their mean.
    losses = {
        name: [statistics.fmean(x) for x in zip(*(r[name]["losses"] for r in ranks), strict=True)]
        for name in CONTESTANTS
    }
    loss_gap = {
        name: max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses["single"], strict=True))
        for name in CONTESTANTS
        if name != "single"
    }
    median = {name: statistics.median(v) for name, v in samples.items()}
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "torch": torch.__version__,
        "parameters": sum(p.numel() for p in reference.parameters()),
        "smp_distributed": distributed,
        "median_s": median,
        "min_s": {name: min(v) for name, v in samples.items()},
        "ratio": {name: median["smp"] / median[name] for name in ("peer", "peer_plain")},
        "ratio_paired": {
            name: statistics.median(a / b for a, b in zip(samples["smp"], samples[name], strict=True))
            for name in ("peer", "peer_plain")
        },
        "phases_s": phases,
        "collectives_per_step": collectives,
        "samples": samples,
        "losses": losses,
        "loss_gap": loss_gap,
        "load_average": load,
    }


def report(r: dict) -> None:
    c = r["config"]
    print(
        f"GPT vocab {c['vocab']} dim {c['dim']} heads {c['heads']} layers {c['layers']} seq {c['seq']} "
        f"({r['parameters'] / 1e6:.2f} M parameters), batch {c['batch']}, tp {TP}, "
        f"prescaled_batch={c['prescaled']}, smp model: {c['smp_model']} q/k/v, {c['steps']} rounds, "
        f"torch {r['torch']}"
    )
    print(f"smp shards {len(r['smp_distributed'])} parameters: {', '.join(r['smp_distributed'])}")
    labels = {
        "smp": "smp",
        "peer": "peer (DTensor TP, torchtitan plan, gloo)",
        "peer_plain": "peer_plain (DTensor, no PrepareModuleInput)",
        "single": "single (one process, whole model)",
    }
    print(
        f"{'step time, ms':<44} {'median':>7} {'min':>7} | {'fwd':>6} {'bwd':>6} {'opt':>6} {'other':>6} "
        f"| {'collectives':>11}"
    )
    for name, label in labels.items():
        ph = [r["phases_s"][name][phase] * 1e3 for phase in PHASES]
        n = r["collectives_per_step"].get(name, {}).get("total", 0)
        print(
            f"{label:<44} {r['median_s'][name] * 1e3:>7.1f} {r['min_s'][name] * 1e3:>7.1f} | "
            + " ".join(f"{x:>6.1f}" for x in ph)
            + f" | {n:>11}"
        )
    print("(fwd: model call + loss, bwd: backward, opt: Adam step, other: the rest of the step; medians)")
    low = r["min_s"]
    for name in ("peer", "peer_plain"):
        target = " (target <= 0.9)" if name == "peer" else ""
        print(
            f"smp/{name}{target}: medians {r['ratio'][name]:.3f}, minima {low['smp'] / low[name]:.3f}, "
            f"median of per-round ratios {r['ratio_paired'][name]:.3f}"
        )
    t = r["median_s"]
    print(
        f"speed-up over one process (single / step): smp {t['single'] / t['smp']:.2f}, "
        f"peer {t['single'] / t['peer']:.2f}"
    )
    print(f"collectives per step: {r['collectives_per_step']}")
    print("1-minute load average of the machine at start and end: {:.2f}, {:.2f}".format(*r["load_average"]))
    gap = r["loss_gap"]
    ok = max(gap.values()) <= 1e-4
    print(
        "max relative loss difference to the single process over the rounds: "
        + ", ".join(f"{name} {g:.1e}" for name, g in gap.items())
        + (" (all within 1e-4: the same model is trained)" if ok else " -- MISMATCH (> 1e-4)")
    )


# --- op level: column_parallel_linear against F.linear at group size 1 ---------------------------


def op_timing(group_name: str, device: torch.device, iters: int) -> list[dict]:
    """Median per call of forward, and of forward + backward, in rotating order."""
    if device.type == "cuda":
        shapes, dtype = [(4096, 1024, 4096), (4096, 4096, 4096), (8192, 4096, 14336)], torch.bfloat16
    else:
        shapes, dtype = [(512, 256, 768), (1024, 256, 1024), (2048, 1024, 1024)], torch.float32
    ops = {
        "smp": lambda x, w: torch.ops.smp.column_parallel_linear(x, w, None, group_name),
        "torch": lambda x, w: F.linear(x, w),
    }
    rows = []
    for tokens, d_in, d_out in shapes:
        x = torch.randn(tokens, d_in, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(d_out, d_in, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(tokens, d_out, device=device, dtype=dtype)
        row = {"tokens": tokens, "in": d_in, "out": d_out, "dtype": str(dtype).split(".")[-1]}
        for backward in (False, True):
            times = {name: [] for name in ops}
            for i in range(iters + 3):
                order = list(ops) if i % 2 == 0 else list(ops)[::-1]
                for name in order:
                    seconds = _time_call(ops[name], x, w, g if backward else None, device)
                    if i >= 3:  # warm-up
                        times[name].append(seconds)
            kind = "fwd_bwd" if backward else "fwd"
            for name in ops:
                row[f"{name}_{kind}_us"] = statistics.median(times[name]) * 1e6
        rows.append(row)
    return rows


def _time_call(op, x, w, grad, device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = op(x, w)
        if grad is not None:
            out.backward(grad)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        start = time.perf_counter()
        out = op(x, w)
        if grad is not None:
            out.backward(grad)
        seconds = time.perf_counter() - start
    x.grad = w.grad = None
    return seconds


def op_level(args, group_name: str | None) -> list[dict] | None:
    """On this rank (rank 0), with a group of one; None when skipped."""
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    elif args.ops_cpu:
        device = torch.device("cpu")
    else:
        print(
            "op-level timing (torch.ops.smp.column_parallel_linear vs F.linear at group size 1, CUDA "
            "events): skipped, CUDA is not available on this machine (--ops-cpu times it on CPU)"
        )
        return None
    rows = op_timing(group_name, device, args.op_iters)
    print(
        f"op level on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
        f"group of one, median µs per call over {args.op_iters}:"
    )
    print(
        f"{'tokens x in -> out':<24} {'dtype':>8} {'smp fwd':>9} {'F fwd':>9} {'ratio':>6} "
        f"{'smp f+b':>9} {'F f+b':>9} {'ratio':>6}"
    )
    for row in rows:
        fwd = row["smp_fwd_us"] / row["torch_fwd_us"]
        both = row["smp_fwd_bwd_us"] / row["torch_fwd_bwd_us"]
        shape = f"{row['tokens']} x {row['in']} -> {row['out']}"
        print(
            f"{shape:<24} {row['dtype']:>8} {row['smp_fwd_us']:>9.1f} {row['torch_fwd_us']:>9.1f} "
            f"{fwd:>6.3f} {row['smp_fwd_bwd_us']:>9.1f} {row['torch_fwd_bwd_us']:>9.1f} {both:>6.3f}"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (one step of each contestant)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each contestant first")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (the TP group's batch)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument(
        "--prescaled",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="smp's prescaled_batch: both TP ranks read the same batch (default), or half each",
    )
    parser.add_argument(
        "--smp-model",
        choices=("split", "fused"),
        default="split",
        help="smp trains this file's GPT (split) or the test GPT with one fused qkv Linear, same weights",
    )
    parser.add_argument("--ops-cpu", action="store_true", help="run the op-level timing on CPU too")
    parser.add_argument("--op-iters", type=int, default=50, help="timed calls per op and shape")
    parser.add_argument("--json", help="rank 0 also writes the results to this file")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: smp shards the model on its first step")
    if args.batch % TP:
        parser.error(f"--batch must divide by {TP} (--no-prescaled gives each rank half)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results: dict = {}
    if world == 1:  # the op-level timing alone
        smp.init()
        results["ops"] = op_level(args, dist.group.WORLD.group_name)
    else:
        results = measure(args) or {}
        # Op level on rank 0, over a group of its own (every rank takes part in creating it).
        alone = dist.new_group([0], backend=smp.BACKEND_NAME)
        if dist.get_rank() == 0:
            report(results)
            results["ops"] = op_level(args, alone.group_name)
        dist.barrier()
    if dist.get_rank() == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
