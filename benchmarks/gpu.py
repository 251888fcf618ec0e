"""GPU benchmark: smp against plain PyTorch on one GPU, MFU, checkpointing/offloading, all_reduce.

    python benchmarks/gpu.py [--part models|checkpointing|allreduce|all] [--shapes small,medium]
                             [--steps N] [--json FILE] [--quick] [--budget SECONDS] [--cpu-smoke]

Run by tests/gpu.sh on a machine with a CUDA GPU (issue 34, item 3). Every figure is a ratio against
a peer measured in the same run; nothing here is a test. Three parts:

models      Hugging Face GPT2LMHeadModel built from a GPT2Config (random weights, dropout 0, no
            download) at GPT-2-small (12 layers, 768, 12 heads) and GPT-2-medium (24, 1024, 16)
            shapes, seq 1024, vocab 50257. A step is zero_grad + forward + backward + AdamW step.
            smp runs @smp.step over a DistributedModel and a DistributedOptimizer at pp = tp = 1,
            1 microbatch, world size 1. Recipes, each eager and compiled (smp "compile": true,
            plain torch.compile):
              fp32: smp against plain fp32;
              bf16: smp "bf16": true (bf16 parameters, fp32 master weights in its optimizer) against
                    plain autocast(bf16) over fp32 weights (the same recipe) and against plain bf16
                    parameters (no master weights: less work).
            The contestants of a (shape, recipe, eager/compiled) share one process, the same initial
            weights and the same batches, and run in paired rounds: each round times `--block`
            consecutive steps of each contestant (synchronized before and after), in rotating
            order. tokens/s = all timed tokens / all timed seconds; smp / peer = median over rounds
            of the peer's round time / smp's (above 1: smp faster). MFU = tokens/s x (6N + 12 L s d)
            / the GPU's measured bf16 matmul peak (an 8192^3 bf16 torch.matmul, timed here).
            Targets: smp >= 0.98x plain at the same recipe; MFU >= 45% for GPT-2-medium bf16 compiled.
checkpointing
            The largest shape of --shapes, bf16, eager, one process: no checkpointing, then
            smp.set_activation_checkpointing on every transformer block (transformer.h, "each"),
            then that with "offload_activations": true, "activation_loading_horizon": H for H in
            1, 2, 4. Step time (median) and peak GPU memory (torch.cuda.max_memory_allocated,
            reset before the timed steps; "activations" is the peak minus what was allocated
            before the step: weights, master weights, optimizer state) against checkpointing
            alone. At pp = tp = 1 the model runs whole: offloading works there (the blocks' forwards
            are wrapped and their kept inputs go to pinned host memory), but each microbatch's
            backward follows its own forward at once, so the horizon (how many microbatches ahead
            the inputs come back) cannot change anything: the H rows are expected to be equal.
            The horizon matters in a pipeline (pp > 1), which this one-process benchmark does not run.
allreduce   2 processes (torch.multiprocessing, spawn) sharing the GPU when there is only one
            (each its own NCCL_HOSTID, with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, as tests/gpu.sh
            and smp.devices do), each with a default group on backend "smp" and two groups on
            "nccl" over the same store ("nccl" and "nccl-again": their ratio is the A/A noise floor).
            float32 all_reduce from 1 MiB to 256 MiB (powers of 4): per sample one synchronous call on
            each group in rotating order, each timed with CUDA synchronize; the median per group.
            Bus bandwidth = bytes x 2(n-1)/n / time (nccl-tests' definition).

Each job (one models configuration; the checkpointing part; the all_reduce part) runs in a process
of its own (see `run_job`), under a time limit. A job that fails is reported and the others still
run; the exit status is then 1. --budget (seconds, default 180; 0 for none) bounds the whole run:
the work goes in order of priority (eager models, then checkpointing, all_reduce, then the compiled
models, GPT-2-medium bf16 first) and what would not fit by its estimate is listed as skipped, with
the command that runs it. Compiling GPT-2 takes tens of seconds per contestant, so the full matrix
(`--budget 0`) takes about 12 minutes on one H100 (estimated).

Without a CUDA GPU it exits 77 and says so, unless --cpu-smoke: then the model part (or --part) runs
on the CPU at a tiny shape (2 layers, width 64, seq 64, vocab 256), compiled with the "aot_eager"
backend, to check the plumbing; no MFU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT = "@@gpu.py-result "  # a job's result lines on its stdout
SHAPES = {"small": (12, 768, 12), "medium": (24, 1024, 16)}  # layers, width, heads
BATCH = {"small": 8, "medium": 8}
SEQ = 1024
VOCAB = 50257
QUICK = {"layers": 2, "seq": 256, "batch": 4}  # --quick on a GPU: the shapes' width, 2 layers
TINY = {"layers": 2, "dim": 64, "heads": 4, "seq": 64, "batch": 2, "vocab": 256}  # --cpu-smoke
MIB = 1 << 20
ALLREDUCE_SIZES = [MIB * 4**i for i in range(5)]  # 1 MiB .. 256 MiB
KEEP_RATIO = 0.98  # smp >= 0.98x plain at the same recipe
MFU_TARGET = 0.45  # GPT-2-medium, bf16, compiled


# --- the model ------------------------------------------------------------------------------------


def make_model(spec: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=spec["layers"],
        n_embd=spec["dim"],
        n_head=spec["heads"],
        n_positions=spec["seq"],
        vocab_size=spec["vocab"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,  # training: no KV cache (a recomputed block must not append to one)
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(spec["device"]):
        model = GPT2LMHeadModel(config)
    # The loss HF picks anyway, named: unnamed, HF logs a warning_once from inside the forward on
    # every call, which torch.compile cannot trace (a graph break before the loss, both contestants).
    model.loss_type = "ForCausalLM"
    return model.train()


def flops_per_token(spec: dict, n_params: int) -> float:
    """6N + 12 L s d: the matmuls of forward and backward, attention's scores included."""
    return 6 * n_params + 12 * spec["layers"] * spec["seq"] * spec["dim"]


def batches(spec: dict, count: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shape = (spec["batch"], spec["seq"])
    return [torch.randint(0, spec["vocab"], shape, generator=gen).to(spec["device"]) for _ in range(count)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def compile_args(spec: dict):
    """smp's "compile" value and plain torch.compile's keyword arguments: inductor (aot_eager on
    the CPU smoke run: the plumbing, without inductor's C++ compile), with CUDA graphs
    (mode "reduce-overhead") in the cudagraphs mode."""
    plain = {"backend": spec.get("compile_backend") or "inductor"}
    if spec.get("cudagraphs"):
        plain["mode"] = "reduce-overhead"
    ours = dict(plain) if spec.get("compile_backend") or spec.get("cudagraphs") else True
    return ours, plain


def plain_contestant(model, spec: dict, autocast: bool):
    # The optimizer kernel smp's steps with: in bf16 smp's flat fp32 master takes torch's fused
    # AdamW (optimizer.py, where the user left the choice unset), so plain gets it too (its
    # default foreach AdamW took 7.8 ms of GPU time per GPT-2-medium step on the H200, fused 2.9);
    # in fp32 smp leaves torch's default, and so does plain.
    fused = spec["device"] == "cuda" and spec.get("recipe") == "bf16"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
    run = torch.compile(model, **compile_args(spec)[1]) if spec["compiled"] else model
    device = spec["device"]

    def step(ids):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.detach().clone()  # a CUDA graph's output is overwritten by its next replay

    return step


def smp_contestant(model, config: dict):
    import smp

    smp.init(config)
    dmodel = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(dmodel.parameters(), lr=1e-4))

    @smp.step
    def train(ids):
        loss = dmodel(input_ids=ids, labels=ids).loss
        dmodel.backward(loss)
        return loss.detach().clone()  # (as above)

    def step(ids):
        opt.zero_grad(set_to_none=True)
        loss = train(ids).reduce_mean()
        opt.step()
        return loss

    return step, dmodel, opt


# --- part 1: smp against plain PyTorch ------------------------------------------------------------


def models_job(spec: dict, emit) -> None:
    import smp

    device = spec["device"]
    reference = make_model(spec)
    n_params = sum(p.numel() for p in reference.parameters())
    contestants = {}
    smp_config = {"microbatches": 1}
    if spec["compiled"]:
        smp_config["compile"] = compile_args(spec)[0]
    if spec["recipe"] == "fp32":
        contestants["plain"] = plain_contestant(copy.deepcopy(reference), spec, autocast=False)
        peers = {"plain": "same recipe"}
    else:
        contestants["plain autocast"] = plain_contestant(copy.deepcopy(reference), spec, autocast=True)
        bf16 = copy.deepcopy(reference).to(torch.bfloat16)
        contestants["plain bf16 params"] = plain_contestant(bf16, spec, autocast=False)
        smp_config["bf16"] = True
        peers = {"plain autocast": "same recipe", "plain bf16 params": "no master weights"}
    contestants["smp"] = smp_contestant(reference, smp_config)[0]  # smp's model is the reference itself
    if spec.get("only"):  # --contestants: fewer compilations on a short lease
        contestants = {k: v for k, v in contestants.items() if k == "smp" or k in spec["only"]}
        peers = {k: v for k, v in peers.items() if k in contestants}
    data = batches(spec)
    names = list(contestants)
    first_step, losses = {}, {}
    for name in names:  # the first steps compile; each contestant's are timed alone
        for i in range(spec["warmup"]):
            sync(device)
            start = time.perf_counter()
            losses[name] = contestants[name](data[i % len(data)])
            sync(device)
            if i == 0:
                first_step[name] = time.perf_counter() - start
    rounds = max(1, math.ceil(spec["steps"] / spec["block"]))
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync(device)
            start = time.perf_counter()
            for i in range(spec["block"]):
                losses[name] = contestants[name](data[(r * spec["block"] + i) % len(data)])
            sync(device)
            times[name].append(time.perf_counter() - start)
    tokens = spec["batch"] * spec["seq"] * spec["block"]
    per_token = flops_per_token(spec, n_params)
    result = {
        "shape": spec["shape"],
        "recipe": spec["recipe"],
        "compiled": spec["compiled"],
        "cudagraphs": bool(spec.get("cudagraphs")),
        "layers": spec["layers"],
        "dim": spec["dim"],
        "seq": spec["seq"],
        "batch": spec["batch"],
        "vocab": spec["vocab"],
        "params": n_params,
        "flops_per_token": per_token,
        "rounds": rounds,
        "block": spec["block"],
        "contestants": {},
        "ratios": {},
        "smp_compilations": smp.engine.compiled.compiles(),
    }
    for name in names:
        tps = tokens * rounds / sum(times[name])
        result["contestants"][name] = {
            "step_ms": 1e3 * statistics.median(t / spec["block"] for t in times[name]),
            "tokens_per_s": tps,
            "tflops": tps * per_token / 1e12,
            "first_step_s": first_step[name],
            "loss": float(losses[name]),
        }
    for peer, why in peers.items():
        paired = [p / s for p, s in zip(times[peer], times["smp"], strict=True)]
        result["ratios"][peer] = {"paired": statistics.median(paired), "why": why}
    if spec.get("profile"):
        result["profiles"] = {name: profile_steps(contestants[name], data, device) for name in names}
    emit(result)


def profile_steps(step, data: list, device: str, steps: int = 3) -> dict:
    """torch.profiler over `steps` steps of one contestant: where a step's time goes on the GPU and
    the host. GPU busy = the union of kernel/memcpy/memset intervals against the wall time (below
    1: the GPU waited on the host); syncs = calls that wait for the GPU (item, synchronize)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for i in range(steps):
            step(data[i % len(data)])
        sync(device)
        wall = time.perf_counter() - start
    events = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, None
    for lo, hi in spans:
        if end is None or lo > end:
            busy += hi - lo
            end = hi
        elif hi > end:
            busy += hi - end
            end = hi
    table = prof.key_averages()
    gpu = sorted(table, key=lambda e: -e.self_device_time_total)[:15]
    cpu = sorted(table, key=lambda e: -e.self_cpu_time_total)[:15]
    watched = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize")
    watched += ("cudaEventSynchronize", "cudaMemcpyAsync", "cudaLaunchKernel", "cuLaunchKernel")
    counts = {e.key: e.count / steps for e in table if e.key in watched}

    def top(rows, attr):
        return [(e.key[:90], getattr(e, attr) / 1e3 / steps, e.count / steps) for e in rows]

    return {
        "wall_ms_per_step": 1e3 * wall / steps,
        "gpu_busy_ms_per_step": busy / 1e3 / steps,
        "gpu_kernels_per_step": len(spans) / steps,
        "calls_per_step": counts,
        "top_gpu_ms_per_step": top(gpu, "self_device_time_total"),
        "top_cpu_ms_per_step": top(cpu, "self_cpu_time_total"),
    }


# --- part 2: activation checkpointing and offloading ----------------------------------------------


CHECKPOINTING = [  # label, checkpoint the blocks, extra config
    ("no checkpointing", False, {}),
    ("checkpointing", True, {}),
    *[
        (f"+ offload, horizon {h}", True, {"offload_activations": True, "activation_loading_horizon": h})
        for h in (1, 2, 4)
    ],
]


def _checkpointing_run(spec: dict, data: list, checkpoint: bool, extra: dict) -> dict:
    """One configuration: its own smp.init and a model built afresh (freed when this returns)."""
    device = spec["device"]
    cuda = device == "cuda"
    step, dmodel, opt = smp_contestant(make_model(spec), {"microbatches": 1, "bf16": True, **extra})
    if checkpoint:
        import smp

        smp.set_activation_checkpointing(dmodel.get_module().transformer.h)
    for i in range(spec["warmup"]):
        step(data[i % len(data)])
    sync(device)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    base = torch.cuda.memory_allocated() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(spec["steps"]):
        sync(device)
        start = time.perf_counter()
        loss = step(data[i % len(data)])
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return {
        "step_ms": 1e3 * statistics.median(times),
        "peak_bytes": peak,
        "activation_bytes": None if peak is None else peak - base,
        "base_bytes": base,
        "loss": float(loss),
    }


def checkpointing_job(spec: dict, emit) -> None:
    """One process; smp.parallel_state.reset() between the configurations (each builds its model
    afresh): they differ only in smp's config keys and are eager, and reset() is how smp.init runs
    again in one process (the tests do it thousands of times)."""
    import smp

    data = batches(spec)
    for label, checkpoint, extra in CHECKPOINTING:
        try:
            emit({"config": label, **_checkpointing_run(spec, data, checkpoint, extra)})
        except Exception as e:
            traceback.print_exc()
            emit({"config": label, "error": f"{type(e).__name__}: {e}"[:500]})
        finally:
            smp.parallel_state.reset()
            gc.collect()
            if spec["device"] == "cuda":
                torch.cuda.empty_cache()


# --- part 3: all_reduce, smp against NCCL ---------------------------------------------------------


def _allreduce_rank(rank: int, world: int, store: str, spec: dict, queue) -> None:
    import torch.distributed as dist

    cuda = spec["device"] == "cuda"
    if cuda:
        count = torch.cuda.device_count()
        if count < world:  # ranks share a GPU: each a "host" of its own to NCCL (see smp.devices)
            os.environ["NCCL_HOSTID"] = f"smp-gpu-benchmark-rank{rank}"
            os.environ.setdefault("NCCL_P2P_DISABLE", "1")
            os.environ.setdefault("NCCL_SHM_DISABLE", "1")
        torch.cuda.set_device(rank % count)
    import smp  # noqa: F401  (registers the backend)

    dist.init_process_group("smp", init_method=f"file://{store}", rank=rank, world_size=world)
    plain = "nccl" if cuda else "gloo"
    groups = {
        "smp": dist.group.WORLD,
        plain: dist.new_group(list(range(world)), backend=plain),
        f"{plain}-again": dist.new_group(list(range(world)), backend=plain),
    }
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    names = list(groups)

    def once(tensor, group) -> float:
        sync(spec["device"])
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        sync(spec["device"])
        return time.perf_counter() - start

    rows = []
    for nbytes in spec["sizes"]:
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        for group in groups.values():
            for _ in range(2):
                once(tensor, group)
        iters = max(spec["min_iters"], min(spec["max_iters"], spec["budget_bytes"] // nbytes))
        samples = {name: [] for name in names}
        dist.barrier()
        for i in range(iters):
            for name in names[i % 3 :] + names[: i % 3]:
                samples[name].append(once(tensor, groups[name]))
        t = {name: statistics.median(v) for name, v in samples.items()}
        bus = nbytes * 2 * (world - 1) / world
        rows.append(
            {
                "bytes": nbytes,
                "iters": iters,
                "smp_us": 1e6 * t["smp"],
                "plain_us": 1e6 * t[plain],
                "smp_busbw_gbps": bus / t["smp"] / 1e9,
                "plain_busbw_gbps": bus / t[plain] / 1e9,
                "smp_over_plain_bandwidth": t[plain] / t["smp"],
                "aa_bandwidth": t[plain] / t[f"{plain}-again"],
            }
        )
        del tensor
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put({"plain": plain, "world": world, "rows": rows})


def allreduce_job(spec: dict, emit) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_allreduce_rank, args=(r, world, store, spec, queue)) for r in range(world)
        ]
        for p in procs:
            p.start()
        result = None
        while result is None:
            try:
                result = queue.get(timeout=1)
            except Exception:  # queue.Empty: check that both ranks are still alive
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    for p in procs:
                        if p.is_alive():
                            p.kill()
                    raise RuntimeError(
                        f"an all_reduce rank failed (exit codes {failed}): see the log"
                    ) from None
                if all(p.exitcode == 0 for p in procs):
                    result = queue.get(timeout=10)  # rank 0 put it just before it ended
        for p in procs:
            p.join(timeout=60)
    emit(result)


# --- running jobs in processes of their own -------------------------------------------------------


def job_main(raw: str) -> None:
    spec = json.loads(raw)
    if spec.get("tf32"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def emit(result: dict) -> None:
        print(RESULT + json.dumps(result), flush=True)

    {"models": models_job, "checkpointing": checkpointing_job, "allreduce": allreduce_job}[spec["kind"]](
        spec, emit
    )
    sys.stdout.flush()
    os._exit(0)  # nothing left to tear down: the NCCL/Gloo groups and compile workers go with it


class Interrupted(Exception):
    """SIGTERM (tests/gpu.sh's timeout): the running job was killed; report what was measured."""


_running: list[int] = []  # the process group of the job running now


def _on_sigterm(signum, frame) -> None:
    for pgid in _running:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    raise Interrupted(f"signal {signum}")


def run_job(spec: dict, timeout: float, logs: str | None, name: str) -> tuple[list[dict], str | None, float]:
    """Runs one job in a process of its own: a clean smp (one smp.init and one DistributedModel
    per process, as in SMP), clean torch.compile caches and CUDA memory statistics, and a crash or
    hang that costs only this job. Returns its results, an error (or None) and its seconds."""
    env = dict(os.environ)
    if spec["device"] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, os.path.abspath(__file__), "--job", json.dumps(spec)]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    _running.append(proc.pid)
    error = None
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout:.0f} s"
        out = ""
    finally:
        _running.clear()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the job's session: its ranks and compile workers
    if error is not None:
        out, _ = proc.communicate()
    seconds = time.perf_counter() - start
    results = [json.loads(line[len(RESULT) :]) for line in out.splitlines() if line.startswith(RESULT)]
    if error is None and proc.returncode != 0:
        error = f"exit status {proc.returncode}"
    if error is None and not results:
        error = "no result"
    if logs:
        os.makedirs(logs, exist_ok=True)
        slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        with open(os.path.join(logs, f"{slug}.log"), "w") as f:
            f.write("$ " + " ".join(cmd) + "\n" + out)
    if error is not None:
        tail = [line for line in out.splitlines() if not line.startswith(RESULT)][-25:]
        print(f"  {name}: {error}; the last lines of its output:")
        for line in tail:
            print("  | " + line)
    return results, error, seconds


# --- the bf16 matmul peak -------------------------------------------------------------------------


def matmul_peak(n: int = 8192, iters: int = 10, trials: int = 3) -> float:
    """TFLOP/s of a bf16 n x n x n torch.matmul on this GPU: the best of `trials` timings."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            a @ b
        end.record()
        torch.cuda.synchronize()
        best = max(best, 2 * n**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12)
    del a, b
    torch.cuda.empty_cache()
    return best


# --- tables ---------------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def mode(compiled: bool, cudagraphs: bool = False) -> str:
    return "cudagraphs" if cudagraphs else "compiled" if compiled else "eager"


def print_models(result: dict, peak_tflops: float | None) -> None:
    print(
        f"\n### {result['shape']} ({result['layers']} layers, {result['dim']} wide, seq {result['seq']}, "
        f"batch {result['batch']}, vocab {result['vocab']}, {result['params'] / 1e6:.1f} M parameters, "
        f"{result['flops_per_token'] / 1e6:.0f} MFLOP/token), {result['recipe']}, "
        f"{mode(result['compiled'], result['cudagraphs'])}; "
        f"{result['rounds']} rounds of {result['block']} steps"
    )
    rows = []
    for name, c in result["contestants"].items():
        ratio = result["ratios"].get(name)
        mfu = f"{100 * c['tflops'] / peak_tflops:.1f}%" if peak_tflops else "n/a"
        rows.append(
            [
                name,
                f"{c['step_ms']:.1f}",
                f"{c['tokens_per_s']:,.0f}",
                f"{c['tflops']:.1f}",
                mfu,
                f"{ratio['paired']:.3f} ({ratio['why']})" if ratio else "",
                f"{c['first_step_s']:.1f}",
                f"{c['loss']:.4f}",
            ]
        )
    table(
        ["run", "step ms", "tokens/s", "TFLOP/s", "MFU", "smp / this", "first step s (compile)", "loss"], rows
    )
    if result["compiled"]:
        note = "" if result["smp_compilations"] else "  <- smp compiled nothing"
        print(f"smp graphs compiled: {result['smp_compilations']}{note}")
    for name, prof in (result.get("profiles") or {}).items():
        print(
            f"\nprofile of {name}: {prof['wall_ms_per_step']:.2f} ms per step, GPU busy "
            f"{prof['gpu_busy_ms_per_step']:.2f} ms ({prof['gpu_kernels_per_step']:.0f} GPU ops); per step: "
            + ", ".join(f"{k} x{v:g}" for k, v in sorted(prof["calls_per_step"].items()))
        )
        for title, key in (("GPU", "top_gpu_ms_per_step"), ("host", "top_cpu_ms_per_step")):
            print(f"  top {title} (self ms per step, calls per step):")
            for op, ms, calls in prof[key]:
                print(f"    {ms:8.3f}  x{calls:<6g} {op}")


def print_checkpointing(rows: list[dict], spec: dict) -> None:
    print(
        f"\n### checkpointing and offloading: {spec['shape']} ({spec['layers']} layers, {spec['dim']} wide, "
        f"seq {spec['seq']}, batch {spec['batch']}), bf16, eager, pp = tp = 1, 1 microbatch, "
        f"{spec['steps']} steps; ratios against checkpointing alone"
    )
    ref = next((r for r in rows if r["config"] == "checkpointing" and "error" not in r), None)

    def rel(r, key):
        if ref is None or r.get(key) is None or not ref.get(key):
            return ""
        return f"{r[key] / ref[key]:.3f}"

    def gib(v):
        return "n/a" if v is None else f"{v / 2**30:.2f}"

    out = []
    for r in rows:
        if "error" in r:
            out.append([r["config"], "FAILED: " + r["error"][:80], "", "", "", "", ""])
            continue
        out.append(
            [
                r["config"],
                f"{r['step_ms']:.1f}",
                rel(r, "step_ms"),
                gib(r["peak_bytes"]),
                rel(r, "peak_bytes"),
                gib(r["activation_bytes"]),
                rel(r, "activation_bytes"),
            ]
        )
    table(["config", "step ms", "x time", "peak GiB", "x peak", "activations GiB", "x activations"], out)
    if spec["device"] == "cpu":
        print("(CPU: no device memory to measure, and offloading has no effect there)")


def human(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // 1024} KiB"


def print_allreduce(result: dict) -> None:
    plain = result["plain"]
    print(
        f"\n### all_reduce float32, {result['world']} processes: smp against {plain} "
        f"(median per size; bus bandwidth = bytes x 2(n-1)/n / time)"
    )
    rows = [
        [
            human(r["bytes"]),
            str(r["iters"]),
            f"{r['smp_us']:.0f}",
            f"{r['plain_us']:.0f}",
            f"{r['smp_busbw_gbps']:.2f}",
            f"{r['plain_busbw_gbps']:.2f}",
            f"{r['smp_over_plain_bandwidth']:.3f}",
            f"{r['aa_bandwidth']:.3f}",
        ]
        for r in result["rows"]
    ]
    table(
        [
            "size",
            "samples",
            "smp us",
            f"{plain} us",
            "smp GB/s",
            f"{plain} GB/s",
            f"smp/{plain} bandwidth",
            f"A/A: {plain}-again/{plain}",
        ],
        rows,
    )


def print_summary(report: dict) -> None:
    cpu = report["device"] == "cpu"
    print("\n## Summary against the targets" + (" (CPU smoke run: no verdicts)" if cpu else ""))
    rows = []
    for r in report["models"]:
        for peer, ratio in r["ratios"].items():
            same = ratio["why"] == "same recipe"
            verdict = ("met" if ratio["paired"] >= KEEP_RATIO else "NOT met") if same else "(information)"
            rows.append(
                [
                    f"{r['shape']} {r['recipe']} {mode(r['compiled'], r['cudagraphs'])}: smp / {peer}",
                    f"{ratio['paired']:.3f}",
                    f">= {KEEP_RATIO}" if same else "",
                    verdict,
                ]
            )
    peak = report.get("peak_tflops")
    target = f">= {100 * MFU_TARGET:.0f}%"
    mfu_rows = [
        r
        for r in report["models"]
        if r["shape"] == "medium" and r["recipe"] == "bf16" and r["compiled"] and not r["cudagraphs"]
    ]
    for r in mfu_rows:
        name = f"MFU, smp, medium ({r['layers']} layers) bf16 compiled"
        if peak:
            mfu = r["contestants"]["smp"]["tflops"] / peak
            rows.append([name, f"{100 * mfu:.1f}%", target, "met" if mfu >= MFU_TARGET else "NOT met"])
        else:
            rows.append([name, "n/a (no GPU peak)", target, "-"])
    if not mfu_rows and report["args"]["part"] in ("models", "all"):
        rows.append(["MFU, smp, medium bf16 compiled", "not measured", target, "-"])
    if report["allreduce"]:
        plain = report["allreduce"]["plain"]
        worst = min(report["allreduce"]["rows"], key=lambda r: r["smp_over_plain_bandwidth"])
        aa = max(abs(r["aa_bandwidth"] - 1) for r in report["allreduce"]["rows"])
        rows.append(
            [
                f"all_reduce smp/{plain} bandwidth, worst ({human(worst['bytes'])}; A/A +/-{aa:.3f})",
                f"{worst['smp_over_plain_bandwidth']:.3f}",
                ">= 0.95",
                "met" if worst["smp_over_plain_bandwidth"] >= 0.95 else "NOT met",
            ]
        )
    if cpu:
        rows = [row[:3] + ["-"] for row in rows]
    if rows:
        table(["figure", "value", "target", ""], rows)
    for s in report["skipped"]:
        print(f"skipped: {s}")
    for e in report["errors"]:
        print(f"FAILED: {e}")


# --- main -----------------------------------------------------------------------------------------


def environment() -> dict:
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception as e:  # the model part reports it too
        info["transformers"] = f"cannot import: {e}"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def model_spec(args, shape: str, device: str) -> dict:
    layers, dim, heads = SHAPES[shape]
    spec = {
        "kind": "models",
        "shape": shape,
        "device": device,
        "layers": layers,
        "dim": dim,
        "heads": heads,
        "seq": SEQ,
        "batch": args.batch or BATCH[shape],
        "vocab": args.vocab or VOCAB,
        "steps": args.steps,
        "block": args.block,
        "tf32": args.tf32,
        "profile": args.profile,
        "only": args.contestants,
    }
    if args.cpu_smoke:
        spec.update(TINY)
        spec["vocab"] = args.vocab or TINY["vocab"]
        spec["compile_backend"] = "aot_eager"
    elif args.quick:
        spec.update(QUICK)
    if args.batch:
        spec["batch"] = args.batch
    if args.seq:
        spec["seq"] = args.seq
    return spec


# Rough seconds per job on one H100, to decide what fits in --budget: a process start with its
# imports and model is ~8 s; a contestant's eager steps (2 warm-up + 12 timed) take ~1.5-8 s; compiling
# GPT-2 takes ~35 s per contestant at the small shape and ~70 s at medium (guesses: no GPU run yet).
# Scaled at run time by how long the jobs so far took against their estimates.
EAGER_SECONDS = {
    ("small", "bf16"): 1.5,
    ("small", "fp32"): 3.0,
    ("medium", "bf16"): 3.0,
    ("medium", "fp32"): 8.0,
}
COMPILE_SECONDS = {"small": 35.0, "medium": 70.0}


def estimate(job: dict) -> float:
    spec = job["spec"]
    if spec["kind"] == "checkpointing":
        return 35.0
    if spec["kind"] == "allreduce":
        return 25.0
    contestants = 2 if spec["recipe"] == "fp32" else 3
    steps = EAGER_SECONDS[spec["shape"], spec["recipe"]] * (spec["steps"] + spec["warmup"]) / 14
    if spec["compiled"]:
        steps += COMPILE_SECONDS[spec["shape"]]
    return 8 + contestants * steps


def plan_jobs(args, device: str) -> list[dict]:
    parts = {"all": ("models", "checkpointing", "allreduce")}.get(args.part, (args.part,))
    shapes = args.shapes[:1] if args.cpu_smoke else args.shapes  # one tiny shape stands for all
    eager, compiled = [], []
    if "models" in parts:
        for shape in shapes:
            for recipe in args.recipes:
                for c in args.modes:
                    spec = model_spec(args, shape, device) | {"recipe": recipe, "compiled": c != "eager"}
                    spec["cudagraphs"] = c == "cudagraphs"
                    spec["warmup"] = args.warmup or (3 if spec["compiled"] else 2)
                    job = {"name": f"models {shape} {recipe} {c}", "spec": spec}
                    (compiled if spec["compiled"] else eager).append(job)
    # Compiled: GPT-2-medium bf16 first (the MFU target), then bf16 before fp32, small before medium.
    compiled.sort(
        key=lambda j: (
            j["spec"]["shape"] != "medium" or j["spec"]["recipe"] != "bf16",
            j["spec"]["recipe"] != "bf16",
            j["spec"]["shape"] != "small",
        )
    )
    eager.sort(key=lambda j: (j["spec"]["shape"] != "small", j["spec"]["recipe"] != "bf16"))
    jobs = list(eager)
    if "checkpointing" in parts:
        largest = max(shapes, key=lambda name: SHAPES[name][0])
        spec = model_spec(args, largest, device) | {"kind": "checkpointing", "warmup": args.warmup or 2}
        jobs.append({"name": f"checkpointing {largest}", "spec": spec})
    if "allreduce" in parts:
        # Samples per size: budget_bytes / size, between min_iters and max_iters.
        spec = {"kind": "allreduce", "device": device, "sizes": ALLREDUCE_SIZES, "budget_bytes": 1 << 30}
        spec |= {"min_iters": 5, "max_iters": 40}
        if device == "cpu" or args.quick:
            sizes = [MIB, 4 * MIB] if device == "cpu" else ALLREDUCE_SIZES[:3]
            spec |= {"sizes": sizes, "budget_bytes": 64 * MIB, "min_iters": 3, "max_iters": 10}
        jobs.append({"name": "allreduce", "spec": spec})
    return jobs + compiled


def rerun_hint(job: dict, args) -> str:
    spec = job["spec"]
    flags = "".join(f" --{flag}" for flag in ("quick", "cpu-smoke") if getattr(args, flag.replace("-", "_")))
    if spec["kind"] != "models":
        return f"python benchmarks/gpu.py --part {spec['kind']} --budget 0{flags}"
    return (
        f"python benchmarks/gpu.py --part models --shapes {spec['shape']} --recipes {spec['recipe']} "
        f"--modes {mode(spec['compiled'], spec.get('cudagraphs', False))} --budget 0{flags}"
    )


def csv_of(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            wanted = ", ".join(choices)
            raise argparse.ArgumentTypeError(f"choose from {wanted} (comma-separated), got {text!r}")
        return items

    return parse


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--job":
        job_main(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--part",
        choices=("models", "checkpointing", "allreduce", "all"),
        default=None,
        help="default: all (with --cpu-smoke: models)",
    )
    p.add_argument("--shapes", type=csv_of(tuple(SHAPES)), default=list(SHAPES), help="small,medium")
    p.add_argument("--recipes", type=csv_of(("fp32", "bf16")), default=["fp32", "bf16"])
    p.add_argument(
        "--modes",
        type=csv_of(("eager", "compiled", "cudagraphs")),
        default=["eager", "compiled"],
        help="cudagraphs: compiled with mode='reduce-overhead' on both sides (not in the default run)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 12; 4 --quick)")
    p.add_argument("--block", type=int, default=None, help="steps per timed round (default 3; 2 --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2 eager, 3 compiled)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 8 per shape)")
    p.add_argument("--seq", type=int, default=None, help=f"sequence length (default {SEQ})")
    p.add_argument("--vocab", type=int, default=None, help=f"vocabulary (default {VOCAB})")
    p.add_argument("--profile", action="store_true", help="also profile 3 steps of each contestant")
    p.add_argument(
        "--contestants",
        type=lambda t: [x.strip() for x in t.split(",")],
        default=None,
        help="peers to run beside smp (comma-separated names, e.g. 'plain autocast'); default all",
    )
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls in the fp32 recipe (both sides)")
    p.add_argument("--quick", action="store_true", help="2 layers, seq 256, batch 4, few steps: a smoke run")
    p.add_argument("--budget", type=float, default=180.0, help="seconds for the whole run; 0: no limit")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (plumbing)")
    p.add_argument("--json", help="write every result to this file")
    p.add_argument("--logs", help="write each job's output to a file in this folder")
    args = p.parse_args()
    if args.steps is None:
        args.steps = 4 if args.quick else 12
    if args.block is None:
        args.block = 2 if args.quick else 3
    if args.steps < 1 or args.block < 1:
        p.error("--steps and --block must be positive")
    if args.part is None:
        args.part = "models" if args.cpu_smoke else "all"

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print(
            "gpu.py: NO CUDA GPU here (torch.cuda.is_available() is False): nothing measured, "
            "exit status 77.\n"
            "        Run it on a machine with a GPU (tests/gpu.sh does), or add --cpu-smoke to check the\n"
            "        plumbing on the CPU at tiny shapes (no MFU, no memory figures)."
        )
        sys.exit(77)
    device = "cpu" if args.cpu_smoke else "cuda"
    start = time.perf_counter()
    report = {"environment": environment(), "args": vars(args), "device": device}
    report |= {"models": [], "checkpointing": None, "allreduce": None, "skipped": [], "errors": []}
    print("# GPU benchmark (benchmarks/gpu.py): smp against plain PyTorch, checkpointing, all_reduce")
    print(", ".join(f"{k} {v}" for k, v in report["environment"].items()))
    if args.cpu_smoke:
        print("CPU smoke run: tiny shapes, compiled with the aot_eager backend, no MFU: plumbing only")

    peak = None
    if device == "cuda" and args.part in ("models", "all"):
        try:
            peak = matmul_peak()
            print(f"measured bf16 matmul peak (8192^3, best of 3 x 10): {peak:.0f} TFLOP/s")
        except Exception as e:
            report["errors"].append(f"matmul peak: {type(e).__name__}: {e}")
            traceback.print_exc()
    report["peak_tflops"] = peak

    signal.signal(signal.SIGTERM, _on_sigterm)
    done_estimate = done_actual = 0.0
    for job in plan_jobs(args, device):
        elapsed = time.perf_counter() - start
        est = estimate(job) * (0.5 if args.quick or args.cpu_smoke else 1.0)
        scale = min(3.0, max(0.5, done_actual / done_estimate)) if done_estimate else 1.0
        if job["spec"].get("compiled"):
            scale = max(1.0, scale)  # fast eager jobs say nothing about compile time
        if args.budget > 0 and elapsed + est * scale > args.budget:
            report["skipped"].append(
                f"{job['name']} (estimated {est * scale:.0f} s, {max(0, args.budget - elapsed):.0f} s of "
                f"--budget {args.budget:.0f} left): {rerun_hint(job, args)}"
            )
            print(f"\n[{elapsed:.0f} s] {job['name']}: skipped, would not fit in --budget")
            continue
        timeout = max(60.0, args.budget - elapsed + 30) if args.budget > 0 else max(600.0, 5 * est)
        print(f"\n[{elapsed:.0f} s] {job['name']} ...", flush=True)
        try:
            results, error, seconds = run_job(job["spec"], timeout, args.logs, job["name"])
            done_estimate += est
            done_actual += seconds
            kind = job["spec"]["kind"]
            if kind == "models" and results:
                report["models"].extend(results)
                for r in results:
                    print_models(r, peak)
            elif kind == "checkpointing" and results:
                report["checkpointing"] = {"spec": job["spec"], "rows": results}
                print_checkpointing(results, job["spec"])
                error = error or next((f"{r['config']}: {r['error']}" for r in results if "error" in r), None)
            elif kind == "allreduce" and results:
                report["allreduce"] = results[0]
                print_allreduce(results[0])
            print(f"({job['name']}: {seconds:.0f} s)", flush=True)
            if error:
                report["errors"].append(f"{job['name']}: {error}")
        except Interrupted as e:
            report["errors"].append(f"{job['name']}: interrupted ({e}); the jobs after it did not run")
            break
        except Exception as e:  # the harness itself: the other parts still run
            traceback.print_exc()
            report["errors"].append(f"{job['name']}: {type(e).__name__}: {e}")

    report["seconds"] = time.perf_counter() - start
    print_summary(report)
    print(f"\ntotal {report['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(1 if report["errors"] else 0)


if __name__ == "__main__":
    main()
