"""The planner's step time against smp's measured steps on CPU processes (docs/benchmarks.md).

    python benchmarks/plan_step_time.py [--steps 6] [--rounds 2] [--hardware-out cpu.json]

Two processes (one thread each, as the training runs use them), in rounds; each round:
1. measures the CPU processes as a hardware description (smp.planner.hardware), both ranks at
   once: the matmul rate in fp32 and bf16 (square matmuls of 256 to 1024, the best size), the
   memory bandwidth of a 32 MiB copy, the time a dispatched operation costs (a chain of tiny
   multiplications, forward and backward, per the planner's count of 1 + 1.6 operations), and the
   all-reduce between the two processes (its time at 4 KiB is the latency, the added time to
   4 MiB the bandwidth). Each figure is a rate over a loop of at least 0.2 s, so that it sees the
   machine as shared at that moment, as the steps do;
2. trains a small Hugging Face GPT-2 with smp in each layout, timing every step after two
   warm-up steps (the slower rank's time of each step).
The description is the mean over ranks and rounds, the measured figure the median over steps
and rounds. Then the planner predicts each layout's step time on that description (counts
measured on the module: smp.plan(model=builder)) and the table prints predicted / measured.
Nothing is fitted to the step times: the description comes from the micro-benchmarks alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests", "python"), os.path.join(HERE, "..", "python")]

SEQ, GLOBAL_BATCH = 128, 8
GPT2 = {"vocab_size": 2048, "n_positions": SEQ, "n_embd": 256, "n_layer": 4, "n_head": 4}
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}
# (name, smp config plus "activation_checkpointing"), for 2 processes.
LAYOUTS = (
    ("rdp2", {}),
    ("rdp2 sharded optimizer", {"shard_optimizer_state": True}),
    ("rdp2 bf16", {"bf16": True}),
    ("sdp2", {"sharded_data_parallel_degree": 2}),
    ("tp2", {"tensor_parallel_degree": 2}),
    ("pp2 m=2", {"pipeline_parallel_degree": 2, "microbatches": 2}),
    (
        "pp2 m=4 checkpoint each",
        {"pipeline_parallel_degree": 2, "microbatches": 4, "activation_checkpointing": "each"},
    ),  # noqa: E501
)


def build_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(**GPT2, **NO_DROPOUT))


# --- 1. the hardware description ----------------------------------------------------------------


def measure_rank(rank: int, world: int, rounds: int, steps: int) -> dict:
    """Per round: this rank's micro-benchmarks, then its step times in each layout."""
    import torch

    torch.set_num_threads(1)  # the processes share the machine's cores
    out = {"facts": [], "steps": []}
    for _ in range(rounds):
        out["facts"].append(facts())
        out["steps"].append(steps_all(steps))
    return out


def facts() -> dict:
    import torch

    return {
        "fp32": _matmul_rate(torch.float32),
        "bf16": _matmul_rate(torch.bfloat16),
        "fp16": _matmul_rate(torch.float16),
        "memory": _copy_rate(),
        "op": _op_cost(),
        "all_reduce": _all_reduce(),
    }


def _best(fn, window: float = 0.2) -> float:
    """Seconds a call takes on average over a loop of at least `window` seconds (after one)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= window:
            return elapsed / calls


def _matmul_rate(dtype) -> float:
    import torch

    best = 0.0
    for n in (256, 512, 1024):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        best = max(best, 2 * n**3 / _best(lambda a=a, b=b: torch.mm(a, b)))
    return best


def _copy_rate() -> float:
    import torch

    a, b = torch.randn(8 * 2**20), torch.empty(8 * 2**20)
    return 2 * a.numel() * 4 / _best(lambda: b.copy_(a))


def _op_cost() -> float:
    """Seconds a dispatched operation costs, as the planner counts them (1 forward + 1.6 backward
    operations per forward one)."""
    import torch
    from smp.planner.stage_work import BACKWARD_OPS

    chain = 200

    def run():
        x = torch.ones(4, requires_grad=True)
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    return _best(run) / (chain * (1 + BACKWARD_OPS))


def _all_reduce() -> dict:
    import torch
    import torch.distributed as dist

    out = {}
    for size, calls in ((4 * 2**10, 200), (4 * 2**20, 40)):
        t = torch.ones(size // 4)
        dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(t)
        out[size] = (time.perf_counter() - start) / calls
    return out


def describe(ranks: list[dict]) -> dict:
    """The hardware description (smp.planner.hardware's fields) from every rank's and round's
    measurements."""
    ranks = [f for r in ranks for f in r["facts"]]

    def mean(key):
        return statistics.mean(r[key] for r in ranks)

    small, large = 4 * 2**10, 4 * 2**20
    latency = statistics.mean(r["all_reduce"][small] for r in ranks)
    added = statistics.mean(r["all_reduce"][large] for r in ranks) - latency
    link = (large - small) / added / 1e9  # an all-reduce of 2 moves its buffer once per rank
    return {
        "description": f"CPU process, 1 thread ({_cpu_name()}), 2 processes on one host; measured by "
        "benchmarks/plan_step_time.py",
        "peak_tflops": {d: mean(d) / 1e12 for d in ("bf16", "fp16", "fp32")},
        "matmul_efficiency": 1.0,
        "compute_units": 1,
        "matmul_tiles": [[1, 1]],
        "memory": "12GiB",
        "memory_bandwidth_gbps": mean("memory") / 1e9,
        "memory_efficiency": 1.0,
        "gpus_per_node": 2,
        "intra_node_gbps": link,
        "inter_node_gbps": link,
        "link_efficiency": 1.0,
        "collective_latency_us": latency * 1e6,
        "intra_node_step_latency_us": 0.0,
        "inter_node_step_latency_us": 0.0,
        "kernel_overhead_us": mean("op") * 1e6,
        "sustained_fraction": 1.0,
        "overlap": False,  # two busy processes on two cores: nothing runs beside the compute
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


# --- 2. the measured steps ----------------------------------------------------------------------


def steps_all(steps: int) -> list[list[float]]:
    """This rank's step times (seconds) in each layout."""
    import smp
    import torch.distributed as dist

    out = []
    for _, layout in LAYOUTS:
        config = {k: v for k, v in layout.items() if k != "activation_checkpointing"}
        smp.init({**config, "ddp": True})
        out.append(_time_steps(smp, dist, layout, steps))
        smp.parallel_state.reset()
    return out


def _time_steps(smp, dist, layout: dict, steps: int) -> list[float]:
    import torch

    torch.manual_seed(0)
    with smp.tensor_parallelism(smp.tp_size() > 1):
        model = smp.DistributedModel(build_gpt2())
    strategy = layout.get("activation_checkpointing", "none")
    if strategy != "none":
        smp.set_activation_checkpointing(model.get_module().transformer.h, strategy=strategy)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(ids):
        out = model(input_ids=ids, labels=ids)
        model.backward(out.loss)
        return out.loss

    per, index = GLOBAL_BATCH // smp.dp_size(), smp.dp_rank()
    seconds = []
    for step in range(steps + 2):  # two warm-up steps
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, GPT2["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g)
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        train_step(ids[index * per : (index + 1) * per])
        opt.step()
        seconds.append(time.perf_counter() - start)
    return seconds[2:]


# --- 3. the prediction and the table ------------------------------------------------------------


def predict(hardware: dict) -> dict:
    import smp

    job = {"seq_len": SEQ, "global_batch": GLOBAL_BATCH, "gpus": 2, "hardware": hardware}
    out = {}
    for name, layout in LAYOUTS:
        result = smp.plan(build_gpt2, **job, layout=layout, precision="fp32")
        out[name] = result.evaluated.time
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="timed steps per layout and round")
    p.add_argument("--rounds", type=int, default=2, help="launches; the figure is the median over all")
    p.add_argument("--hardware-out", help="write the measured CPU description here (JSON)")
    args = p.parse_args()

    import plan_step_time
    from harness import run_ranks

    ranks = run_ranks(plan_step_time.measure_rank, 2, args.rounds, args.steps, timeout=1800)
    hardware = describe(ranks)
    if args.hardware_out:
        with open(args.hardware_out, "w") as f:
            json.dump(hardware, f, indent=1)
    print("measured CPU description:", json.dumps(hardware))
    measured: dict[str, list[float]] = {name: [] for name, _ in LAYOUTS}
    for r in range(args.rounds):
        for i, (name, _) in enumerate(LAYOUTS):
            per_rank = (rank["steps"][r][i] for rank in ranks)
            measured[name] += [max(pair) for pair in zip(*per_rank, strict=True)]
    predicted = predict(hardware)
    print(
        f"\nGPT-2 (hidden {GPT2['n_embd']}, {GPT2['n_layer']} layers, vocab {GPT2['vocab_size']}), "
        f"sequence {SEQ}, global batch {GLOBAL_BATCH}, 2 processes\n"
    )
    print(
        "| layout | measured ms (median; min-max) | predicted ms | predicted / measured | predicted split |"
    )  # noqa: E501
    print("|---|---|---:|---:|---|")
    from smp.planner.report import time_split

    for name, _ in LAYOUTS:
        m = measured[name]
        t = predicted[name]
        median = statistics.median(m)
        print(
            f"| {name} | {median * 1e3:.0f} ({min(m) * 1e3:.0f}-{max(m) * 1e3:.0f}) | {t.total * 1e3:.0f} | "
            f"{t.total / median:.3f} | {time_split(t)} |"
        )


if __name__ == "__main__":
    main()
