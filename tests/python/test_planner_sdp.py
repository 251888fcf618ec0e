"""The config planner's sharded data parallelism (sdp, SMP v1's sharded_data_parallel_degree on
FSDP2): its memory terms and traffic against numbers worked by hand, where the walk places it,
its errors, and the Layout <-> config round trip."""

from __future__ import annotations

import json

import pytest
import smp
from smp.planner import hardware, memory, model_facts, step_time
from smp.planner.layout import Layout, from_config
from smp.planner.walk import sdp_degrees
from test_plan import _cli

# A small GPT-2 whose counts are easy to do by hand (hidden h = 64, tied head):
# one layer: attention 4h^2 + 4h = 16640, MLP 8h^2 + 5h = 33088, two LayerNorms 4h = 256: 49984;
# token embeddings 1000 x 64 = 64000 + positions 128 x 64 = 8192: 72192; final norm 2h = 128.
# Total 4 x 49984 + 72192 + 128 = 272256; the root unit (all but the layers) 72320.
TINY = {
    "model_type": "gpt2",
    "n_embd": 64,
    "n_layer": 4,
    "n_head": 4,
    "vocab_size": 1000,
    "n_positions": 128,
    "activation_function": "gelu_new",
}
LAYER, ROOT, TOTAL = 49984, 72192 + 128, 272256
# Round figures, nothing lost to efficiency or latency, communication not overlapped: traffic by
# hand. 100 GB/s inside a node, 10 GB/s of network per GPU.
NVLINK, NETWORK = 100e9, 10e9
HAND = {
    "description": "round figures for hand counts",
    "peak_tflops": {"bf16": 100, "fp16": 100, "fp32": 10},
    "matmul_efficiency": 1.0,
    "compute_units": 1,
    "matmul_tiles": [[1, 1]],
    "memory": "80GiB",
    "memory_bandwidth_gbps": 1000,
    "memory_efficiency": 1.0,
    "gpus_per_node": 8,
    "intra_node_gbps": 100,
    "inter_node_gbps": 10,
    "link_efficiency": 1.0,
    "collective_latency_us": 0,
    "intra_node_step_latency_us": 0,
    "inter_node_step_latency_us": 0,
    "kernel_overhead_us": 0,
    "sustained_fraction": 1.0,
    "overlap": False,
}


def _tiny():
    return model_facts.from_hf_config(TINY, 128)


def _job(gpus: int, per_node: int = 8) -> memory.Workload:
    return memory.Workload(
        seq_len=128,
        global_batch=gpus,
        gpus=gpus,
        gpus_per_node=per_node,
        gpu_memory=80 * 2**30,
        hardware=hardware.load(HAND),
    )


def test_the_tiny_models_counts_are_the_hand_counts():
    facts = _tiny()
    root = facts.before.total + facts.after.total
    assert (facts.layer.total, root, facts.parameters) == (LAYER, ROOT, TOTAL)


def test_sdp_2_fp32_adam_memory_by_hand():
    """sdp = 2, fp32, Adam: (4 + 4 + 8) / 2 = 8 bytes per parameter of shards, plus the live
    working set: 2 layers' parameters and gradients in fp32 (2 x 49984 x 8 = 799744), the root's
    (72320 x 8 = 578560), and one layer's fp32 reduce-scatter input (4 x 49984 = 199936)."""
    b = memory.estimate(_tiny(), Layout(rdp=2, sdp=2), _job(2))
    assert b.parameters == 4 * TOTAL / 2 == 544512
    assert b.gradients == 4 * TOTAL / 2 == 544512
    assert b.optimizer_state == 8 * TOTAL / 2 == 1089024
    assert b.masters == 0  # the fp32 shards are the parameters the optimizer steps
    assert (b.parameters + b.gradients + b.optimizer_state) / TOTAL == 8.0
    assert b.gathered == 2 * LAYER * (4 + 4) + ROOT * (4 + 4) == 1378304
    assert b.communication == 4 * LAYER == 199936  # pp = tp = 1: nothing else in flight
    # The peak is in the backward: every term above at once, with the activations.
    rest = b.activations + b.recompute + b.working
    assert b.peak == pytest.approx(544512 + 544512 + 1089024 + 1378304 + 199936 + rest)


def test_sdp_4_and_bf16_by_hand():
    """sdp = 4 halves the shards again (16 / 4 = 4 bytes per parameter); under bf16 the shards
    stay fp32 (no separate masters) and only the gathered copies are 2 bytes."""
    four = memory.estimate(_tiny(), Layout(rdp=4, sdp=4), _job(4))
    assert four.parameters + four.gradients + four.optimizer_state == 16 * TOTAL / 4 == 1089024
    assert four.gathered == 1378304  # the live set does not shrink with the degree
    bf16 = memory.estimate(_tiny(), Layout(rdp=2, sdp=2, bf16=True), _job(2))
    state = (bf16.parameters, bf16.gradients, bf16.optimizer_state, bf16.masters)
    assert state == (544512, 544512, 1089024, 0)
    assert bf16.gathered == 2 * LAYER * (2 + 2) + ROOT * (2 + 2) == 689152


def test_sdp_keeps_the_activations_and_beats_plain_data_parallelism():
    facts = _tiny()
    for half in ({}, {"bf16": True}):
        for checkpointing in ("none", "each"):
            base = Layout(rdp=2, checkpointing=checkpointing, **half)
            plain = memory.estimate(facts, base, _job(2))
            sharded = memory.estimate(facts, base.replace(sdp=2), _job(2))
            assert (sharded.activations, sharded.recompute) == (plain.activations, plain.recompute)
    plain = memory.estimate(facts, Layout(rdp=2), _job(2))
    assert (plain.parameters + plain.gradients + plain.optimizer_state) / TOTAL == 16.0  # 4 + 4 + 8


def test_sdp_general_case_shards_the_tp_shard_of_the_stage():
    """Written for the general case: under pp = 2 x tp = 2 a rank shards its TP shard of its
    stage's parameters over the sdp group, and gathers only its stage's layers and root part."""
    facts = _tiny()
    general = Layout(pp=2, tp=2, rdp=2, sdp=2, microbatches=2)
    for stage in (0, 1):
        p = memory.stage_parameters(facts, general, stage)
        layers = memory.held(general, stage, facts.layers)[0]
        root = p - layers * facts.layer.per_rank(2)
        assert memory.sdp_parameters(general, p) == 4 * p / 2
        assert memory.sdp_live_layers(facts, general, stage) == 2 * facts.layer.per_rank(2) * 8
        assert memory.sdp_root(facts, general, stage) == root * 8
    # Stage 0: the embeddings, the token table cut over TP (64000 / 2 + 8192 positions); stage 1:
    # the final norm and, the head being tied, a replica of the token table's TP shard.
    assert memory.sdp_root(facts, general, 0) == (32000 + 8192) * 8
    assert memory.sdp_root(facts, general, 1) == (128 + 32000) * 8


def test_sdp_traffic_by_hand():
    """Per layer: two all-gathers (forward, backward) in the compute dtype and a reduce-scatter in
    fp32; the root gathered and reduced once; each moves (N - 1) / N. With rdp > N the fp32
    shards are all-reduced over the rdp / N replicas; plain data parallelism's all-reduce is gone."""
    facts, job = _tiny(), _job(8)
    gathered, reduced = (2 * 4 * LAYER + ROOT) * 4, (4 * LAYER + ROOT) * 4
    assert (gathered, reduced) == (1888768, 1089024)
    hybrid = step_time.estimate(facts, Layout(rdp=8, sdp=2), job)
    assert hybrid.sdp_comm == pytest.approx(0.5 * (1888768 + 1089024) / NVLINK)
    assert hybrid.dp_comm == pytest.approx(2 * 3 / 4 * (4 * TOTAL / 2) / NVLINK)  # 4 replicas
    whole = step_time.estimate(facts, Layout(rdp=8, sdp=8), job)
    assert whole.dp_comm == 0 and whole.sdp_comm == pytest.approx(7 / 8 * 2977792 / NVLINK)
    plain = step_time.estimate(facts, Layout(rdp=8), job)
    assert plain.sdp_comm == 0 and plain.dp_comm == pytest.approx(2 * 7 / 8 * 4 * TOTAL / NVLINK)
    bf16 = step_time.estimate(facts, Layout(rdp=8, sdp=2, bf16=True), job)
    assert bf16.sdp_comm == pytest.approx(0.5 * (gathered / 2 + reduced) / NVLINK)
    # A group of 16 on nodes of 8 crosses them: its 8 GPUs of a node share their 8 adapters.
    across = step_time.estimate(facts, Layout(rdp=16, sdp=16), _job(16))
    assert across.sdp_comm == pytest.approx(15 / 16 * 2977792 / (8 * NETWORK))


def test_degrees_inside_a_node_come_first():
    """Smallest first, but a group that divides the node (6 GPUs here) before one that does not."""
    assert sdp_degrees(Layout(rdp=24), _job(24, per_node=6)) == [2, 3, 6, 4, 8, 12, 24]
    assert sdp_degrees(Layout(rdp=8), _job(8)) == [2, 4, 8]
    assert sdp_degrees(Layout(rdp=1), _job(1)) == []


# GPT-2 at 10B (hidden 4096, 48 layers, 32 heads): its state does not fit 24 GiB data-parallel,
# even with sharded optimizer state and checkpointing (its bf16 parameters alone are 18.4 GiB),
# but one layer does; 128 GPUs on nodes of 8.
TEN_B = {**TINY, "n_embd": 4096, "n_layer": 48, "n_head": 32, "vocab_size": 50000, "n_positions": 512}
TEN_B_JOB = {"seq_len": 512, "global_batch": 1280, "gpus": 128, "gpus_per_node": 8, "gpu_memory": "24GiB"}


def test_the_walk_tries_sdp_before_tensor_and_pipeline_parallelism():
    result = smp.plan(TEN_B, **TEN_B_JOB, precision="bf16")
    config = result.first_fit.layout.smp_config()
    assert config == {
        **config,
        "sharded_data_parallel_degree": 16,  # 8 (a node) is not enough: 30.7 GiB
        "shard_optimizer_state": False,
        "tensor_parallel_degree": 1,
        "pipeline_parallel_degree": 1,
        "activation_checkpointing": "each",
    }
    sdp = [c for c in result.candidates if c.layout.sdp > 1 and c.layout.tp == 1]
    # Every degree, smallest first; 16 the first that fits, before any TP or PP layout.
    assert [c.step for c in sdp] == [f"4. sharded data parallelism {n}" for n in (2, 4, 8, 16, 32, 64, 128)]
    assert [c.fits for c in sdp] == [False, False, False, True, True, True, True]
    assert result.candidates.index(result.first_fit) < min(
        i for i, c in enumerate(result.candidates) if c.layout.tp > 1 or c.layout.pp > 1
    )
    # The same job in fp16, which smp's sdp does not run: tensor parallelism, and a note why.
    fp16 = smp.plan(TEN_B, **TEN_B_JOB, precision="fp16")
    assert fp16.first_fit.layout.tp == 2
    assert all(c.layout.sdp == 1 for c in fp16.candidates)
    assert any("sharded data parallelism: skipped" in n and "fp16" in n for n in fp16.notes)


# 16 layers of hidden 16384: one layer gathered with its gradients does not fit a 26 GiB GPU
# whatever the sdp degree, so tensor parallelism comes first; TP 8 alone does not fit either.
WIDE = {**TEN_B, "n_embd": 16384, "n_layer": 16, "n_head": 128}
WIDE_JOB = {"seq_len": 512, "global_batch": 64, "gpus": 64, "gpus_per_node": 8, "gpu_memory": "26GiB"}


def test_layers_that_do_not_fit_one_gpu_take_tensor_parallelism_then_sdp_before_pp():
    result = smp.plan(WIDE, **WIDE_JOB)
    notes = "\n".join(result.notes)
    assert "sharded data parallelism: skipped, the layers themselves do not fit one GPU: even sdp=64" in notes
    config = result.first_fit.layout.smp_config()
    assert config == {
        **config,
        "tensor_parallel_degree": 8,
        "sharded_data_parallel_degree": 8,
        "pipeline_parallel_degree": 1,
    }
    tp8 = [c.layout.sdp for c in result.candidates if c.layout.tp == 8 and c.layout.pp == 1]
    assert tp8 == [1, 2, 4, 8]
    assert result.candidates.index(result.first_fit) < min(
        i for i, c in enumerate(result.candidates) if c.layout.pp > 1
    )
    both = {"tensor_parallel_degree": 8, "sharded_data_parallel_degree": 8}
    evaluated = smp.plan(WIDE, **WIDE_JOB, layout=both)
    assert evaluated.evaluated.layout.sdp == 8


def test_layout_round_trips_through_the_config_dict():
    sharded = Layout(rdp=8, sdp=4, bf16=True, checkpointing="each", active_microbatches=1)
    config = sharded.smp_config()
    assert config["sharded_data_parallel_degree"] == 4 and config["shard_optimizer_state"] is False
    assert from_config(config, 8) == sharded
    assert from_config(json.loads(json.dumps(config)), 8) == sharded  # as --layout passes it
    plain = Layout(rdp=8, shard_optimizer_state=True, active_microbatches=1)
    assert plain.smp_config()["sharded_data_parallel_degree"] == 1
    assert from_config(plain.smp_config(), 8) == plain
    assert from_config({}, 8).sdp == 1
    assert "sdp=4" in sharded.describe() and "sdp" not in plain.describe()


@pytest.fixture
def ten_b_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TEN_B))
    return str(path)


ARGS = ("--seq-len", "512", "--global-batch", "1280", "--gpus", "128", "--gpu-memory", "24GiB")


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (
            {"sharded_data_parallel_degree": 3},
            "sharded_data_parallel_degree 3 does not divide the reduced data parallel degree 128 "
            "(GPUs / (pp x tp)); choose one of [1, 2, 4, 8, 16, 32, 64, 128]",
        ),
        (
            {"sharded_data_parallel_degree": 3, "tensor_parallel_degree": 2},
            "does not divide the reduced data parallel degree 64",
        ),
        (
            {"sharded_data_parallel_degree": 2, "shard_optimizer_state": True},
            "set shard_optimizer_state to false, or sharded_data_parallel_degree to 1",
        ),
        ({"sharded_data_parallel_degree": 2, "fp16": True}, 'plan it with "bf16": true'),
        (
            {"sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2, "pipeline": "zero_bubble"},
            "use pipeline 'interleaved' or 'simple'",
        ),
        ({"sharded_data_parallel_degree": 0}, "sharded_data_parallel_degree must be a positive integer"),
        ({"sharded_data_parallel_degre": 2}, "did you mean 'sharded_data_parallel_degree'?"),
    ],
)
def test_bad_sdp_is_a_clear_error(ten_b_json, layout, message):
    code, out, err = _cli("--model", ten_b_json, *ARGS, "--layout", json.dumps(layout))
    assert code == 2 and out == ""
    assert message in err, err


def test_the_report_prints_the_sdp_degree(ten_b_json):
    code, out, _ = _cli("--model", ten_b_json, *ARGS)
    assert code == 0
    assert "pp=1, tp=1, rdp=128, sdp=16, checkpoint each" in out
    assert "4. sharded data parallelism 16: fits" in out
    code, out, _ = _cli("--model", ten_b_json, *ARGS, "--json")
    walked = json.loads(out)
    assert walked["first_fit"]["sharded_data_parallel_degree"] == 16
    chosen = next(c for c in walked["candidates"] if c["config"] == walked["first_fit"])
    assert chosen["breakdown"]["gathered_gib"] > 0 and chosen["step_time"]["sdp_comm_s"] > 0
    layout = json.dumps({"sharded_data_parallel_degree": 16, "bf16": True})
    code, out, _ = _cli("--model", ten_b_json, *ARGS, "--layout", layout, "--json")
    assert json.loads(out)["evaluated"]["config"]["sharded_data_parallel_degree"] == 16
