"""Sharded optimizer state (ZeRO-1): smp against torch's ZeroRedundancyOptimizer, measured in the same run.

    torchrun --standalone --nproc_per_node=2 benchmarks/optimizer.py [--steps 20] [--json FILE]
        [--profile] [--only smp|peer] [--zero-bucket-view] [--ddp-grad-bucket-view]

(with the package installed, or PYTHONPATH=python from the repository root)

Two processes, data parallel (one reduced-data-parallel group of two), Adam. Each contestant
trains its own copy of the same GPT (tests/python/models.py, same seed, same initial weights), each
rank on its own batch, the same for every contestant:

  smp     smp.init({"shard_optimizer_state": True}), smp.DistributedModel,
          smp.DistributedOptimizer(torch.optim.Adam(model.parameters())), an @smp.step function
          calling model(ids), lm_loss and model.backward(loss). Its default group is on smp's "smp"
          backend (which wraps gloo). The parameters are views of one flat buffer, their grads views
          of another, all-reduced in place in buckets during the backward; Adam steps this rank's
          chunk of the flat buffer (a view, its grad a view too), and each rank broadcasts its chunk
          into the others' flat buffers, in place.
  peer    torch.nn.parallel.DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer
          (optimizer_class=torch.optim.Adam, default options) on a plain "gloo" group created in the
          same processes (process_group= to both): DDP all-reduces the gradients in buckets during
          the backward; ZeRO assigns each parameter to one rank (greedily, balancing sizes), each rank
          steps its own parameters with Adam, then every parameter is broadcast from its owner.
  single  each process trains the whole model alone on both ranks' batches (no communication), a
          plain torch.optim.Adam, while the other process does the same: the unsharded reference.

A step is zero_grad + forward/backward + optimizer step. After warm-up, every round runs one step of
each contestant in rotating order, each started after a barrier; a data-parallel step lasts until
its slower rank is done (max over ranks). Per contestant: the median over rounds, the minimum (other
load only adds time), the median of the per-round ratios smp/peer (neighbours in time share the
machine's drifts), the median time per phase and the median minor page faults per step. The losses
are compared: smp's and the peer's on each rank, and the mean over ranks against the single
process's loss of the same global batch; after the rounds, the parameters too.

Memory, per rank, counted from the tensors each contestant holds after a step (before the next
zero_grad): parameters, optimizer state (every tensor in the optimizer's state), smp's fp32 master
chunks (the parameters its inner optimizer steps) and their grads, the parameters' grads, and DDP's
bucket buffers. With --profile, one more step of smp and of the peer runs under torch.profiler
(all threads): the top operators by self time. --only NAME trains that contestant alone (nothing
else built, one launch per contestant) and follows the process's resident set size: after building,
after each step, and its peak.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import resource
import statistics
import sys
import time

import smp
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from models import GPT, lm_loss  # noqa: E402

LR = 1e-4
CONTESTANTS = ("smp", "peer", "single")
PHASES = ("forward", "backward", "grad_wait", "copy_in", "adam", "param_sync", "other")


def batch(step: int, rank: int, args) -> torch.Tensor:
    """Rank `rank`'s batch of round `step` (every contestant reads the same)."""
    g = torch.Generator().manual_seed(1000 + 7 * step + rank)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


def global_batch(step: int, args) -> torch.Tensor:
    return torch.cat([batch(step, r, args) for r in range(dist.get_world_size())])


def minor_faults() -> int:
    """Minor page faults of this process so far (every thread)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Phases:
    """Accumulates the time spent, and the page faults taken, in the phases of one step."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.seconds: dict[str, float] = {}
        self.faults: dict[str, int] = {}

    def wrap(self, obj, attribute: str, phase: str) -> None:
        """Times obj.attribute (a method) under `phase` from now on (an instance attribute)."""
        inner = getattr(obj, attribute)

        @functools.wraps(inner)
        def timed(*a, **kw):
            with self.timing(phase):
                return inner(*a, **kw)

        setattr(obj, attribute, timed)

    @contextlib.contextmanager
    def timing(self, phase: str):
        faults, start = minor_faults(), time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
            self.faults[phase] = self.faults.get(phase, 0) + minor_faults() - faults


# --- contestants: run(ids) -> loss; each has its Phases -------------------------------------------


class SmpContestant:
    def __init__(self, gpt: GPT):
        self.phases = Phases()
        self.model = smp.DistributedModel(gpt)
        self.opt = smp.DistributedOptimizer(torch.optim.Adam(self.model.parameters(), lr=LR))
        model, phases = self.model, self.phases

        @smp.step
        def train_step(ids):
            with phases.timing("forward"):
                loss = lm_loss(model(ids), ids)
            with phases.timing("backward"):
                model.backward(loss)
            return loss

        self.train_step = train_step

    def instrument(self) -> None:
        """After the first step (which builds the flat state): time its parts."""
        self.phases.wrap(self.model.engine.grad_sync, "finish_step", "grad_wait")
        flat = self.opt.flat_state
        assert flat is not None, "smp did not build its flat state: is shard_optimizer_state on?"
        self.phases.wrap(flat, "load_grads", "copy_in")
        self.phases.wrap(self.opt.optimizer, "step", "adam")
        self.phases.wrap(flat, "publish", "param_sync")

    def __call__(self, ids) -> float:
        self.opt.zero_grad()
        loss = self.train_step(ids).reduce_mean()
        self.opt.step()
        return loss.item()

    def memory(self) -> dict:
        params = unique(self.model.get_module().parameters())
        inner = unique(p for g in self.opt.optimizer.param_groups for p in g["params"])
        # The chunks the inner optimizer steps count as master copies unless they are views of the
        # parameters' storage (fp32), and their grads likewise.
        param_storage = {storage(p) for p in params}
        grad_storage = {storage(p.grad) for p in params if p.grad is not None}
        master = [p for p in inner if storage(p) not in param_storage]
        master_grads = [p.grad for p in inner if p.grad is not None and storage(p.grad) not in grad_storage]
        return {
            "parameters": nbytes(params),
            "optimizer_state": state_bytes(self.opt.optimizer),
            "master": nbytes(master),
            "master_grads": nbytes(master_grads),
            "grads": nbytes(p.grad for p in params if p.grad is not None),
            "ddp_buckets": 0,
        }


class PeerContestant:
    def __init__(self, gpt: GPT, group, args):
        self.phases = Phases()
        self.ddp = DistributedDataParallel(
            gpt, process_group=group, gradient_as_bucket_view=args.ddp_grad_bucket_view
        )
        self.opt = ZeroRedundancyOptimizer(
            self.ddp.parameters(),
            optimizer_class=torch.optim.Adam,
            process_group=group,
            parameters_as_bucket_view=args.zero_bucket_view,
            lr=LR,
        )

    def instrument(self) -> None:
        self.phases.wrap(self.opt, "_local_step", "adam")
        self.phases.wrap(self.opt, "_sync_params", "param_sync")

    def __call__(self, ids) -> float:
        self.opt.zero_grad()
        with self.phases.timing("forward"):
            loss = lm_loss(self.ddp(ids), ids)
        with self.phases.timing("backward"):
            loss.backward()  # DDP's all-reduce finishes inside
        self.opt.step()
        return loss.item()

    def memory(self) -> dict:
        params = unique(self.ddp.module.parameters())
        sizes = str(self.ddp._get_ddp_logging_data().get("bucket_sizes", ""))
        view = self.ddp.gradient_as_bucket_view
        return {
            "parameters": nbytes(params),
            "optimizer_state": state_bytes(self.opt.optim),
            "master": 0,
            "master_grads": 0,
            "grads": nbytes(p.grad for p in params if p.grad is not None),
            # With gradient_as_bucket_view the grads are views of the buckets: count them once.
            "ddp_buckets": 0 if view else sum(int(s) for s in sizes.split(",") if s.strip()),
        }


class SingleContestant:
    """The whole model and the global batch in one process, plain Adam."""

    def __init__(self, gpt: GPT):
        self.phases = Phases()
        self.gpt = gpt
        self.opt = torch.optim.Adam(gpt.parameters(), lr=LR)

    def instrument(self) -> None:
        self.phases.wrap(self.opt, "step", "adam")

    def __call__(self, ids) -> float:
        self.opt.zero_grad()
        with self.phases.timing("forward"):
            loss = lm_loss(self.gpt(ids), ids)
        with self.phases.timing("backward"):
            loss.backward()
        self.opt.step()
        return loss.item()

    def memory(self) -> dict:
        params = unique(self.gpt.parameters())
        return {
            "parameters": nbytes(params),
            "optimizer_state": state_bytes(self.opt),
            "master": 0,
            "master_grads": 0,
            "grads": nbytes(p.grad for p in params if p.grad is not None),
            "ddp_buckets": 0,
        }


def unique(tensors) -> list[torch.Tensor]:
    return list({id(t): t for t in tensors}.values())


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in unique(tensors))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return nbytes(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))


# --- measurement --------------------------------------------------------------------------------


def timed(run, ids, group) -> tuple[float, float, dict, int, dict]:
    """One step of `run`, started together on both ranks: its seconds, loss and phase times, and
    the minor page faults of the process during it, in all and per phase."""
    run.phases.clear()
    dist.barrier(group=group)
    faults, start = minor_faults(), time.perf_counter()
    loss = run(ids)
    seconds, faults = time.perf_counter() - start, minor_faults() - faults
    phases, phase_faults = dict(run.phases.seconds), dict(run.phases.faults)
    phases["other"] = seconds - sum(phases.values())
    phase_faults["other"] = faults - sum(phase_faults.values())
    return seconds, loss, phases, faults, phase_faults


def inputs(name: str, step: int, args) -> torch.Tensor:
    return global_batch(step, args) if name == "single" else batch(step, dist.get_rank(), args)


def profile_step(run, ids, group) -> str:
    """One step under torch.profiler (every thread: smp's step runs on a microbatch thread)."""
    from torch._C._profiler import _ExperimentalConfig

    dist.barrier(group=group)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        experimental_config=_ExperimentalConfig(profile_all_threads=True),
    ) as prof:
        run(ids)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50)


def max_abs_gap(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """The largest difference of one parameter between two copies of one model."""
    pairs = zip(model.state_dict().values(), reference.state_dict().values(), strict=True)
    return max(float((a - b).abs().max()) for a, b in pairs)


def smp_config(args) -> dict:
    """smp's config: sharded state, and with --shard-gradients the gradients too (ZeRO-2)."""
    return {"shard_optimizer_state": True, "shard_gradients": bool(args.shard_gradients)}


def build(args) -> GPT:
    torch.manual_seed(0)
    return GPT(args.vocab, args.dim, args.heads, args.layers, args.seq)


def measure(args) -> dict | None:
    torch.set_num_threads(1)  # two processes share the machine's cores
    smp.init(smp_config(args))
    if smp.size() != 2 or smp.rdp_size() != 2:
        sys.exit("run with torchrun --nproc_per_node=2: data parallel over two processes")
    gloo = dist.new_group(backend="gloo")
    gpt = build(args)
    peer_gpt, single_gpt = copy.deepcopy(gpt), copy.deepcopy(gpt)
    runs = {
        "smp": SmpContestant(gpt),
        "peer": PeerContestant(peer_gpt, gloo, args),
        "single": SingleContestant(single_gpt),
    }
    load = [os.getloadavg()[0]]
    for name in CONTESTANTS:
        for i in range(args.warmup):
            runs[name](inputs(name, -1 - i, args))
        runs[name].instrument()

    mine = {
        name: {"seconds": [], "losses": [], "phases": [], "faults": [], "phase_faults": []}
        for name in CONTESTANTS
    }
    for step in range(args.steps):
        k = step % len(CONTESTANTS)
        for name in CONTESTANTS[k:] + CONTESTANTS[:k]:
            seconds, loss, phases, faults, phase_faults = timed(runs[name], inputs(name, step, args), gloo)
            mine[name]["faults"].append(faults)
            mine[name]["phase_faults"].append(phase_faults)
            mine[name]["seconds"].append(seconds)
            mine[name]["losses"].append(loss)
            mine[name]["phases"].append(phases)
    load.append(os.getloadavg()[0])
    mine["memory"] = {name: runs[name].memory() for name in CONTESTANTS}
    models = {
        "smp": runs["smp"].model.get_module(),
        "peer": runs["peer"].ddp.module,
        "single": runs["single"].gpt,
    }
    mine["param_gap"] = {
        f"{a}_vs_{b}": max_abs_gap(models[a], models[b])
        for a, b in (("smp", "peer"), ("smp", "single"), ("peer", "single"))
    }
    if args.profile:  # not timed; these steps train on with a batch of their own
        mine["profile"] = {
            name: profile_step(runs[name], inputs(name, 10**6, args), gloo) for name in ("smp", "peer")
        }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine, group=gloo)
    if dist.get_rank() != 0:
        return None

    samples = {
        name: [max(s) for s in zip(*(r[name]["seconds"] for r in ranks), strict=True)]
        for name in ("smp", "peer")
    }
    samples["single"] = [s for r in ranks for s in r["single"]["seconds"]]  # independent samples
    phases = {
        name: {
            phase: statistics.median(p.get(phase, 0.0) for r in ranks for p in r[name]["phases"])
            for phase in PHASES
        }
        for name in CONTESTANTS
    }
    # The data-parallel loss of a step is the mean of the ranks' (equal-sized) batches' losses.
    losses = {
        name: [statistics.fmean(x) for x in zip(*(r[name]["losses"] for r in ranks), strict=True)]
        for name in ("smp", "peer")
    }
    losses["single"] = ranks[0]["single"]["losses"]
    loss_gap = {
        "smp_vs_peer": max(
            abs(a - b) / abs(b)
            for r in ranks
            for a, b in zip(r["smp"]["losses"], r["peer"]["losses"], strict=True)
        ),
        **{
            f"{name}_vs_single": max(
                abs(a - b) / abs(b) for a, b in zip(losses[name], losses["single"], strict=True)
            )
            for name in ("smp", "peer")
        },
    }
    median = {name: statistics.median(v) for name, v in samples.items()}
    memory = [r["memory"] for r in ranks]
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "torch": torch.__version__,
        "parameters": sum(p.numel() for p in single_gpt.parameters()),
        "median_s": median,
        "min_s": {name: min(v) for name, v in samples.items()},
        "ratio": median["smp"] / median["peer"],
        "ratio_paired": statistics.median(
            a / b for a, b in zip(samples["smp"], samples["peer"], strict=True)
        ),
        "phases_s": phases,
        "page_faults": {
            name: statistics.median(f for r in ranks for f in r[name]["faults"]) for name in CONTESTANTS
        },
        "page_faults_by_phase": {
            name: {
                phase: statistics.median(p.get(phase, 0) for r in ranks for p in r[name]["phase_faults"])
                for phase in PHASES
            }
            for name in CONTESTANTS
        },
        "memory": memory,
        "samples": samples,
        "losses": losses,
        "loss_gap": loss_gap,
        "param_gap": {k: max(r["param_gap"][k] for r in ranks) for k in ranks[0]["param_gap"]},
        "load_average": load,
    }
    if args.profile:
        result["profile"] = [r["profile"] for r in ranks]
    return result


def headline(m: dict) -> int:
    """Parameters + optimizer state + fp32 master chunks: what a rank keeps of model and optimizer."""
    return m["parameters"] + m["optimizer_state"] + m["master"]


def footprint(m: dict) -> int:
    """Everything counted at the end of a step: the above, grads, master grads, DDP's buckets."""
    return headline(m) + m["grads"] + m["master_grads"] + m["ddp_buckets"]


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def report(r: dict) -> None:
    c = r["config"]
    print(
        f"GPT vocab {c['vocab']} dim {c['dim']} heads {c['heads']} layers {c['layers']} seq {c['seq']} "
        f"({r['parameters'] / 1e6:.2f} M parameters), batch {c['batch']} per rank, 2 ranks (rdp 2), "
        f"Adam, fp32, {c['steps']} rounds, torch {r['torch']}"
    )
    options = [
        o
        for o, on in (
            ("parameters_as_bucket_view", c["zero_bucket_view"]),
            ("gradient_as_bucket_view", c["ddp_grad_bucket_view"]),
        )
        if on
    ]
    labels = {
        "smp": "smp (shard_optimizer_state)",
        "peer": "peer (DDP + ZeroRedundancyOptimizer, gloo)",
        "single": "single (one process, both batches)",
    }
    if options:
        print(f"peer options: {', '.join(options)}")
    short = ("fwd", "bwd", "wait", "copy", "adam", "sync", "other")
    print(
        f"{'step time, ms':<44} {'median':>7} {'min':>7} | "
        + " ".join(f"{s:>6}" for s in short)
        + f" | {'faults':>6}"
    )
    for name, label in labels.items():
        ph = [r["phases_s"][name][phase] * 1e3 for phase in PHASES]
        print(
            f"{label:<44} {r['median_s'][name] * 1e3:>7.1f} {r['min_s'][name] * 1e3:>7.1f} | "
            + " ".join(f"{x:>6.1f}" for x in ph)
            + f" | {r['page_faults'][name]:>6.0f}"
        )
    print(
        "(medians per phase: fwd model call + loss; bwd backward, DDP's all-reduce wait inside; wait "
        "smp's wait for its gradient all-reduce after the backward; copy smp's load_grads (its chunk's "
        "gradient); adam the inner optimizer's step; sync smp's broadcasts / ZeRO's; other the "
        "rest. faults: median minor page faults per step and rank)"
    )
    print(
        "median page faults per phase, smp: "
        + ", ".join(
            f"{s} {r['page_faults_by_phase']['smp'][p]:.0f}" for s, p in zip(short, PHASES, strict=True)
        )
    )
    low = r["min_s"]
    print(
        f"smp/peer (target <= 1.0): medians {r['ratio']:.3f}, minima {low['smp'] / low['peer']:.3f}, "
        f"median of per-round ratios {r['ratio_paired']:.3f}"
    )
    print("memory per rank, MiB (counted tensors after a step):")
    cols = ("parameters", "optimizer_state", "master", "grads", "master_grads", "ddp_buckets")
    print(
        f"{'':<10} {'rank':>4} "
        + " ".join(f"{x:>15}" for x in cols)
        + f" {'params+state+master':>19} {'all':>8}"
    )
    for name in CONTESTANTS:
        for rank, m in enumerate(r["memory"]):
            mm = m[name]
            print(
                f"{name:<10} {rank:>4} "
                + " ".join(f"{mib(mm[x]):>15}" for x in cols)
                + f" {mib(headline(mm)):>19} {mib(footprint(mm)):>8}"
            )
    worst = {name: max(headline(m[name]) for m in r["memory"]) for name in CONTESTANTS}
    worst_all = {name: max(footprint(m[name]) for m in r["memory"]) for name in CONTESTANTS}
    print(
        f"memory ratio smp/peer (target <= 1.0), larger rank: params+state+master "
        f"{worst['smp'] / worst['peer']:.3f}, all counted {worst_all['smp'] / worst_all['peer']:.3f}"
    )
    if "profile" in r:
        for name in ("smp", "peer"):
            print(f"--- one {name} step under torch.profiler (all threads), rank 0, top ops by self CPU time")
            print(r["profile"][0][name])
    print("1-minute load average of the machine at start and end: {:.2f}, {:.2f}".format(*r["load_average"]))
    gap = r["loss_gap"]
    ok = max(gap.values()) <= 1e-5
    print(
        "max relative loss difference over the rounds: "
        + ", ".join(f"{k.replace('_', ' ')} {g:.1e}" for k, g in gap.items())
        + (" (all within 1e-5: the same model is trained)" if ok else " -- MISMATCH (> 1e-5)")
    )
    print(
        f"parameters after the rounds, largest difference (lr {LR:g}): "
        + ", ".join(f"{k.replace('_', ' ')} {g:.1e}" for k, g in r["param_gap"].items())
    )


def rss_mib() -> float:
    """The process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def only(args) -> dict | None:
    """Trains one contestant alone (nothing else built) and follows the process's RSS."""
    torch.set_num_threads(1)
    smp.init(smp_config(args))
    gloo = dist.new_group(backend="gloo")
    gpt = build(args)
    run = SmpContestant(gpt) if args.only == "smp" else PeerContestant(gpt, gloo, args)
    dist.barrier(group=gloo)
    built = rss_mib()
    after_step = []
    for step in range(args.warmup + args.steps):
        dist.barrier(group=gloo)
        run(batch(step, dist.get_rank(), args))
        after_step.append(rss_mib())
    mine = {
        "built_mib": built,
        "after_step_mib": after_step,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "memory": run.memory(),
    }
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine, group=gloo)
    if dist.get_rank() != 0:
        return None
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(
        f"{args.only} alone, {args.warmup + args.steps} steps"
        + (f", {' '.join(f'{k}={v}' for k, v in malloc.items())}" if malloc else "")
        + ": RSS in MiB"
    )
    for rank, row in enumerate(rows):
        late = row["after_step_mib"][len(row["after_step_mib"]) // 2 :]
        m = row["memory"]
        print(
            f"rank {rank}: after building {row['built_mib']:.0f}, after each step of the second half "
            f"median {statistics.median(late):.0f} (+{statistics.median(late) - row['built_mib']:.0f}), "
            f"peak {row['peak_mib']:.0f} (+{row['peak_mib'] - row['built_mib']:.0f}); counted tensors: "
            f"params+state+master {mib(headline(m))}, all {mib(footprint(m))}"
        )
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "malloc_env": malloc,
        "ranks": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (one step of each contestant)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each contestant first")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument(
        "--zero-bucket-view",
        action="store_true",
        help="peer: ZeroRedundancyOptimizer(parameters_as_bucket_view=True), one broadcast per rank",
    )
    parser.add_argument(
        "--ddp-grad-bucket-view",
        action="store_true",
        help="peer: DistributedDataParallel(gradient_as_bucket_view=True), grads are views of the buckets",
    )
    parser.add_argument("--profile", action="store_true", help="profile one more step of each")
    parser.add_argument(
        "--shard-gradients", action="store_true", help="smp keeps only its chunk of the gradients (ZeRO-2)"
    )
    parser.add_argument("--only", choices=("smp", "peer"), help="train one contestant alone; peak RSS")
    parser.add_argument("--json", help="rank 0 also writes the results to this file")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: smp builds its flat state on its first step")
    if "RANK" not in os.environ:
        sys.exit("launch with: torchrun --standalone --nproc_per_node=2 benchmarks/optimizer.py")
    if args.only:
        results = only(args)
    else:
        results = measure(args)
        if results is not None:
            report(results)
    if results is not None and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
