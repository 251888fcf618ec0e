"""Sharded data parallelism (SMP v1's sharded_data_parallel_degree, on FSDP2): smp against torch FSDP2
used directly, measured in the same run; and the bytes per parameter a rank holds.

    python benchmarks/sdp.py [--parts speed,memory] [--sdp 2] [--bf16] [--steps 20] [--no-clip]
        [--peer-prefetch N] [--mem-sdp 2,4] [--no-mem-peer] [--threshold N] [--json FILE]

(with the package installed, or PYTHONPATH=python from the repository root). Ranks are real CPU
processes started by tests/python/harness.py `run_ranks` (the default group on smp's "smp" backend,
which wraps gloo), one intra-op thread each.

The model is Hugging Face's GPT2LMHeadModel built from a GPT2Config (random weights, no download,
dropout 0, eager attention, the head tied to the token embedding); the loss is next-token cross
entropy on the logits (in fp32), computed outside the model.

Speed (one launch of --sdp processes, world = sdp). Three contestants train their own copy of the
same model (same seed, same initial weights), each rank on its own batch, the same for every
contestant, with torch.optim.Adam (torch's default implementation for CPU tensors: the for-loop):

  smp          smp.init({"sharded_data_parallel_degree": N, "ddp": True, "bf16": --bf16,
               "sdp_gradient_clipping": 1.0, or 0 with --no-clip}), smp.DistributedModel,
               smp.DistributedOptimizer(Adam(model.parameters())), an @smp.step function calling
               model(ids) and model.backward(loss), then optimizer.step(): smp puts each GPT2Block and
               then the root under fully_shard over its sdp group, gathers the next layer explicitly
               while one runs, forward and backward (prefetch depth 1 where two layers fit its
               sdp_max_live_parameters, as at its default) and clips the gradients before the step. The speed
               model's layers (1.77 M parameters at n_embd 384) are above smp's default
               sdp_param_persistence_threshold (1e6): smp reshards them after their forward, as FSDP2's
               default does.
  peer         torch.distributed.fsdp.fully_shard on each GPT2Block, then on the root, over
               DeviceMesh.from_group(<a plain gloo group>) of the same N ranks, FSDP2's defaults
               (reshard_after_forward=True, its implicit one-layer backward prefetch; --peer-prefetch 1
               sets smp's explicit prefetch), with --bf16 MixedPrecisionPolicy(param_dtype=bf16,
               reduce_dtype=fp32) as smp's; loss.backward(), torch.nn.utils.clip_grad_norm_(parameters,
               1.0) on the DTensor gradients (none with --no-clip), Adam's step.
  peer-again   the same as peer, on a second gloo group: peer-again / peer is an A/A comparison, the
               noise floor of the method on this machine. A smp/peer ratio inside the A/A band is not
               distinguishable from 1.0.

A step is zero_grad + forward/backward + clip + optimizer step. After --warmup untimed steps of each,
every round runs one step of each contestant in rotating order, each started after a barrier; a
step lasts until its slower rank is done (max over ranks). Per contestant: the median over rounds,
the minimum (other load only adds time), the median time per phase; the ratios smp/peer and
peer-again/peer of the medians and the median of the per-round ratios (neighbours in time share the
machine's drifts). The losses are compared round by round: the contestants train the same model.

Memory (one launch per degree in --mem-sdp, world = sdp, fp32, Adam, smp's default sdp keys or
--threshold, one contestant per launch: smp, and FSDP2 used directly as above unless --no-mem-peer).
After each step each rank counts what it holds for the model, per term, in bytes per parameter of
the whole model:
  parameters   its shards (DTensor.to_local()) of every parameter (tied ones once),
  gradients    its shards of their gradients (after the step, before the next zero_grad),
  optimizer    the local tensors of Adam's state (exp_avg, exp_avg_sq; the step counters),
  other        every other tensor storage alive in the process (found through the garbage
               collector): what FSDP2 or smp keep between steps beyond the above.
The floor is (4 + 4 + 8) / sdp: fp32 parameter, fp32 gradient, Adam's two fp32 moments, sharded.
Two peaks, the working set included (the gathered layers, the unsharded gradients of a layer before
their reduce-scatter, the collectives' buffers, the activations):
  peak tensors  one more step under torch.profiler(profile_memory=True), after zero_grad: the tensors
                alive before it plus the most bytes its allocations held at once (the CPU allocator's
                running total in the profiler's allocation events; FSDP2 and smp run the step on the
                calling thread on CPU), and the operators running at that moment;
  peak RSS      the process's peak resident set size over steps 2..--mem-steps (the kernel's VmHWM,
                reset by writing 5 to /proc/self/clear_refs after step 1) less what it holds besides
                tensors (its resident set after the last step less every live tensor storage), with
                glibc told to map each block of 64 KiB or more on its own (benchmarks/memory_per_param.py's
                method), so freed tensors leave the resident set at once. The two agree when nothing but
                tensors grows during a step.
And the activations of that step: the storages autograd saved for the backward (a saved-tensors
hook; gathered parameters, leaves that require grad, excluded). The memory model defaults to 8
layers of 3.15 M parameters (n_embd 512), above smp's default sdp_param_persistence_threshold (1e6),
so every GPT2Block is resharded after its forward; the root unit (embeddings, final norm; 0.6 M
parameters) stays gathered from its forward to its backward, as FSDP2 does for a root anyway.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests", "python"), os.path.join(HERE, "..", "python")]

LR = 1e-4
CONTESTANTS = ("smp", "peer", "peer-again")
PHASES = ("forward", "backward", "optimizer", "other")


# --- the model ----------------------------------------------------------------------------------


def build(layers: int, dim: int, heads: int, seq: int, vocab: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers,
        n_embd=dim,
        n_head=heads,
        n_positions=seq,
        vocab_size=vocab,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # HF's fallback, named: its warning_once breaks torch.compile's graph
    return model


def lm_loss(logits, ids):
    """Next-token cross entropy, in fp32."""
    import torch.nn.functional as F

    logits = logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def batch(step: int, rank: int, rows: int, seq: int, vocab: int):
    """Rank `rank`'s batch of round `step` (every contestant reads the same)."""
    import torch

    g = torch.Generator().manual_seed(1000 + 7 * step + rank)
    return torch.randint(0, vocab, (rows, seq), generator=g)


def smp_config(sdp: int, bf16: bool, clip: float, extra: dict | None = None) -> dict:
    return {
        "sharded_data_parallel_degree": sdp,
        "ddp": True,
        "bf16": bf16,
        "sdp_gradient_clipping": clip,
        **(extra or {}),
    }


# --- contestants: run(ids) -> (loss, {phase: seconds}) ------------------------------------------


class SmpContestant:
    def __init__(self, gpt):
        import smp
        import torch

        self.model = smp.DistributedModel(gpt)
        self.opt = smp.DistributedOptimizer(torch.optim.Adam(self.model.parameters(), lr=LR))
        model, marks = self.model, []
        self.marks = marks

        @smp.step
        def train_step(ids):
            marks.append(time.perf_counter())
            loss = lm_loss(model(ids).logits, ids)
            marks.append(time.perf_counter())
            model.backward(loss)
            marks.append(time.perf_counter())
            return loss

        self.train_step = train_step

    def parameters(self):
        return self.model.get_module().parameters()

    def optimizer(self):
        return self.opt.optimizer

    def zero_grad(self):
        self.opt.zero_grad()

    def __call__(self, ids):
        self.opt.zero_grad()
        self.marks.clear()
        loss = self.train_step(ids).reduce_mean()
        before = time.perf_counter()
        self.opt.step()  # smp clips (sdp_gradient_clipping) inside
        end = time.perf_counter()
        m = self.marks
        return loss.item(), {"forward": m[1] - m[0], "backward": m[2] - m[1], "optimizer": end - before}


class PeerContestant:
    """FSDP2 used directly: fully_shard on each GPT2Block, then the root."""

    def __init__(self, gpt, group, bf16: bool, clip: float, prefetch: int = 0):
        import torch
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32
        )
        for block in gpt.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(gpt, mesh=mesh, mp_policy=policy)
        blocks = list(gpt.transformer.h)
        for i, block in enumerate(blocks[:-1] if prefetch else ()):  # as smp.sharded_data._prefetch
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + prefetch])
        for i, block in enumerate(blocks[1:] if prefetch else (), start=1):
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch) : i][::-1])
        self.gpt, self.clip = gpt, clip
        self.opt = torch.optim.Adam(gpt.parameters(), lr=LR)

    def parameters(self):
        return self.gpt.parameters()

    def optimizer(self):
        return self.opt

    def zero_grad(self):
        self.opt.zero_grad()

    def __call__(self, ids):
        import torch

        self.opt.zero_grad()
        t0 = time.perf_counter()
        loss = lm_loss(self.gpt(ids).logits, ids)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.gpt.parameters(), self.clip)
        self.opt.step()
        t3 = time.perf_counter()
        return loss.item(), {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2}


# --- counting what a rank holds -----------------------------------------------------------------


def local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def unique(tensors) -> list:
    return list({id(t): t for t in tensors}.values())


def nbytes(tensors) -> int:
    """Bytes of each tensor's own elements (this rank's shard of a DTensor), each storage once."""
    seen, total = set(), 0
    for t in tensors:
        t = local(t)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def held(contestant) -> dict:
    """What this rank holds for the model after a step (before the next zero_grad), in bytes."""
    import torch

    params = unique(contestant.parameters())
    opt = contestant.optimizer()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": nbytes(params),
        "gradients": nbytes(p.grad for p in params if p.grad is not None),
        "optimizer": nbytes(state),
    }


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable from Python now, each once (a DTensor through its
    local tensor)."""
    import gc

    import torch
    from torch.distributed.tensor import DTensor

    storages = {}
    for o in gc.get_objects():
        kind = type(o)  # (isinstance would read __class__, which some module proxies warn on)
        if not issubclass(kind, torch.Tensor) or issubclass(kind, DTensor) or o.is_meta:
            continue
        try:
            st = o.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        except RuntimeError:  # a tensor without data (fake, functional)
            pass
    return sum(n for p, n in storages.items() if p)


def tensor_peak(step) -> tuple[int, str]:
    """Runs step() under torch.profiler with memory recording: the most bytes of tensors allocated
    (and not yet freed) since it started, at any moment of it, on this thread (smp and FSDP2 run the
    step on the caller's thread on CPU), and the operators running at that moment (outermost first)."""
    import torch
    from torch._C._profiler import _EventType

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        step()
    best, where = 0, ""

    def walk(events):
        nonlocal best, where
        for e in events:
            if e.tag == _EventType.Allocation and e.extra_fields.total_allocated > best:
                best = e.extra_fields.total_allocated
                names, up = [], e.parent
                while up is not None:
                    names.append(up.name)
                    up = up.parent
                where = " > ".join(reversed(names))
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    return best, where


# --- speed --------------------------------------------------------------------------------------


def speed_rank(rank: int, world: int, a: dict) -> dict:
    import smp
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the processes share the machine's cores
    clip = 0.0 if a["no_clip"] else 1.0
    smp.init(smp_config(world, a["bf16"], clip))
    plain, plain_again = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    gpt = build(a["layers"], a["dim"], a["heads"], a["seq"], a["vocab"])
    parameters = sum(p.numel() for p in gpt.parameters())
    peer_gpt, again_gpt = copy.deepcopy(gpt), copy.deepcopy(gpt)
    runs = {
        "smp": SmpContestant(gpt),
        "peer": PeerContestant(peer_gpt, plain, a["bf16"], clip, a["peer_prefetch"]),
        "peer-again": PeerContestant(again_gpt, plain_again, a["bf16"], clip, a["peer_prefetch"]),
    }

    def ids(step):
        return batch(step, rank, a["batch"], a["seq"], a["vocab"])

    load = [os.getloadavg()[0]]
    for name in CONTESTANTS:
        for i in range(a["warmup"]):
            runs[name](ids(-1 - i))
    mine = {name: {"seconds": [], "losses": [], "phases": []} for name in CONTESTANTS}
    for step in range(a["steps"]):
        k = step % len(CONTESTANTS)
        for name in CONTESTANTS[k:] + CONTESTANTS[:k]:
            dist.barrier(group=plain)
            start = time.perf_counter()
            loss, phases = runs[name](ids(step))
            seconds = time.perf_counter() - start
            phases["other"] = seconds - sum(phases.values())  # zero_grad, smp's step machinery
            mine[name]["seconds"].append(seconds)
            mine[name]["losses"].append(loss)
            mine[name]["phases"].append(phases)
    load.append(os.getloadavg()[0])
    mine["memory"] = {name: held(runs[name]) for name in ("smp", "peer")}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine, group=plain)
    if rank != 0:
        return {}
    samples = {
        name: [max(s) for s in zip(*(r[name]["seconds"] for r in ranks), strict=True)] for name in CONTESTANTS
    }
    median = {name: statistics.median(v) for name, v in samples.items()}

    def paired(x, y):
        return statistics.median(p / q for p, q in zip(samples[x], samples[y], strict=True))

    return {
        "config": a,
        "torch": torch.__version__,
        "parameters": parameters,
        "median_s": median,
        "min_s": {name: min(v) for name, v in samples.items()},
        "ratio": median["smp"] / median["peer"],
        "ratio_paired": paired("smp", "peer"),
        "aa": median["peer-again"] / median["peer"],
        "aa_paired": paired("peer-again", "peer"),
        "phases_s": {
            name: {
                phase: statistics.median(p[phase] for r in ranks for p in r[name]["phases"])
                for phase in PHASES
            }
            for name in CONTESTANTS
        },
        "loss_gap": {
            f"{name}_vs_peer": max(
                abs(x - y) / abs(y)
                for r in ranks
                for x, y in zip(r[name]["losses"], r["peer"]["losses"], strict=True)
            )
            for name in ("smp", "peer-again")
        },
        "memory": [r["memory"] for r in ranks],
        "samples": samples,
        "load_average": load,
    }


def report_speed(r: dict) -> None:
    c = r["config"]
    dtype = "bf16 compute over fp32 shards" if c["bf16"] else "fp32"
    clip = "no clipping (sdp_gradient_clipping 0)" if c["no_clip"] else "both clip at 1.0"
    print(
        f"\n## Speed: GPT2LMHeadModel n_layer {c['layers']} n_embd {c['dim']} n_head {c['heads']} "
        f"seq {c['seq']} vocab {c['vocab']} ({r['parameters'] / 1e6:.2f} M parameters), batch {c['batch']} "
        f"per rank, sdp {c['world']} (world {c['world']}), Adam, {dtype}, {clip}, {c['warmup']} warm-up "
        f"steps, {c['steps']} rounds, torch {r['torch']}"
    )
    labels = {
        "smp": "smp (sharded_data_parallel_degree)",
        "peer": "peer (fully_shard, gloo)",
        "peer-again": "peer-again (the same, A/A)",
    }
    print(f"{'step time, ms':<36} {'median':>7} {'min':>7} | {'fwd':>6} {'bwd':>6} {'opt':>6} {'other':>6}")
    for name, label in labels.items():
        ph = [r["phases_s"][name][phase] * 1e3 for phase in PHASES]
        print(
            f"{label:<36} {r['median_s'][name] * 1e3:>7.1f} {r['min_s'][name] * 1e3:>7.1f} | "
            + " ".join(f"{x:>6.1f}" for x in ph)
        )
    print(
        "(step: the slower rank's; phases, medians over ranks and rounds: fwd model call + loss, bwd "
        "backward, opt clip + Adam step, other zero_grad and smp's step machinery)"
    )
    low = r["min_s"]
    print(
        f"smp/peer (target <= 1.05): medians {r['ratio']:.3f}, minima {low['smp'] / low['peer']:.3f}, "
        f"median of per-round ratios {r['ratio_paired']:.3f}"
    )
    print(
        f"A/A peer-again/peer: medians {r['aa']:.3f}, minima {low['peer-again'] / low['peer']:.3f}, "
        f"median of per-round ratios {r['aa_paired']:.3f}"
    )
    gap = r["loss_gap"]
    ok = gap["smp_vs_peer"] <= 1e-4
    print(
        "max relative loss difference to the peer over the rounds: "
        + ", ".join(f"{k.replace('_vs_peer', '')} {g:.1e}" for k, g in gap.items())
        + (" (within 1e-4: the same model is trained)" if ok else " -- MISMATCH (> 1e-4)")
    )
    for name in ("smp", "peer"):
        worst = max(sum(m[name].values()) for m in r["memory"])
        print(
            f"counted per rank after a step, {name}: {worst / r['parameters']:.2f} bytes/parameter "
            + "("
            + ", ".join(
                f"{k} {max(m[name][k] for m in r['memory']) / r['parameters']:.2f}" for k in TERMS[:3]
            )
            + ")"
        )
    print("1-minute load average of the machine at start and end: {:.2f}, {:.2f}".format(*r["load_average"]))


# --- memory -------------------------------------------------------------------------------------

TERMS = ("parameters", "gradients", "optimizer", "other")


def memory_rank(rank: int, world: int, a: dict, who: str) -> dict:
    import smp
    import torch
    import torch.distributed as dist
    from memory_per_param import map_large_blocks, peak_bytes, reset_peak, rss_bytes

    map_large_blocks()
    torch.set_num_threads(1)
    extra = {"sdp_param_persistence_threshold": a["threshold"]} if a["threshold"] is not None else {}
    smp.init(smp_config(world, False, 1.0, extra))
    gpt = build(a["mem_layers"], a["mem_dim"], a["mem_heads"], a["seq"], a["vocab"])
    parameters = sum(p.numel() for p in gpt.parameters())
    if who == "smp":
        run = SmpContestant(gpt)
    else:
        run = PeerContestant(gpt, dist.new_group(backend="gloo"), False, 1.0)
    steps = []
    for step in range(a["mem_steps"]):
        run(batch(step, rank, a["mem_batch"], a["seq"], a["vocab"]))
        if step == 0:
            reset_peak()
        counted = held(run)
        counted["other"] = live_tensor_bytes() - sum(counted.values())
        steps.append(counted)
    peak_rss = peak_bytes() - (rss_bytes() - live_tensor_bytes())
    # One more step under the profiler, after zero_grad (so the gradients it frees are not counted):
    # the tensors alive before it plus the most allocated during it.
    run.zero_grad()
    before = live_tensor_bytes()
    saved: dict[int, int] = {}  # storage -> bytes of what autograd saves for the backward

    def pack(t):
        if not (t.is_leaf and t.requires_grad):  # not a (gathered) parameter: an activation
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = batch(a["mem_steps"], rank, a["mem_batch"], a["seq"], a["vocab"])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        extra, where = tensor_peak(lambda: run(ids))
    return {
        "rank": rank,
        "parameters": parameters,
        "steps": steps,
        "peak_rss": peak_rss,
        "peak_tensors": before + extra,
        "peak_where": where,
        "activations": sum(saved.values()),
    }


def report_memory(rows: list[dict]) -> None:
    print("\n## Memory: bytes per parameter of the whole model a rank holds (fp32, Adam)")
    print(
        "| contestant | sdp | parameters | params | grads | Adam state | other tensors | counted "
        "| floor (16/sdp) | peak tensors | peak RSS | activations |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        n = row["parameters"]
        last = [r["steps"][-1] for r in row["ranks"]]
        term = {k: max(m[k] for m in last) / n for k in TERMS}
        counted = max(sum(m[k] for k in TERMS[:3]) for m in last) / n
        peak = max(row["ranks"], key=lambda r: r["peak_tensors"])
        print(
            f"| {row['who']} | {row['sdp']} | {n / 1e6:.2f} M | "
            + " | ".join(f"{term[k]:.2f}" for k in TERMS)
            + f" | **{counted:.2f}** | {16 / row['sdp']:.2f} | {peak['peak_tensors'] / n:.2f} | "
            + f"{max(r['peak_rss'] for r in row['ranks']) / n:.2f} | "
            + f"{max(r['activations'] for r in row['ranks']) / n:.2f} |",
            flush=True,
        )
    print(
        "(max over ranks after the last step; counted = params + grads + Adam state; other = every "
        "other live tensor storage; peak tensors = the most tensor bytes alive at once during one step "
        "(torch.profiler's allocation record); peak RSS = the peak resident set over steps 2.. less the "
        "process's memory besides tensors; activations = the storages autograd saved for the backward "
        "in that step, gathered parameters excluded)"
    )
    for row in rows:
        peak = max(row["ranks"], key=lambda r: r["peak_tensors"])
        print(
            f"{row['who']} sdp {row['sdp']}: peak tensors on rank {peak['rank']} during: {peak['peak_where']}"
        )


# --- main ---------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="speed,memory", help="speed, memory or both (comma-separated)")
    p.add_argument("--sdp", type=int, default=2, help="speed: sharded_data_parallel_degree (= processes)")
    p.add_argument("--bf16", action="store_true", help="speed: bf16 compute (smp 'bf16', FSDP2 mp_policy)")
    p.add_argument(
        "--no-clip", action="store_true", help="speed: sdp_gradient_clipping 0, no clip in the peer"
    )
    p.add_argument("--steps", type=int, default=20, help="speed: timed rounds (one step of each contestant)")
    p.add_argument("--warmup", type=int, default=3, help="speed: untimed steps of each contestant first")
    p.add_argument("--batch", type=int, default=4, help="speed: sequences per rank and step")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument(
        "--peer-prefetch",
        type=int,
        default=0,
        help="speed: the peers prefetch this many layers explicitly, forward and backward, as smp does "
        "(1 at its default sdp_max_live_parameters); 0: FSDP2's defaults",
    )
    p.add_argument("--mem-sdp", default="2,4", help="memory: the degrees (= processes), comma-separated")
    p.add_argument(
        "--mem-peer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="memory: FSDP2 used directly too (one more launch per degree)",
    )
    p.add_argument("--mem-layers", type=int, default=8)
    p.add_argument("--mem-dim", type=int, default=512)
    p.add_argument("--mem-heads", type=int, default=8)
    p.add_argument("--mem-batch", type=int, default=2, help="memory: sequences per rank and step")
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="memory: sdp_param_persistence_threshold for smp (default: smp's, 1e6)",
    )
    p.add_argument("--json")
    args = p.parse_args()
    parts = {s.strip() for s in args.parts.split(",")}
    if args.warmup < 1:
        p.error("--warmup must be at least 1")

    import sdp
    from harness import run_ranks

    a = {k: v for k, v in vars(args).items() if k != "json"}
    a["world"] = args.sdp
    results: dict = {}
    if "speed" in parts:
        started = time.perf_counter()
        results["speed"] = run_ranks(sdp.speed_rank, args.sdp, a, timeout=900)[0]
        report_speed(results["speed"])
        print(f"(speed part: {time.perf_counter() - started:.0f} s)")
    if "memory" in parts:
        rows = []
        started = time.perf_counter()
        for degree in (int(d) for d in args.mem_sdp.split(",")):
            for who in ("smp", "peer") if args.mem_peer else ("smp",):
                ranks = run_ranks(sdp.memory_rank, degree, a, who, timeout=900)
                rows.append({"who": who, "sdp": degree, "parameters": ranks[0]["parameters"], "ranks": ranks})
        report_memory(rows)
        print(f"(memory part: {time.perf_counter() - started:.0f} s)")
        results["memory"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
