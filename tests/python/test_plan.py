"""The config planner (smp.plan / python -m smp.plan): the Best Practices seed's reference table,
the walk's order, its outputs, its errors, and its memory model against real smp runs on CPU."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import warnings

import plan_validation
import pytest
import smp
from harness import run_ranks
from smp import config as smp_config
from smp.planner import cli

SEQ = 512
VOCAB = 50000  # the seed's "vocabulary size of 50,000"


def _gpt2(hidden: int, layers: int, heads: int) -> dict:
    # GPT-2's own config keys (a config.json holds these), at the seed's sizes.
    return {
        "model_type": "gpt2",
        "n_embd": hidden,
        "n_layer": layers,
        "n_head": heads,
        "vocab_size": VOCAB,
        "n_positions": SEQ,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
    }


# The seed's reference table (GPT-2, sequence 512, ml.p4d.24xlarge: 8 x A100 40 GB per node). Its
# batch_size is per model replica (prescaled: one batch per TP group); the global batch is that
# times the replicas. Model shapes are GPT-2's at 10B, 30B and 60B parameters.
REFERENCE = {
    "10B": (_gpt2(4096, 48, 32), 16, 40, {"tensor_parallel_degree": 4}),
    "30B": (_gpt2(7168, 48, 56), 16, 32, {"tensor_parallel_degree": 8}),
    "60B": (
        _gpt2(8192, 74, 64),
        32,
        56,
        {
            "tensor_parallel_degree": 8,
            "pipeline_parallel_degree": 2,
            "microbatches": 4,
            "active_microbatches": 2,
        },
    ),
}
SEED_CHOICES = {"shard_optimizer_state": True, "prescaled_batch": True, "activation_checkpointing": "each"}


def _job(row: str) -> dict:
    model, nodes, batch, degrees = REFERENCE[row]
    gpus = nodes * 8
    replicas = gpus // (degrees["tensor_parallel_degree"] * degrees.get("pipeline_parallel_degree", 1))
    return {
        "model": model,
        "seq_len": SEQ,
        "global_batch": batch * replicas,
        "gpus": gpus,
        "gpu_memory": "40GiB",
    }


@pytest.mark.parametrize("row", sorted(REFERENCE))
def test_reference_rows_fit_as_the_seed_configured_them(row):
    """Under SMP v1's gradient buffers (on which the seed measured) every row fits in 40 GiB."""
    layout = {**REFERENCE[row][3], **SEED_CHOICES, "fp16": True}
    result = smp.plan(**_job(row), layout=layout, runtime="smp_v1")
    evaluated = result.to_json()["evaluated"]
    assert evaluated["fits"], evaluated
    assert 10 < evaluated["breakdown"]["total_gib"] <= 40


@pytest.mark.parametrize("row", sorted(REFERENCE))
def test_reference_rows_fit_smps_own_buffers(row):
    """Under smp's own buffers (one fp32 gradient per parameter averaged in place; with one
    microbatch, only each rank's chunk of it: sharded gradients) every row fits as configured."""
    layout = {**REFERENCE[row][3], **SEED_CHOICES, "fp16": True}
    evaluated = smp.plan(**_job(row), layout=layout).to_json()["evaluated"]
    assert evaluated["fits"], evaluated
    # Sharded gradients where there is one microbatch: the gradients are this rank's chunk.
    grads = evaluated["breakdown"]["gradients_gib"]
    params = evaluated["breakdown"]["parameters_gib"]  # 2 bytes each (fp16)
    assert grads < params / 2 if REFERENCE[row][3].get("microbatches", 1) == 1 else grads > params


def test_the_seeds_first_fit_follows_its_order():
    """The seed's order: sharded state and checkpointing before tensor parallelism. With sharded
    gradients at one microbatch the 10B job fits data-parallel in 40 GiB; in 24 GiB it takes tp2."""
    job = _job("10B")
    first = smp.plan(**job, precision="fp16").first_fit.layout.smp_config()
    assert first == {
        **first,
        "tensor_parallel_degree": 1,
        "pipeline_parallel_degree": 1,
        "shard_optimizer_state": True,
        "activation_checkpointing": "each",
    }
    smaller = smp.plan(**(job | {"gpu_memory": "24GiB"}), precision="fp16").first_fit.layout.smp_config()
    assert smaller == {**smaller, "tensor_parallel_degree": 2, "shard_optimizer_state": True}


def test_zero_bubble_v_places_two_half_stages_per_rank():
    """Under "zero_bubble_v" rank r holds stages r and 2p-1-r of 2p: rank 0 the embeddings and the
    head (so no replica of the tied weight), every rank its layers of two quarter-splits, and every
    rank keeps min(active, pp, m) microbatches' worth of its layers (2x as many half-size stages)."""
    from smp.planner import memory, model_facts
    from smp.planner.layout import Layout

    facts = model_facts.from_hf_config(REFERENCE["60B"][0], SEQ)  # 74 layers
    v = Layout(pp=2, tp=8, microbatches=4, active_microbatches=2, pipeline="zero_bubble_v")
    one = v.replace(pipeline="interleaved")
    layer, before, after, tied = (x.per_rank(8) for x in (facts.layer, facts.before, facts.after, facts.tied))
    # 74 layers over 4 stages: 19, 19, 18, 18; rank 0 = stages 0 and 3, rank 1 = stages 1 and 2.
    assert memory.stage_parameters(facts, v, 0) == 37 * layer + before + after
    assert memory.stage_parameters(facts, v, 1) == 37 * layer
    assert memory.stage_parameters(facts, one, 1) == 37 * layer + after + tied
    assert [memory.alive(v, r) for r in (0, 1)] == [2, 2]
    assert [memory.alive(one, r) for r in (0, 1)] == [2, 1]


def test_step_time_bubble_follows_the_schedule():
    """The bubble is read off the schedule's own timeline: 1F1B's and GPipe's (pp - 1) / m, and
    less for the zero-bubble schedules, ZB-V least."""
    from smp import schedules as schedule
    from smp.planner.layout import Layout
    from smp.planner.step_time import bubble_share

    for pp, m in ((2, 4), (2, 8), (4, 8), (8, 32)):
        shares = {s: bubble_share(Layout(pp=pp, microbatches=m, pipeline=s)) for s in schedule.SCHEDULES}
        assert shares["interleaved"] == pytest.approx((pp - 1) / m) == shares["simple"]
        assert shares["zero_bubble_v"] < shares["zero_bubble"] < shares["interleaved"], shares
    assert bubble_share(Layout(pp=1, microbatches=4)) == 0.0


@pytest.mark.parametrize("runtime", ["smp", "smp_v1"])
def test_obviously_too_large_does_not_fit(runtime):
    ten_b = REFERENCE["10B"][0]
    alone = smp.plan(ten_b, seq_len=SEQ, global_batch=8, gpus=1, layout={}, runtime=runtime).evaluated
    assert not alone.fits and alone.breakdown.total > 100 * 2**30
    assert "does not fit" in alone.reason
    sixty_b = REFERENCE["60B"][0]
    one_node = smp.plan(sixty_b, seq_len=SEQ, global_batch=64, gpus=8, runtime=runtime)
    assert one_node.recommended is None
    assert all(not c.fits for c in one_node.candidates)


@pytest.mark.parametrize("runtime", ["smp", "smp_v1"])
@pytest.mark.parametrize("row", sorted(REFERENCE))
def test_recommendation_fits_and_follows_the_seeds_order(row, runtime):
    result = smp.plan(**_job(row), precision="fp16", runtime=runtime)
    chosen, first = result.recommended_candidate, result.first_fit
    fits = [c for c in result.candidates if c.fits]
    assert chosen is not None and chosen.fits and first is fits[0]
    assert chosen.time.total == min(c.time.total for c in fits)  # the fastest of those that fit
    assert result.speedup == first.time.total / chosen.time.total >= 1.0
    config = first.layout.smp_config()
    tp = config["tensor_parallel_degree"]
    assert tp & (tp - 1) == 0 and tp <= 8  # a power of two within a node
    # The list's order: sharding before checkpointing before TP before PP; each kept once taken.
    steps = [c.step.split(".")[0] for c in result.candidates if c.step[0].isdigit()]
    assert steps == sorted(steps, key=int)
    for c in result.candidates:
        if c.layout.tp > 1:  # TP only once the optimizer state is sharded and layers checkpointed
            assert c.layout.shard_optimizer_state and c.layout.checkpointing != "none"
        if c.layout.pp > 1:  # pipelining only once TP fills a node
            assert c.layout.tp == 8
    assert config["shard_optimizer_state"] and config["activation_checkpointing"] == "each"
    assert config["prescaled_batch"] == (tp > 1)
    # A ready config: smp.init accepts it (less the checkpointing strategy, applied by a call).
    for ready in (config, result.recommended):
        smp_config.parse({k: v for k, v in ready.items() if k != "activation_checkpointing"})


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(REFERENCE["10B"][0]))
    return str(path)


JOB_ARGS = ("--seq-len", "512", "--global-batch", "1280", "--gpus", "128", "--gpus-per-node", "8")


def test_json_shapes(config_json):
    code, out, _ = _cli("--model", config_json, *JOB_ARGS, "--gpu-memory", "40GiB", "--json")
    assert code == 0
    walked = json.loads(out)
    assert set(walked) == {"recommended", "first_fit", "speedup_over_first_fit", "hardware", "candidates"}
    fits = [c for c in walked["candidates"] if c["fits"]]
    fastest = min(fits, key=lambda c: c["step_time"]["seconds"])
    assert walked["recommended"] == fastest["config"] and walked["first_fit"] == fits[0]["config"]
    assert walked["speedup_over_first_fit"] == pytest.approx(
        fits[0]["step_time"]["seconds"] / fastest["step_time"]["seconds"], rel=2e-3
    )
    for c in walked["candidates"]:
        assert {
            "step",
            "config",
            "memory_gib",
            "fits",
            "reason",
            "breakdown",
            "step_time",
            "throughput",
        } <= set(c)
        assert {"tokens_per_s_per_gpu", "tflops_per_gpu", "mfu"} == set(c["throughput"])
        assert {
            "parameters_gib",
            "gradients_gib",
            "optimizer_state_gib",
            "masters_gib",
            "activations_gib",
        } <= set(c["breakdown"])
        assert {"communication_gib", "margin_gib", "total_gib"} <= set(c["breakdown"])
    layout = json.dumps({"tensor_parallel_degree": 4, "activation_checkpointing": "group_2"})
    code, out, _ = _cli("--model", config_json, *JOB_ARGS, "--layout", layout, "--json")
    evaluated = json.loads(out)
    assert set(evaluated) == {"evaluated"}
    assert set(evaluated["evaluated"]) == {
        "config",
        "memory_gib",
        "fits",
        "breakdown",
        "step_time",
        "throughput",
    }
    assert evaluated["evaluated"]["config"]["activation_checkpointing"] == "group_2"
    assert isinstance(evaluated["evaluated"]["fits"], bool)


def test_table_output(config_json):
    # bf16 (the default): sharded data parallelism comes before tensor parallelism, where the
    # layers fit one GPU (test_planner_sdp.py); smp's sdp does not run fp16, which takes tp 2.
    code, out, _ = _cli("--model", config_json, *JOB_ARGS, "--gpu-memory", "24GiB")
    assert code == 0
    assert "recommended (the fastest that fits): " in out and "  config: {" in out
    assert "4. sharded data parallelism 16: fits" in out and "does not fit" in out
    code, out, _ = _cli("--model", config_json, *JOB_ARGS, "--gpu-memory", "24GiB", "--precision", "fp16")
    assert code == 0 and "4. tensor parallelism 2: fits" in out


def test_python_dash_m_and_the_function_share_the_name(config_json, monkeypatch, capsys):
    # `python -m smp.plan` runs smp/plan.py as __main__ (runpy is what -m uses).
    argv = ["smp.plan", "--model", config_json, *JOB_ARGS, "--gpu-memory", "24GiB", "--json"]
    monkeypatch.setattr(sys, "argv", argv)
    with warnings.catch_warnings(), pytest.raises(SystemExit) as done:
        warnings.simplefilter("ignore", RuntimeWarning)  # smp.plan may already be imported
        runpy.run_module("smp.plan", run_name="__main__", alter_sys=True)
    assert done.value.code == 0
    by_module = json.loads(capsys.readouterr().out)
    assert by_module["first_fit"]["sharded_data_parallel_degree"] == 16
    import smp.plan  # noqa: F401  (rebinds the attribute smp.plan to the module: still callable)

    result = smp.plan(config_json, seq_len=512, global_batch=1280, gpus=128, gpu_memory="24GiB")
    assert result.first_fit.layout.sdp == 16 and result.recommended == by_module["recommended"]


@pytest.mark.parametrize(
    ("layout", "memory", "message"),
    [
        (
            {"pipline_parallel_degree": 2},
            "40GiB",
            "unknown key 'pipline_parallel_degree'; did you mean 'pipeline_par",
        ),
        ({"tensor_parallel_degree": 3}, "40GiB", "does not divide the 128 GPUs"),
        ({"tensor_parallel_degree": 64}, "40GiB", "tensor_parallel_degree 64 does not divide the model's"),
        (
            {"tensor_parallel_degree": 4, "reduced_data_parallel_degree": 16},
            "40GiB",
            "set reduced_data_parallel_degree to 32",
        ),
        ({"activation_checkpointing": "every"}, "40GiB", "activation_checkpointing 'every' is not"),
        ({"microbatches": 3}, "40GiB", "does not split into 3 microbatches"),
        ({"fp16": "yes"}, "40GiB", "'fp16' must be true or false"),
        (None, "40 gigs", "cannot read the memory size '40 gigs'; write a number and a unit"),
    ],
)
def test_bad_input_is_a_clear_error(config_json, layout, memory, message):
    args = ["--model", config_json, *JOB_ARGS, "--gpu-memory", memory]
    if layout is not None:
        args += ["--layout", json.dumps(layout)]
    code, out, err = _cli(*args)
    assert code == 2 and out == ""
    assert message in err, err


def test_bad_input_from_python():
    ten_b = REFERENCE["10B"][0]
    with pytest.raises(ValueError, match="does not divide the model's 32 attention heads"):
        smp.plan(ten_b, seq_len=SEQ, global_batch=8, gpus=24, layout={"tensor_parallel_degree": 3})
    with pytest.raises(ValueError, match="has no layer count"):
        smp.plan({"n_embd": 8, "n_head": 2, "vocab_size": 10}, seq_len=8, global_batch=8, gpus=1)
    code, _, err = _cli("--model", "missing.json", *JOB_ARGS, "--layout", "{")
    assert code == 2 and "--layout is not valid JSON" in err
    code, _, err = _cli("--model", "missing.json", *JOB_ARGS)
    assert code == 2 and "cannot read the model config 'missing.json'" in err


@pytest.fixture(scope="module")
def validation():
    """One two-rank launch for every test that needs real runs or transformers (plan_validation.run)."""
    return run_ranks(plan_validation.run, 2, timeout=240)


def test_memory_model_against_real_smp_runs_on_cpu(validation):
    """Five layouts on two ranks: the planner's parameters + gradients + optimizer state +
    saved activations within 10% of what the fullest rank held (plan_validation.py says how),
    from the module's measured counts and from its config's formula alike."""
    predicted = validation[0]["predicted"]
    for i, (name, _) in enumerate(plan_validation.LAYOUTS):
        held = max(
            sum(r["measured"][i][k] for k in ("parameters", "gradients", "optimizer", "activations"))
            for r in validation
        )
        for source, estimate in predicted[name].items():
            assert abs(estimate / held - 1) <= 0.10, (name, source, estimate, held)


def test_a_module_is_measured_and_agrees_with_its_config(validation):
    facts = validation[0]["facts"]
    assert facts["module"]["source"].startswith("measured on GPT2LMHeadModel")
    assert facts["module"]["parameters"] == facts["config"]["parameters"]
    assert facts["module"]["tied"] == facts["config"]["tied"] == 512 * 128


def test_llama_and_bert_configs_count_their_parameters(validation):
    """The counts from GPT-2, Llama and BERT configs against the models transformers builds."""
    for name, (planned, real) in validation[1]["parameters"].items():
        # BERT's masked-LM head has a dense transform and a vocabulary bias the generic head lacks.
        assert abs(planned - real) / real < (0.15 if "Bert" in name else 0.001), (name, planned, real)
