"""Inputs whose shapes change between steps (issue 16): 5 steps over 4 sequence lengths and a
smaller last batch, with an eval step of yet another shape in between, train as one process does
in every layout; the signature warning fires once; the cache bound holds."""

from __future__ import annotations

import time

import pytest
import shape_cases
from harness import run_ranks

PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2}
# (name, config) in one launch of 4 processes; the pp2_tp2 run also bounds the cache at 3 graphs
# and warns at the 4th signature, so eviction and recapture are part of its parity.
# pp=2 and tp=2 alone, each inside pp2_tp2_bounded too: with --slow only.
ALONE = (("pp2", PP2), ("tp2", {"tensor_parallel_degree": 2}))
GPT_LAYOUTS = (
    (
        "pp2_tp2_bounded",
        PP2 | {"tensor_parallel_degree": 2, "signature_warn_after": 4, "signature_cache_size": 3},
    ),
    # Every new signature's stage runtime gets the schedule's preparation too: zero_bubble's
    # rewrite and the ordered single-tag message path.
    (
        "pp2_rdp2_sharded_zero_bubble_ordered",
        PP2 | {"shard_optimizer_state": True, "pipeline": "zero_bubble", "ordered_messages": True},
    ),
    # zero_bubble_v: each new signature cut into the same four stages in a V, two per rank.
    ("pp2_tp2_zero_bubble_v", PP2 | {"tensor_parallel_degree": 2, "pipeline": "zero_bubble_v"}),
)
EVAL_AT = 3  # the eval step runs before training step 3
ADVICE = "distinct input signatures"


def _run(rank, world_size, case, layouts):
    import smp

    ref = shape_cases.reference(case, eval_between=EVAL_AT)
    results = []
    for name, config in layouts:
        smp.init(config)
        caught, log = shape_cases.catch_warnings()
        start = time.perf_counter()
        try:
            r = shape_cases.train(smp, case, ref, eval_between=EVAL_AT)
        finally:
            caught.__exit__(None, None, None)
        r["seconds"] = time.perf_counter() - start
        r["advice"] = [str(w.message) for w in log if ADVICE in str(w.message)]
        results.append((name, r))
        smp.parallel_state.reset()
    return results


def _check(per_rank, tolerance):
    for results in per_rank:
        for name, r in results:
            assert r["loss_err"] < tolerance and r["param_err"] < tolerance, (name, r)
            # 4 training lengths (one batch smaller) and the eval shape: 5 signatures.
            assert r["cache"] is None or r["cache"]["seen"] == 5, (name, r["cache"])


HF_LAYOUTS = (("pp2_tp2", PP2 | {"tensor_parallel_degree": 2}),)
HF_CASES = ("hf_llama", "hf_bert")


def _matrix(rank, world_size, slow):
    results = {"gpt": _run(rank, world_size, "gpt", (ALONE if slow else ()) + GPT_LAYOUTS)}
    for case in HF_CASES:
        results[case] = _run(rank, world_size, case, HF_LAYOUTS)
    return results


@pytest.fixture(scope="module")
def matrix(request):
    """Every layout and model of this file in one launch of 4 processes (re-initializing smp)."""
    return run_ranks(_matrix, 4, request.config.getoption("--slow"), timeout=600)


def test_gpt_new_shapes_every_layout(matrix):
    """pp=2 x tp=2 (cache bounded at 3, warning at 4), pp=2 x rdp=2 with sharded optimizer state,
    pp=2 x tp=2 under zero_bubble_v (and with --slow pp=2 and tp=2 alone): loss and parameters
    within 1e-5 of one process; eval with another shape between training steps stays correct."""
    per_rank = [r["gpt"] for r in matrix]
    _check(per_rank, 1e-5)
    for results in per_rank:
        by_name = dict(results)
        bounded = by_name["pp2_tp2_bounded"]
        assert bounded["cache"]["cached"] <= 3 and bounded["cache"]["evictions"] > 0, bounded["cache"]
        assert len(bounded["advice"]) == 1, bounded["advice"]  # once, at the 4th signature
        advice = bounded["advice"][0]
        assert "with 4 distinct input signatures" in advice, advice
        assert "padding='max_length'" in advice and "drop_last=True" in advice, advice
        default = by_name["pp2_rdp2_sharded_zero_bubble_ordered"]["advice"]
        assert default == [], default  # 5 signatures < the default 8


def test_hf_llama_and_bert_right_padded_pp2_tp2(matrix):
    """Hugging Face Llama and BERT with right-padded attention masks at pp=2 x tp=2: within 1e-4."""
    for case in HF_CASES:
        _check([r[case] for r in matrix], 1e-4)


COMPILE_STEPS = ((8, 16), (8, 12))  # two signatures: each stage graph compiled once per signature


def _compiled(rank, world_size, layout=None):
    import smp
    from smp.engine import compiled

    ref = shape_cases.reference("gpt_small", steps=COMPILE_STEPS, optimizer="sgd")
    smp.init(PP2 | (layout or {"tensor_parallel_degree": 2}) | {"compile": True})
    before = compiled.compiles()
    r = shape_cases.train(smp, "gpt_small", ref, steps=COMPILE_STEPS, optimizer="sgd")
    r["compiles"] = compiled.compiles() - before
    smp.parallel_state.reset()
    return r


def test_compile_pp2_tp2_parity():
    """ "compile": true (inductor) at pp=2 x tp=2: within 1e-4 of one process (inductor reorders
    sums); one compilation per new signature on each rank."""
    for r in run_ranks(_compiled, 4, timeout=500):
        assert r["loss_err"] < 1e-4 and r["param_err"] < 1e-4, r
        assert r["compiles"] == len(COMPILE_STEPS), r


def test_compile_data_parallel_parity():
    """ "compile" at pp = tp = 1 (two replicas, the model running whole): the model is compiled,
    once per signature, with the gradient buckets' hooks outside the graph; within 1e-4."""
    whole = {"pipeline_parallel_degree": 1, "tensor_parallel_degree": 1}
    for r in run_ranks(_compiled, 2, whole, timeout=500):
        assert r["loss_err"] < 1e-4 and r["param_err"] < 1e-4, r
        assert r["compiles"] == len(COMPILE_STEPS), r


@pytest.mark.slow  # (tp inside a compiled stage: test_compile_pp2_tp2_parity by default)
def test_compile_tp2_parity():
    """ "compile" at tp=2 alone (pp = 1: the one stage's graph, its TP ops inside it): within 1e-4,
    once per signature."""
    for r in run_ranks(_compiled, 2, {"pipeline_parallel_degree": 1, "microbatches": 1}, timeout=500):
        assert r["loss_err"] < 1e-4 and r["param_err"] < 1e-4, r
        assert r["compiles"] == len(COMPILE_STEPS), r


@pytest.mark.slow  # (a compiled schedule: test_compile_pp2_tp2_parity by default)
def test_compile_zero_bubble_v_parity():
    """ "compile" under zero_bubble_v at pp=2: both of a rank's stages compiled, once per signature
    each (2 stages x 2 signatures), within 1e-4 of one process."""
    for r in run_ranks(_compiled, 2, {"pipeline": "zero_bubble_v"}, timeout=500):
        assert r["loss_err"] < 1e-4 and r["param_err"] < 1e-4, r
        assert r["compiles"] == 2 * len(COMPILE_STEPS), r
