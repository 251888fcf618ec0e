"""The planner's absolute step time (smp/planner/step_time.py, stage_work.py, kernels.py) against
counts worked by hand on round-figured hardware, and its one calibration re-derived."""

from __future__ import annotations

import dataclasses

import pytest
from smp import config as smp_config
from smp.planner import hardware, kernels, memory, model_facts, step_time
from smp.planner.layout import Layout
from smp.planner.runtime_costs import MEGATRON_LOCAL_DDP, SMP
from test_planner_sdp import HAND, TINY

SEQ, BATCH = 128, 8
H, LAYERS, HEADS, VOCAB = 64, 4, 4, 1000
# One layer's matrices, k x n: q/k/v 64 x 192, output 64 x 64, MLP 64 x 256 and 256 x 64.
LAYER_KN = 64 * 192 + 64 * 64 + 64 * 256 + 256 * 64
# Memory so fast that no matmul is memory-bound: the matmul time is FLOPs over the peak.
FAST_MEMORY = {**HAND, "memory_bandwidth_gbps": 1e12}


def _facts():
    return model_facts.from_hf_config(TINY, SEQ)


def _job(gpus: int = 1, hw=FAST_MEMORY, batch: int = BATCH) -> memory.Workload:
    return memory.Workload(SEQ, batch, gpus, 8, 80 * 2**30, hardware.load(hw))


def _step(layout: Layout, gpus: int = 1, hw=FAST_MEMORY, runtime=SMP, batch: int = BATCH):
    return step_time.estimate(_facts(), layout, _job(gpus, hw, batch), runtime)


def test_matmul_time_is_the_roofline_of_its_flops_and_bytes():
    hw = hardware.load(HAND)  # fp32: 10 TFLOP/s, 1000 GB/s
    assert kernels.matmul(hw, "fp32", 1024, 1024, 1024) == pytest.approx(2 * 1024**3 / 10e12)  # compute
    # [64, 64] x [64, 4096]: 33.5 MFLOP (3.4 us) against 4 x (4096 + 262144 + 262144) bytes (2.1 us):
    # compute-bound; a batch of 512 [128, 128] x [128, 8] is memory-bound (its 128 x 128 operand).
    assert kernels.matmul(hw, "fp32", 64, 4096, 64) == pytest.approx(2 * 64 * 4096 * 64 / 10e12)
    bytes_ = 4 * 512 * (128 * 128 + 128 * 8 + 128 * 8)
    assert kernels.matmul(hw, "fp32", 128, 8, 128, batch=512) == pytest.approx(bytes_ / 1000e9)


def test_small_shards_run_slower_tile_waves():
    """4 units of 2 x 2 tiles: a 3 x 4 output is 4 tiles (one wave, 12 of 16 slots useful), a
    4 x 6 output 6 tiles (two waves of 4: 24 of 32). On an A100 a tensor-parallel shard of a small
    layer fills its 108 SMs' waves worse than the whole matrix: more seconds per FLOP."""
    quad = hardware.load({**HAND, "compute_units": 4, "matmul_tiles": [[2, 2]]})
    assert kernels.wave_efficiency(quad, 3, 4) == 12 / 16
    assert kernels.wave_efficiency(quad, 4, 4) == 1.0
    assert kernels.wave_efficiency(quad, 4, 6) == 24 / 32
    a100 = hardware.load("a100-40gb")
    whole = kernels.matmul(a100, "bf16", 2048, 3 * 1024, 1024) / (2048 * 3 * 1024 * 1024)
    shard = kernels.matmul(a100, "bf16", 2048, 3 * 1024 // 8, 1024) / (2048 * 3 * 1024 // 8 * 1024)
    assert shard > 1.2 * whole


def test_links_a_group_crosses():
    """Inside a node: NVLink. Across: the network of the group's GPUs in one node (NCCL runs a
    ring per adapter), at most NVLink. Round figures: 100 GB/s NVLink, 10 GB/s network per GPU."""
    hw = hardware.load(HAND)
    assert kernels.link_bandwidth(hw, kernels.Group(8, 1), 8, 64) == 100e9  # one node
    assert kernels.link_bandwidth(hw, kernels.Group(16, 1), 8, 64) == 80e9  # 8 per node: 8 adapters
    assert kernels.link_bandwidth(hw, kernels.Group(8, 8), 8, 64) == 10e9  # one GPU of it per node
    assert kernels.link_bandwidth(hw, kernels.Group(4, 4), 8, 64) == 20e9  # two per node
    assert kernels.Group(3, 1).spans_nodes(8, 64)  # blocks of 3 straddle nodes of 8
    latency = hardware.load({**HAND, "collective_latency_us": 8, "intra_node_step_latency_us": 2})
    # An all-reduce over 4 in a node: 2 x (3/4 x bytes / bandwidth + 4 us base half + 3 steps of 2 us).
    expected = 2 * (3 / 4 * 1e6 / 100e9 + 4e-6 + 3 * 2e-6)
    assert kernels.all_reduce(latency, 1e6, kernels.Group(4, 1), 8, 64) == pytest.approx(expected)


def _matmul_flops(checkpointed: bool = False) -> float:
    """The tiny model's matmul FLOPs of one step on one GPU, by hand: weights forward, input and
    weight gradients (3 x 2 T k n); fused attention (scores and context, 2 x 2 s^2 d per head) and
    its backward at 2.5 times; the tied head (3 x 2 T h V). Checkpointing: the layers' forward again."""
    tokens = BATCH * SEQ
    weights = 2 * tokens * LAYER_KN * LAYERS
    attention = 2 * 2 * SEQ * SEQ * (H // HEADS) * HEADS * BATCH * LAYERS
    head = 2 * tokens * H * VOCAB
    total = 3 * weights + 3.5 * attention + 3 * head
    return total + (weights + attention if checkpointed else 0)


def test_a_step_by_hand_fp32_one_gpu():
    t = _step(Layout())
    assert t.matmul == pytest.approx(_matmul_flops() / 10e12)
    assert (t.tp_comm, t.pp_comm, t.bubble, t.dp_comm, t.sdp_comm) == (0, 0, 0, 0, 0)
    facts = _facts()
    params = facts.parameters
    # Memory-bound: 2 x (forward) + 3 x (backward) every saved byte; adding the gradients into the
    # kept ones (12 B per parameter); the optimizer (28 B per parameter), at the memory rate.
    saved = (facts.saved_layer.per_rank(4, 1) * LAYERS + facts.saved_before.per_rank(4, 1)) * BATCH
    saved += facts.saved_after.per_rank(4, 1) * BATCH
    rate = 1e12 * 1e9
    assert t.memory == pytest.approx((5 * saved + 12 * params) / rate, abs=0)
    assert t.optimizer == pytest.approx(28 * params / rate, abs=0)
    assert t.total == pytest.approx(sum(t.parts().values()))
    # Throughput: tokens, model FLOPs (3 forwards, no recompute) by hand, MFU of the spec peak.
    per_token = LAYERS * (2 * (4 * H * H + 4 * H + 8 * H * H + 5 * H) + 4 * SEQ * H) + 2 * VOCAB * H
    assert t.model_flops == 3 * BATCH * SEQ * per_token
    assert t.tokens_per_second_per_gpu == pytest.approx(BATCH * SEQ / t.total)
    assert t.mfu == pytest.approx(t.model_flops / t.total / 10e12)


def test_fused_attention_runs_at_the_hardwares_attention_rate():
    """Where the hardware gives a fused-attention rate (a CPU's flash kernel accumulates in fp32:
    in bf16 it runs far below the bf16 matmuls), the attention's FLOPs, forward and backward (3.5
    forwards), run at it; the other matmuls keep the matmul rate. Without it: the matmul rate."""
    attention = 3.5 * 2 * 2 * SEQ * SEQ * (H // HEADS) * HEADS * BATCH * LAYERS
    plain = _step(Layout())
    for dtype, layout in (("fp32", Layout()), ("bf16", Layout(bf16=True))):
        rates = {"bf16": 100, "fp16": 100, "fp32": 10} | {dtype: 2.5}
        slow = _step(layout, hw={**FAST_MEMORY, "attention_tflops": rates})
        default = _step(layout)
        peak = 10e12 if dtype == "fp32" else 100e12
        assert slow.matmul - default.matmul == pytest.approx(attention / 2.5e12 - attention / peak)
    same = _step(Layout(), hw={**FAST_MEMORY, "attention_tflops": {"bf16": 100, "fp16": 100, "fp32": 10}})
    assert same.matmul == pytest.approx(plain.matmul)


def test_checkpointing_runs_the_layers_forward_once_more():
    plain, each = _step(Layout()), _step(Layout(checkpointing="each"))
    assert each.matmul == pytest.approx(_matmul_flops(checkpointed=True) / 10e12)
    assert each.matmul > plain.matmul and each.memory > plain.memory


def test_tensor_parallel_collectives_by_hand():
    """Per layer two all-reduces forward, two backward (two more recomputed), plus the embedding's
    output and the head's input gradient: [T, h] fp32 all-reduced over 2 at 100 GB/s, no latency:
    2 x (1/2) x bytes / 100 GB/s each; the logits, leaving the model whole: [T, V] fp32
    all-gathered, (1/2) x bytes / 100 GB/s; the inputs brought together (ids and labels, int64
    all-gathered: 2 x (1/2) x 8 T bytes) and the vocabulary-parallel loss's all-reduces (the
    maximum, then the exponentials' sum with the target logit: 2 x 2 x (1/2) x 4 T bytes)."""
    tokens = BATCH * SEQ
    one = tokens * H * 4 / 100e9
    logits = 0.5 * tokens * TINY["vocab_size"] * 4 / 100e9
    small = (2 * 0.5 * 8 * tokens + 2 * 4 * tokens) / 100e9
    assert _step(Layout(tp=2), gpus=2).tp_comm == pytest.approx((4 * LAYERS + 2) * one + logits + small)
    checkpointed = _step(Layout(tp=2, checkpointing="each"), gpus=2)
    assert checkpointed.tp_comm == pytest.approx((6 * LAYERS + 2) * one + logits + small)
    # With a collective's latency of 1 ms: each all-reduce pays it, each all-gather (one ring
    # phase) half; under prescaled_batch the tp ranks read the same batch: no input gathers.
    latency = {**FAST_MEMORY, "collective_latency_us": 1000}
    added = _step(Layout(tp=2), gpus=2, hw=latency).tp_comm - _step(Layout(tp=2), gpus=2).tp_comm
    assert added == pytest.approx((4 * LAYERS + 2 + 2) * 1e-3 + (1 + 2) * 0.5e-3)
    prescaled = Layout(tp=2, prescaled_batch=True)
    assert _step(Layout(tp=2), gpus=2, hw=latency).tp_comm - _step(prescaled, gpus=2, hw=latency).tp_comm == (
        pytest.approx(2 * (0.5e-3 + 0.5 * 8 * tokens / 100e9))
    )


def test_bubble_from_the_timeline_and_megatrons_interleaving():
    t = _step(Layout(pp=2, microbatches=4), gpus=2)
    pipeline = t.matmul + t.memory + t.tp_comm + t.pp_comm
    assert t.bubble == pytest.approx(pipeline * 1 / 4)  # 1F1B: (pp - 1) / m
    megatron = dataclasses.replace(MEGATRON_LOCAL_DDP, virtual_stages=2)
    interleaved = _step(Layout(pp=2, microbatches=4, fp16=True), gpus=2, runtime=megatron)
    work = interleaved.matmul + interleaved.memory + interleaved.tp_comm + interleaved.pp_comm
    assert interleaved.bubble == pytest.approx(work * 1 / (2 * 4))  # (pp - 1) / (v m)
    # Megatron's chunks each send and receive: 2 x v messages of [T/m, h] fp16 per microbatch.
    message = BATCH // 4 * SEQ * H * 2 / 100e9
    assert interleaved.pp_comm == pytest.approx(4 * 2 * 2 * message)


def test_data_parallel_average_overlaps_the_last_backward_only_where_the_hardware_can():
    """Round-figured hardware runs nothing beside compute: the whole fp32 all-reduce is exposed.
    Where it can, and the backward outlasts the average, only the last 25 MiB bucket is."""
    wide = model_facts.from_hf_config({**TINY, "n_embd": 512, "n_head": 8}, SEQ)  # 12.8M parameters
    grads = 4 * wide.parameters
    assert grads > 2 * 25 * 2**20

    def step(hw, runtime=SMP, **layout):
        return step_time.estimate(wide, Layout(rdp=8, **layout), _job(8, hw), runtime)

    serial = step(FAST_MEMORY)
    assert serial.dp_comm == serial.dp_traffic == pytest.approx(2 * 7 / 8 * grads / 100e9)
    slow_compute = {**HAND, "peak_tflops": {"bf16": 1e-3, "fp16": 1e-3, "fp32": 1e-3}, "overlap": True}
    hidden = step(slow_compute)
    assert hidden.dp_traffic == serial.dp_traffic
    assert hidden.dp_comm == pytest.approx(2 * 7 / 8 * 25 * 2**20 / 100e9)
    # Megatron's local DDP averages after the backward: exposed even where it could overlap.
    after = step(slow_compute, MEGATRON_LOCAL_DDP, fp16=True)
    assert after.dp_comm == after.dp_traffic == pytest.approx(2 * 7 / 8 * 2 * wide.parameters / 100e9)


def test_a_sharded_optimizer_gathers_the_updated_chunks():
    plain, sharded = _step(Layout(rdp=8), gpus=8), _step(Layout(rdp=8, shard_optimizer_state=True), gpus=8)
    gather = 7 / 8 * 4 * _facts().parameters / 100e9
    assert sharded.dp_comm == pytest.approx(plain.dp_comm + gather)
    assert sharded.optimizer == pytest.approx(plain.optimizer / 8)


def test_the_h200_calibration_is_smps_own_measured_step():
    """The presets' sustained fraction is smp's GPT-2-medium compiled bf16 step on one H200
    (docs/benchmarks.md: 150,306 tokens/s of batch 8 x 1024) over this model's time for it with
    no step-level loss: re-derived here, and the H200 preset then predicts that step."""
    medium = {**TINY, "n_embd": 1024, "n_layer": 24, "n_head": 16, "vocab_size": 50257, "n_positions": 1024}
    facts = model_facts.from_hf_config(medium, 1024)
    measured = 8 * 1024 / 150_306
    h200 = hardware.load("h200")
    unit = dataclasses.replace(h200, sustained_fraction=1.0)
    modelled = step_time.estimate(facts, Layout(bf16=True), memory.Workload(1024, 8, 1, 8, h200.memory, unit))
    assert h200.sustained_fraction == pytest.approx(modelled.total / measured, abs=0.001)
    calibrated = step_time.estimate(
        facts, Layout(bf16=True), memory.Workload(1024, 8, 1, 8, h200.memory, h200)
    )
    assert calibrated.total == pytest.approx(measured, rel=0.01)
    assert calibrated.mfu * 989 / 798 == pytest.approx(0.461, abs=0.01)  # its MFU of the measured peak


def test_the_layout_takes_smps_own_default_of_microbatches_in_flight(monkeypatch):
    assert Layout(pp=4, microbatches=16).active == 6 and Layout(pp=4, microbatches=3).active == 3
    monkeypatch.setattr(smp_config.Config, "num_active_microbatches", property(lambda c: 1))
    assert Layout(pp=4, microbatches=16).active == 1  # read from smp.config, not recomputed


def test_transcendental_work_costs_a_cpu_core_per_element():
    """A module's exp/tanh/log/softmax elements are counted per part (measured_facts.py): GPT-2's
    gelu_new (tanh over [seq, 4 hidden]) in each layer's forward, its loss's log-softmax over the
    logits forward and (exp of it) backward; each costs the hardware's transcendental_ns, cut
    like the layer's bytes under TP (the loss vocabulary-parallel), and nothing where it is 0."""
    from smp.planner import measured_facts
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=512, n_positions=SEQ, n_embd=H, n_layer=2, n_head=HEADS)
    facts = measured_facts.from_module(lambda: GPT2LMHeadModel(config), SEQ)
    assert facts.layer_transcendental == SEQ * 4 * H  # tanh, forward
    assert facts.layer_transcendental_backward == 0  # tanh's backward reads its saved output
    assert facts.head_transcendental == 2 * SEQ * 512  # log-softmax forward, and exp backward
    with pytest.raises(ValueError, match="transcendental_ns must be a positive number"):
        hardware.load({**HAND, "transcendental_ns": -1})
    plain = hardware.load(HAND)  # without the field: 0, as on a GPU
    slow = dataclasses.replace(plain, transcendental_ns=5.0)
    elements = 2 * facts.layer_transcendental + facts.head_transcendental  # two layers and the head
    added = {}
    for tp in (1, 2):
        layout = Layout(tp=tp, rdp=1)
        job = memory.Workload(SEQ, 1, tp, 8, 80 * 2**30, plain)
        base = step_time.estimate(facts, layout, job).total
        added[tp] = step_time.estimate(facts, layout, dataclasses.replace(job, hardware=slow)).total - base
    assert added[1] == pytest.approx(elements * 5e-9, rel=1e-6)
    # TP: the loss's half exactly; the layers' tanh as their cut bytes (the MLP's, mostly).
    assert elements / 2 * 5e-9 < added[2] < 0.6 * added[1]
