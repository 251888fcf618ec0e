"""Inputs whose shapes change, and torch.compile of the stages (issue 16), on CPU.

    PYTHONPATH=python torchrun --standalone --nproc_per_node=2 benchmarks/shapes_compile.py [--part all]

Two processes, one pipeline of two stages, 2 microbatches, the GPT of the tests
(tests/python/models.py) with 128 positions. A step is zero_grad + @smp.step + optimizer.step,
started after a barrier; its time is the slowest rank's.

- signature: the first step at each of 4 new sequence lengths (capture + the step) against the
  median cached step at the same length, and the cost of computing a call's signature (every
  forward does it; ranks agree on it without a message, as they see the same inputs).
- compile: median steady step eager, "compile": {"dynamic": false} (one graph per signature,
  smp's default) and {"dynamic": true}; the first step at a new length under each (the compile).
- padding: a corpus whose row lengths spread as documents do (log-normal, median 36 tokens, cut
  to [8, 128]); batches padded to 128 (padding='max_length'), to their longest row
  (padding='longest': a new signature most steps), and to the next multiple of 32 (bucketing).
  Real (non-pad) tokens per second over the whole run, captures included, and the signatures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import smp
import torch
import torch.distributed as dist
import torch.nn.functional as F
from smp.engine import compiled, signatures

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from models import GPT  # noqa: E402

MAX_LEN = 128
ROWS = 8


def build(config_extra: dict):
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2} | config_extra)
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(layers=4, dim=64, heads=4, seq=MAX_LEN))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))

    @smp.step
    def step(ids, mask):
        logits = model(ids)
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100).reshape(-1),
            reduction="sum",
        ) / (ids.shape[0] * MAX_LEN)
        model.backward(loss)
        return loss

    def run(ids, mask) -> float:
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        step(ids, mask)
        opt.step()
        took = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return took.item()

    return model, run


def batch(seed: int, length: int, rows: int = ROWS):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (rows, length), generator=g), torch.ones(rows, length, dtype=torch.long)


def part_signature(args) -> dict:
    model, run = build({})
    for i in range(args.warmup):
        run(*batch(i, 64))
    out = {"cached_step_s": {}, "new_signature_step_s": {}, "capture_s": {}}
    for length in (96, 48, 32, 120):
        out["new_signature_step_s"][length] = run(*batch(100 + length, length))
        out["cached_step_s"][length] = statistics.median(run(*batch(i, length)) for i in range(args.steps))
    cache = model.engine.signature_cache
    out["capture_s"] = {signatures.describe(s): round(t, 4) for s, t in cache.seen_costs().items()}
    ids, mask = batch(0, 64)
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        signatures.of((ids,), {})
    out["signature_key_us"] = (time.perf_counter() - start) / n * 1e6
    smp.parallel_state.reset()
    return out


COMPILE_MODES = {
    "eager": {},
    "compile_static": {"compile": {"dynamic": False}},
    "compile_dynamic": {"compile": {"dynamic": True}},
}


def part_compile(args) -> dict:
    """Each mode in --compile-modes order (the first compile in a process also warms inductor up:
    run with a fresh TORCHINDUCTOR_CACHE_DIR and swap the order to see cold costs)."""
    out = {}
    for name in args.compile_modes.split(","):
        extra = COMPILE_MODES[name]
        before = compiled.compiles()
        _, run = build(extra)
        first = run(*batch(0, 64))  # capture (+ compile)
        for i in range(args.warmup):
            run(*batch(i, 64))
        steady = statistics.median(run(*batch(i, 64)) for i in range(args.steps))
        new_length = run(*batch(1, 96))  # a new signature: capture (+ compile) again
        steady_new = statistics.median(run(*batch(i, 96)) for i in range(args.steps))
        out[name] = {
            "first_step_s": first,
            "steady_step_s_len64": steady,
            "new_signature_step_s_len96": new_length,
            "steady_step_s_len96": steady_new,
            "compiles": compiled.compiles() - before,
        }
        smp.parallel_state.reset()
    return out


def corpus_lengths(n: int, seed: int = 0) -> list[int]:
    """Row lengths as documents spread: log-normal, median 36 tokens, cut to [8, MAX_LEN]."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(n, generator=g) * 0.7 + torch.log(torch.tensor(36.0)))
    return raw.clamp(8, MAX_LEN).long().tolist()


def padded(lengths: list[int], width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (len(lengths), width), generator=g)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def part_padding(args) -> dict:
    lengths = corpus_lengths(ROWS * args.padding_steps)
    rows = [lengths[i : i + ROWS] for i in range(0, len(lengths), ROWS)]
    real_tokens = sum(lengths)
    out = {"real_tokens": real_tokens, "rows": len(lengths)}
    for name, width in (
        ("max_length", lambda b: MAX_LEN),
        ("longest", max),
        ("bucket_32", lambda b: -(-max(b) // 32) * 32),
    ):
        model, run = build({"signature_warn_after": 10_000})
        start = time.perf_counter()
        times = [run(*padded(b, width(b), i)) for i, b in enumerate(rows)]
        total = time.perf_counter() - start
        cache = model.engine.signature_cache
        capture = sum(cache.seen_costs().values())
        out[name] = {
            "seconds": total,
            "real_tokens_per_s": real_tokens / total,
            "real_tokens_per_s_without_captures": real_tokens / max(total - capture, 1e-9),
            "signatures": cache.signatures_seen,
            "capture_s": capture,
            "median_step_s": statistics.median(times),
            "padded_tokens": sum(width(b) * ROWS for b in rows),
        }
        smp.parallel_state.reset()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("all", "signature", "compile", "padding"), default="all")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--padding-steps", type=int, default=40)
    p.add_argument("--compile-modes", default="eager,compile_static,compile_dynamic")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    parts = ("signature", "compile", "padding") if args.part == "all" else (args.part,)
    results = {}
    for part in parts:
        results[part] = globals()[f"part_{part}"](args)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps({part: results[part]}, indent=1), flush=True)
    if args.json and int(os.environ.get("RANK", "0")) == 0:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
