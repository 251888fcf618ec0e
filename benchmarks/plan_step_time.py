"""The planner's step time against smp's measured steps on CPU processes (docs/benchmarks.md).

    python benchmarks/plan_step_time.py [--steps 6] [--rounds 2] [--hardware-out cpu.json]

Two processes (one thread each, as the training runs use them), in rounds; in each round, for each
layout:
1. both ranks at once measure the CPU processes as a hardware description (smp.planner.hardware):
   the matmul rate in fp32 and bf16 (a linear layer's forward, input- and weight-gradient products
   at two shapes), a fused causal attention's rate (sdpa forward and backward, at two shapes), the
   bytes per second of a chain of elementwise products of [512, 1024] tensors whose outputs stay
   alive (as a forward's activations do), what an element of tanh and exp costs beyond that
   traffic (chains alike), the time a dispatched operation costs (a chain of tiny
   multiplications, forward and backward, per the planner's count of 1 + 1.6 operations), and the
   all-reduce between the two processes, each call after some compute as a step makes them (its
   time at 4 KiB is the latency, the added time to 4 MiB the bandwidth). Each figure is a rate
   over a loop of at least 0.1 s;
2. they train a small Hugging Face GPT-2 with smp in the layout, timing each step after two
   warm-up steps (the slower rank's time of each step; the median over the round's steps).
The planner then predicts the layout's step time on the description measured just before it (the
machine is shared: its share of the cores moves between minutes), counting on the module itself
(smp.plan(model=builder)). The table gives the median over rounds of measured, predicted and
their ratio, and each round's ratio; and the fastest step of all rounds against the prediction on
the fastest figures measured (each rate's highest, each cost's lowest): the machine at its least
shared, where the two others' load on the 2 cores least distorts either side.
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


def measure_rank(rank: int, world: int, rounds: int, steps: int) -> list[list[dict]]:
    """Per round and layout: this rank's micro-benchmarks, then its step times in the layout."""
    import torch

    torch.set_num_threads(1)  # the processes share the machine's cores
    return [
        [{"facts": facts(), "steps": steps_in(layout, steps)} for _, layout in LAYOUTS] for _ in range(rounds)
    ]


def facts() -> dict:
    import torch

    return {
        "fp32": _matmul_rate(torch.float32),
        "bf16": _matmul_rate(torch.bfloat16),
        "fp16": _matmul_rate(torch.float16, shapes=((256, 256, 256),)),  # slow on CPUs; unused here
        "attention": {
            "fp32": _attention_rate(torch.float32),
            "bf16": _attention_rate(torch.bfloat16),
            "fp16": _attention_rate(torch.float16, shapes=((4, 4, 128, 64),)),  # as its matmuls: unused
        },
        "memory": (memory := _elementwise_rate()),
        "transcendental": _transcendental_cost(memory),
        "op": _op_cost(),
        "all_reduce": _all_reduce(),
    }


def _best(fn, window: float = 0.1) -> float:
    """Seconds a call takes on average over a loop of at least `window` seconds (after one)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= window:
            return elapsed / calls


def _matmul_rate(dtype, shapes=((512, 256, 1024), (512, 1024, 256))) -> float:
    """FLOP/s of a linear layer's matmuls as training runs them: [T, k] x [k, n] with each operand
    as the forward, the input gradient and the weight gradient lay it out (plain, the weight
    transposed, the activation transposed: nn.Linear and HF's Conv1D run one of each per layer),
    their total FLOPs over their total time. A CPU's best square matmul is no rate a layer's
    shards run at: on this VM fp32 layers run at 0.65-0.85x of it, and without bf16 units a bf16
    product is 15x slower or faster by operand layout alone (oneDNN's paths)."""
    import torch

    flops = seconds = 0.0
    for t, k, n in shapes:
        for a, b in (
            (torch.randn(t, k, dtype=dtype), torch.randn(k, n, dtype=dtype)),
            (torch.randn(t, k, dtype=dtype), torch.randn(n, k, dtype=dtype).t()),
            (torch.randn(k, t, dtype=dtype).t(), torch.randn(k, n, dtype=dtype)),
        ):
            flops += 2 * t * k * n
            seconds += _best(lambda a=a, b=b: torch.mm(a, b))
    return flops / seconds


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _attention_rate(dtype, shapes=((4, 4, 128, 64), (4, 8, 256, 64))) -> float:
    """FLOP/s of a fused causal attention (sdpa: the CPU's flash kernel) forward and backward, at
    [batch, heads, seq, head_dim] shapes, counted as the planner counts them (4 seq^2 head_dim
    FLOPs a head forward, the backward 2.5 forwards) over their total time. On 2026-12-08's VM
    it ran at 0.74 of the fp32 matmul rate in fp32 and at 0.14 of the bf16 one in bf16 (the
    kernel accumulates in fp32), and by shape: 34-77 GFLOP/s in bf16 from sequence 128 to 256."""
    import torch
    import torch.nn.functional as F
    from smp.planner.stage_work import FUSED_ATTENTION_BACKWARD

    flops = seconds = 0.0
    for batch, heads, seq, head_dim in shapes:
        q, k, v = (
            torch.randn(batch, heads, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        grad = torch.randn(batch, heads, seq, head_dim, dtype=dtype)

        def step(q=q, k=k, v=v, grad=grad):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        flops += (1 + FUSED_ATTENTION_BACKWARD) * 4 * batch * heads * seq * seq * head_dim
        seconds += _best(step)
    return flops / seconds


def _elementwise_rate() -> float:
    """Bytes per second elementwise operations move where their outputs stay alive, as a forward's
    activations do until its backward: a chain of 16 products of [512, 1024] fp32 tensors (a
    layer's activations here), each kept, then all freed."""
    import torch

    a, b = torch.randn(512, 1024), torch.randn(512, 1024)
    depth = 16

    def chain():
        kept, x = [], a
        for _ in range(depth):
            x = x * b
            kept.append(x)

    return depth * 3 * a.numel() * 4 / _best(chain)


def _transcendental_cost(memory_rate: float) -> float:
    """Seconds an element of tanh and exp (the mean) costs beyond the memory traffic the
    elementwise rate already counts for it (a read and a write of 4 bytes), on chains like
    _elementwise_rate's."""
    import torch

    a = torch.randn(512, 1024) * 0.1
    depth = 16

    def chain(op):
        def run():
            kept, x = [], a
            for _ in range(depth):
                x = op(x)
                kept.append(x)

        return run

    per_element = statistics.mean(_best(chain(op)) / (depth * a.numel()) for op in (torch.tanh, torch.exp))
    return max(0.0, per_element - 2 * 4 / memory_rate)


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
    """Seconds of one all-reduce between the two processes at 4 KiB and 4 MiB, each called after
    some compute, as a step calls its collectives. Back to back they run 1.2-2x faster on this
    VM (1.5 against 1.9-2.2 ms at 4 KiB, 2.4 against 4.6-6.0 ms at 1 MiB): a rank coming from
    compute has its peer's wake-up and a cold cache to pay."""
    import torch
    import torch.distributed as dist

    a = torch.randn(256, 256)
    out = {}
    for size, calls in ((4 * 2**10, 40), (4 * 2**20, 12)):
        t = torch.ones(size // 4)
        dist.all_reduce(t)
        dist.barrier()
        seconds = 0.0
        for _ in range(calls):
            for _ in range(8):  # about 2 ms of matmuls, the same on both ranks
                torch.mm(a, a)
            start = time.perf_counter()
            dist.all_reduce(t)
            seconds += time.perf_counter() - start
        out[size] = seconds / calls
    return out


def describe(ranks: list[dict], best: bool = False) -> dict:
    """The hardware description (smp.planner.hardware's fields) from the ranks' measurements: their
    means, or (best) the fastest of each (the least shared moment of the machine)."""

    def mean(key):
        return (max if best else statistics.mean)(r[key] for r in ranks)

    def least(values):
        return (min if best else statistics.mean)(values)

    small, large = 4 * 2**10, 4 * 2**20
    latency = least([r["all_reduce"][small] for r in ranks])
    added = least([r["all_reduce"][large] for r in ranks]) - latency
    link = (large - small) / added / 1e9  # an all-reduce of 2 moves its buffer once per rank
    return {
        "description": f"CPU process, 1 thread ({_cpu_name()}), 2 processes on one host; measured by "
        "benchmarks/plan_step_time.py",
        "peak_tflops": {d: mean(d) / 1e12 for d in _DTYPES},
        "attention_tflops": {
            d: (max if best else statistics.mean)(r["attention"][d] for r in ranks) / 1e12 for d in _DTYPES
        },
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
        "kernel_overhead_us": least([r["op"] for r in ranks]) * 1e6,
        "transcendental_ns": least([r["transcendental"] for r in ranks]) * 1e9,
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


def steps_in(layout: dict, steps: int) -> list[float]:
    """This rank's step times (seconds) in `layout`."""
    import smp
    import torch.distributed as dist

    config = {k: v for k, v in layout.items() if k != "activation_checkpointing"}
    smp.init({**config, "ddp": True})
    try:
        return _time_steps(smp, dist, layout, steps)
    finally:
        smp.parallel_state.reset()


def _time_steps(smp, dist, layout: dict, steps: int) -> list[float]:
    import torch
    from plan_validation import distributed_gpt2

    model = distributed_gpt2(smp, layout, build_gpt2)
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


def predict(name: str, hardware: dict):
    """The planner's step time of layout `name` on `hardware` (counts measured on the module)."""
    import smp

    layout = dict(LAYOUTS)[name]
    job = {"seq_len": SEQ, "global_batch": GLOBAL_BATCH, "gpus": 2, "hardware": hardware}
    return smp.plan(build_gpt2, **job, layout=layout, precision="fp32").evaluated.time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="timed steps per layout and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds over every layout (one launch)")
    p.add_argument("--hardware-out", help="write the mean measured CPU description here (JSON)")
    args = p.parse_args()

    import plan_step_time
    from harness import run_ranks
    from smp.planner.report import time_split

    ranks = run_ranks(plan_step_time.measure_rank, 2, args.rounds, args.steps, timeout=3000)
    rows = {name: {"measured": [], "predicted": [], "ratio": [], "split": ""} for name, _ in LAYOUTS}
    for r in range(args.rounds):
        for i, (name, _) in enumerate(LAYOUTS):
            runs = [rank[r][i] for rank in ranks]
            hardware = describe([run["facts"] for run in runs])  # measured just before these steps
            measured = statistics.median(
                max(pair) for pair in zip(*(run["steps"] for run in runs), strict=True)
            )
            t = predict(name, hardware)
            row = rows[name]
            row["measured"].append(measured)
            row["predicted"].append(t.total)
            row["ratio"].append(t.total / measured)
            row["split"] = time_split(t)
    every = [run["facts"] for rank in ranks for runs in rank for run in runs]
    overall = describe(every)
    fastest = describe(every, best=True)
    for i, (name, _) in enumerate(LAYOUTS):  # every step of every round, the slower rank's
        steps = [
            max(pair)
            for r in range(args.rounds)
            for pair in zip(*(k[r][i]["steps"] for k in ranks), strict=True)
        ]
        rows[name]["best"] = (min(steps), predict(name, fastest).total)
    if args.hardware_out:
        with open(args.hardware_out, "w") as f:
            json.dump(overall, f, indent=1)
    print("measured CPU description (mean of every measurement):", json.dumps(overall))
    print(
        f"\nGPT-2 (hidden {GPT2['n_embd']}, {GPT2['n_layer']} layers, vocab {GPT2['vocab_size']}), "
        f"sequence {SEQ}, global batch {GLOBAL_BATCH}, 2 processes, {args.rounds} rounds of {args.steps} "
        "steps\n"
    )
    print(
        "| layout | measured ms (median) | predicted ms | predicted / measured (median; per round) | "
        "fastest step ms | predicted on the fastest figures | ratio | predicted split |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---|")
    for name, row in rows.items():
        ratios = ", ".join(f"{x:.2f}" for x in row["ratio"])
        fast, fast_predicted = row["best"]
        print(
            f"| {name} | {statistics.median(row['measured']) * 1e3:.0f} | "
            f"{statistics.median(row['predicted']) * 1e3:.0f} | {statistics.median(row['ratio']):.3f} "
            f"({ratios}) | {fast * 1e3:.0f} | {fast_predicted * 1e3:.0f} | {fast_predicted / fast:.3f} | "
            f"{row['split']} |"
        )


if __name__ == "__main__":
    main()
