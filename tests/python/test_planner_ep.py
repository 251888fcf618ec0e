"""The planner counts mixtures of experts and expert parallelism (docs/planner.md, "Mixtures of
experts", docs/expert_parallel.md): E experts' parameters but top_k experts' compute per token, each
ep rank holding E/ep experts of every MoE layer (whole, also under tensor parallelism), the
all-to-alls around the experts, and a walk that raises ep before tensor and pipeline parallelism and
then tries their layouts with ep too."""

from __future__ import annotations

import pytest
import smp
from smp.planner import hardware, kernels, memory, model_facts, model_presets, step_time
from smp.planner.facts import Params
from smp.planner.layout import Layout, from_config

MIXTRAL = model_presets.MIXTRAL_8X7B
SEQ = 4096


def _facts(config=MIXTRAL, seq: int = SEQ):
    return model_facts.from_hf_config(config, seq)


def _workload(gpus: int, batch: int, hw: str = "h200", per_node: int = 8) -> memory.Workload:
    hw_ = hardware.load(hw)
    return memory.Workload(SEQ, batch, gpus, min(gpus, per_node), hw_.memory, hw_)


def test_mixtral_parameters_count_every_expert_and_tokens_use_top_k():
    """Mixtral-8x7B: 46.7B parameters, 12.9B of them per token (Mistral AI's figures)."""
    facts = _facts()
    assert (facts.experts, facts.top_k, facts.moe_layers) == (8, 2, 32)
    assert facts.parameters == pytest.approx(46.7e9, rel=0.01)
    assert facts.active_parameters == pytest.approx(12.9e9, rel=0.01)
    # The model's FLOPs are those of the active parameters (2 per parameter and token), attention's
    # scores aside.
    scores = 4 * SEQ * facts.heads * facts.head_dim
    matmul_params = (facts.layer_flops_per_token - scores) / 2 * facts.layers
    assert matmul_params == pytest.approx(facts.active_parameters - 2 * 32000 * 4096, rel=0.01)
    # The other presets, against their published sizes (total, per token).
    olmoe = _facts(model_presets.OLMOE_1B_7B)
    assert (olmoe.parameters, olmoe.active_parameters) == pytest.approx((6.9e9, 1.3e9), rel=0.02)
    qwen = _facts(model_presets.QWEN1_5_MOE_A2_7B)
    assert (qwen.parameters, qwen.active_parameters) == pytest.approx((14.3e9, 2.7e9), rel=0.02)
    # A preset's name is a model.
    result = smp.plan("mixtral-8x7b", seq_len=SEQ, global_batch=8, gpus=8, hardware="h200", layout={})
    assert result.evaluated is not None


def test_mixed_dense_and_moe_layers():
    """Qwen-style: the layers in mlp_only_layers keep the dense MLP; a dense config has no experts."""
    half = {**model_presets.QWEN1_5_MOE_A2_7B, "mlp_only_layers": list(range(12))}
    whole, mixed = _facts(model_presets.QWEN1_5_MOE_A2_7B), _facts(half)
    assert mixed.moe_layers == 12
    assert mixed.expert_total == pytest.approx(whole.expert_total / 2)
    dense_mlp = 3 * 2048 * 5632
    moe_rest = 2048 * 60 + 3 * 2048 * 5632 + 2048  # router, shared expert and its gate
    assert mixed.parameters - whole.parameters == pytest.approx(
        12 * (dense_mlp - moe_rest) - whole.expert_total / 2
    )
    assert _facts({k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}).experts == 0


def test_ep_divides_the_expert_bytes_and_nothing_else():
    facts, work = _facts(), _workload(8, 8, per_node=8)
    base = Layout(rdp=8, bf16=True, checkpointing="each")
    one = memory.estimate(facts, base, work)
    two = memory.estimate(facts, base.replace(ep=2), work)
    experts = facts.expert_total
    others = facts.parameters - experts
    # bf16 parameters; fp32 gradients; fp32 masters; two fp32 moments.
    for got, want, per in (
        (one.parameters, facts.parameters, 2),
        (two.parameters, others + experts / 2, 2),
        (two.gradients, others + experts / 2, 4),
        (two.masters, others + experts / 2, 4),
        (two.optimizer_state, others + experts / 2, 8),
    ):
        assert got == pytest.approx(want * per, rel=1e-6)
    assert one.parameters - two.parameters == pytest.approx(experts / 2 * 2, rel=1e-6)
    assert two.activations == one.activations  # the saved activations are ep's as they are without
    # The all-to-all's send and receive buffers: top_k x tokens x hidden each.
    assert two.communication - one.communication == pytest.approx(2 * 2 * SEQ * 4096 * 2)
    # The saved activations hold the dispatched tokens, top_k x hidden per token and MoE layer.
    dense = _facts({k: v for k, v in MIXTRAL.items() if k != "num_local_experts"})
    assert facts.saved_layer.replicated_elements - dense.saved_layer.replicated_elements >= 2 * 2 * SEQ * 4096


def test_step_time_counts_top_k_experts_and_the_all_to_alls():
    work = _workload(8, 8)
    base = Layout(rdp=8, bf16=True, checkpointing="each")
    top2_of_8 = step_time.estimate(_facts(), base, work)
    top2_of_2 = step_time.estimate(_facts({**MIXTRAL, "num_local_experts": 2}), base, work)
    top8_of_8 = step_time.estimate(_facts({**MIXTRAL, "num_experts_per_tok": 8}), base, work)
    # The compute of a top-2 of 8 model is what 2 experts cost, not 8.
    assert top2_of_8.matmul == pytest.approx(top2_of_2.matmul, rel=0.05)
    assert top8_of_8.matmul > 2.5 * top2_of_8.matmul
    assert top2_of_8.ep_comm == 0.0
    ep = step_time.estimate(_facts(), base.replace(ep=8), work)
    assert ep.ep_comm > 0.0 and ep.parts()["ep_comm"] == ep.ep_comm
    assert ep.total == pytest.approx(sum(ep.parts().values()))
    assert ep.matmul == pytest.approx(top2_of_8.matmul, rel=0.05)  # the same pairs, on E/ep experts
    # Per MoE layer and rank of T tokens: dispatch and combine of top_k T hidden bf16 elements, each
    # moving (ep - 1)/ep of it, forward; twice backward; once more recomputed (checkpointed).
    hw = work.hardware
    moved = 2 * SEQ * 4096 * 2 * 7 / 8
    latency = (hw.collective_latency_us / 2 + 7 * hw.intra_node_step_latency_us) * 1e-6
    per_layer = (2 + 4 + 2) * (moved / (hw.intra_node_gbps * 1e9 * hw.link_efficiency) + latency)
    assert ep.ep_comm == pytest.approx(32 * per_layer, rel=1e-6)
    # Across nodes the same exchange is slower.
    across = step_time.estimate(_facts(), base.replace(ep=8), _workload(8, 8, per_node=4))
    assert across.ep_comm > 2 * ep.ep_comm  # 4 GPUs a node: their 4 adapters, not NVLink
    # The experts' gradients are averaged over the rdp/ep ranks holding the same experts (ep ranks
    # apart), the rest over all of rdp: at rdp = 16, ep = 8, a pair of ranks on two nodes.
    facts, dp16 = _facts(), _workload(16, 16)
    grads = 4 * (facts.parameters - facts.expert_total), 4 * facts.expert_total / 8
    want = kernels.all_reduce(hw, grads[0], kernels.Group(16, 1), 8, 16)
    want += kernels.all_reduce(hw, grads[1], kernels.Group(2, 8), 8, 16)
    assert step_time.estimate(facts, base.replace(rdp=16, ep=8), dp16).dp_traffic == pytest.approx(want)
    # On one node, ep = rdp: no replica holds the same experts, only the rest is averaged.
    assert ep.dp_traffic < 0.2 * top2_of_8.dp_traffic


def test_the_walk_raises_ep_where_replicated_experts_do_not_fit():
    """Mixtral-8x7B on one node of 8 GPUs of 192 GB, one sequence each: its replicated experts do
    not fit, even with the optimizer state sharded over the 8 ranks; ep=2 with the state still
    sharded (each rank a half of every layer's experts) fits, the seed's first fit; ep=4 and 8 fit
    too, and ep=8 (no expert replica to average) is the fastest. The tp and pp steps then try
    their layouts with ep too."""
    result = smp.plan(
        "mixtral-8x7b", seq_len=SEQ, global_batch=8, gpus=8, hardware="h200", gpu_memory="192GB"
    )
    steps = {c.step: c for c in result.candidates}
    assert not steps["2. shard optimizer state"].fits
    ep_steps = [s for s in steps if s.startswith("3a. expert parallelism")]
    assert ep_steps == ["3a. expert parallelism 2", "3a. expert parallelism 4", "3a. expert parallelism 8"]
    two = steps["3a. expert parallelism 2"]
    assert two.fits and two.layout.shard_optimizer_state and two.time.ep_comm > 0
    assert result.first_fit.layout.ep == 2
    best = result.recommended_candidate
    assert best.layout.ep == 8 and best.time.total < two.time.total
    assert best.time.dp_traffic < two.time.dp_traffic  # no replica holds the same experts
    assert result.recommended["expert_parallel_degree"] == 8
    later = [s for s in steps if s.startswith(("4. tensor", "5. pipeline"))]
    assert list(steps).index(ep_steps[-1]) < min(list(steps).index(s) for s in later)
    assert "ep=2" in result.table() and "ep_comm" in result.table()
    # Later steps try their tp and pp layouts with the widest ep their rdp allows (never with sdp).
    composed = [c for c in result.candidates if c.layout.ep > 1 and (c.layout.tp > 1 or c.layout.pp > 1)]
    assert composed and all(c.step.endswith(f"3a. expert parallelism {c.layout.ep}") for c in composed)
    assert all(c.layout.sdp == 1 and c.layout.ep == c.layout.rdp for c in composed)
    tp2 = steps["4. tensor parallelism 2, 3a. expert parallelism 4"]
    assert tp2.layout.tp == 2 and tp2.time.ep_comm > 0 and tp2.time.tp_comm > 0


def test_mixtral_on_80gb_gpus_raises_ep_until_it_fits_with_the_optimizer_state_sharded():
    """On 64 GPUs of 80 GB, ep=2 does not fit and ep=4 and 8 do. With the optimizer state sharded, a
    rank's Adam state is 1/rdp of the whole model's at any ep: its experts' state (1/ep of them)
    is cut across the rdp/ep replicas holding the same experts, the rest across all of rdp."""
    facts = _facts()
    result = smp.plan("mixtral-8x7b", seq_len=SEQ, global_batch=256, gpus=64, hardware="h100-sxm")
    tried = [c for c in result.candidates if c.step.startswith("3a. expert parallelism")]
    assert [(c.layout.ep, c.fits) for c in tried] == [(2, False), (4, True), (8, True)]
    four = tried[1]
    rdp = four.layout.rdp
    assert four.layout.shard_optimizer_state and rdp == 64
    assert four.breakdown.optimizer_state == pytest.approx(8 * facts.parameters / rdp, rel=1e-6)
    # A dense model is never given ep.
    dense = {k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}
    plain = smp.plan(dense, seq_len=SEQ, global_batch=256, gpus=64, hardware="h100-sxm")
    assert all(c.layout.ep == 1 for c in plain.candidates)


def test_layout_round_trips_expert_parallel_degree():
    layout = from_config({"expert_parallel_degree": 4, "activation_checkpointing": "each"}, 8)
    assert (layout.ep, layout.rdp) == (4, 8)
    written = layout.smp_config()
    assert written["expert_parallel_degree"] == 4
    assert from_config(written, 8) == layout
    assert from_config({}, 8).smp_config()["expert_parallel_degree"] == 1
    assert "ep=4" in layout.describe()
    evaluated = smp.plan("mixtral-8x7b", seq_len=SEQ, global_batch=8, gpus=8, hardware="h200", layout=written)
    assert evaluated.evaluated.layout.ep == 4 and evaluated.evaluated.time.ep_comm > 0


@pytest.mark.parametrize(
    ("config", "gpus", "match"),
    [
        (
            {"expert_parallel_degree": 2, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2},
            8,
            "not with sharded_data_parallel_degree=2 together with tensor_parallel_degree=2",
        ),
        (
            {"expert_parallel_degree": 2, "context_parallel_degree": 2},
            8,
            "not with context_parallel_degree=2",
        ),
        (
            {"expert_parallel_degree": 4},
            6,
            r"does not divide the reduced data parallel degree 6; choose one of",
        ),
    ],
)
def test_an_explicit_layout_that_ep_refuses_is_a_clear_error(config, gpus, match):
    with pytest.raises(ValueError, match=match):
        smp.plan("mixtral-8x7b", seq_len=SEQ, global_batch=gpus, gpus=gpus, hardware="h200", layout=config)


def test_ep_must_divide_the_experts_and_needs_experts():
    with pytest.raises(ValueError, match="does not divide the model's 8 experts per layer; choose one of"):
        smp.plan(
            "mixtral-8x7b",
            seq_len=SEQ,
            global_batch=16,
            gpus=16,
            hardware="h200",
            layout={"expert_parallel_degree": 16},
        )
    dense = {k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}
    with pytest.raises(ValueError, match="no experts"):
        smp.plan(
            dense, seq_len=SEQ, global_batch=8, gpus=8, hardware="h200", layout={"expert_parallel_degree": 2}
        )


def _tiny_moe(family: str, implementation: str = "grouped_mm"):
    import transformers

    shape = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_experts_per_tok=2,
    )
    config, model = {
        "mixtral": (
            transformers.MixtralConfig(num_local_experts=4, **shape),
            transformers.MixtralForCausalLM,
        ),
        "qwen2_moe": (
            transformers.Qwen2MoeConfig(
                num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64, **shape
            ),
            transformers.Qwen2MoeForCausalLM,
        ),
    }[family]
    config._experts_implementation = implementation
    return config, model(config)


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_a_measured_moe_module_counts_e_experts_and_top_k_of_them_per_token(implementation):
    """A module passed to smp.plan is measured (measured_facts.py); its 3-D expert banks are the
    experts (found as expert parallelism finds them), whichever experts implementation it runs:
    transformers' "eager" one routes with a data-dependent loop the fake forward cannot follow."""
    from smp.planner import measured_facts

    config, model = _tiny_moe("mixtral", implementation)
    facts = measured_facts.from_module(model, 64)
    assert model.config._experts_implementation == implementation  # put back
    banks = [p for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))]
    assert (facts.experts, facts.top_k, facts.moe_layers) == (4, 2, 2)
    assert facts.parameters == sum(p.numel() for p in model.parameters())
    assert facts.expert_total == sum(p.numel() for p in banks) == 2 * 4 * 3 * 64 * 128
    assert facts.expert == Params(3 * 64 * 128, 3 * 64 * 128)
    # FLOPs per token: the layer's own matrices and top_k = 2 experts (not 4), besides the scores.
    own = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 4 * 64  # attention, router
    assert (facts.layer_flops_per_token - 4 * 64 * 64) / 2 == own + 2 * 64 + 2 * 3 * 64 * 128
    assert facts.layer.sharded == own - 4 * 64  # the router stays whole under tensor parallelism
    assert [(m.k, m.n, m.cut, m.experts) for m in facts.matmuls[1:]] == [(64, 256, "n", 4), (128, 64, "k", 4)]
    # The same counts as the model's config gives.
    from_config = model_facts.from_hf_config(config.to_dict(), 64)
    assert (facts.parameters, facts.active_parameters) == (
        from_config.parameters,
        from_config.active_parameters,
    )


def test_a_measured_shared_expert_stays_with_the_layer_and_ep_divides_only_the_routed():
    config, model = _tiny_moe("qwen2_moe")
    result = smp.plan(model, seq_len=64, global_batch=4, gpus=4, hardware="h200", layout={"ddp": True})
    facts = result.facts
    assert (facts.experts, facts.moe_layers, facts.expert.total) == (4, 2, 3 * 64 * 32)
    assert facts.parameters == sum(p.numel() for p in model.parameters())
    plain = result.evaluated.breakdown
    ep = smp.plan(
        model,
        seq_len=64,
        global_batch=4,
        gpus=4,
        hardware="h200",
        layout={"ddp": True, "expert_parallel_degree": 2},
    )
    moved = plain.parameters - ep.evaluated.breakdown.parameters
    assert moved == pytest.approx(facts.expert_total / 2 * 4)  # fp32: half the routed experts' bytes


def test_ep_with_tp_keeps_each_expert_whole_and_cuts_the_rest():
    """ep=2 x tp=2 on 8 GPUs: the non-experts are tp shards, each rank's 4 experts whole (smp leaves
    the experts out of the tp pass), so a rank holds the rest / 2 and the experts / 2; each tp rank
    sends half of the group's tokens to the experts, so the expert FLOPs per rank are tp=2's."""
    facts = _facts()
    job = dict(seq_len=SEQ, global_batch=8, gpus=8, hardware="h200")
    both = smp.plan("mixtral-8x7b", **job, layout={"expert_parallel_degree": 2, "tensor_parallel_degree": 2})
    tp_only = smp.plan("mixtral-8x7b", **job, layout={"tensor_parallel_degree": 2}).evaluated
    layer_experts = facts.moe_layers / facts.layers * facts.experts * facts.expert.total
    assert facts.layer_experts(2, 2) == pytest.approx(layer_experts / 2)  # whole experts, half of them
    assert facts.layer_experts(2, 1) < layer_experts  # tp alone cuts each expert
    got = both.evaluated
    assert got.layout.ep == 2 and got.time.ep_comm > 0 and got.time.tp_comm > 0
    # The same bytes of experts as tp=2 (half of each vs half of them), the same matmul FLOPs.
    assert got.breakdown.parameters == pytest.approx(tp_only.breakdown.parameters, rel=0.02)
    assert got.time.matmul == pytest.approx(tp_only.time.matmul, rel=0.02)


def test_ep_with_sdp_shards_the_experts_over_their_replicas():
    """ep=2 x sdp=2 on 8 GPUs: FSDP2 shards the non-experts over the sdp pair, each block of
    experts (half of them) over the 4 replicas holding it (their gathers and reduce-scatters cross
    that group): a rank holds under 40% of sdp=2's parameter bytes."""
    facts = _facts()
    job = dict(seq_len=SEQ, global_batch=8, gpus=8, hardware="h200")
    both = {"expert_parallel_degree": 2, "sharded_data_parallel_degree": 2, "bf16": True}
    evaluated = smp.plan("mixtral-8x7b", **job, layout=both).evaluated
    sdp_only = smp.plan(
        "mixtral-8x7b", **job, layout={"sharded_data_parallel_degree": 2, "bf16": True}
    ).evaluated
    experts, others = facts.expert_total, facts.parameters - facts.expert_total
    assert evaluated.breakdown.parameters == pytest.approx(4 * (others / 2 + experts / 8), rel=1e-6)
    assert evaluated.breakdown.optimizer_state == pytest.approx(8 * (others / 2 + experts / 8), rel=1e-6)
    assert evaluated.breakdown.parameters < 0.4 * sdp_only.breakdown.parameters
    assert evaluated.time.sdp_traffic > 0 and evaluated.time.ep_comm > 0


def test_where_no_ep_fits_the_walk_shards_the_widest_ep_with_sdp():
    """Mixtral-8x7B on 64 A100s of 40 GB: ep=2, 4 and 8 alone do not fit; the walk then tries sdp
    over ep=8 (the non-experts over sdp, each block of experts over its 8 replicas), which fits from
    sdp=4 on."""
    result = smp.plan("mixtral-8x7b", seq_len=SEQ, global_batch=256, gpus=64, hardware="a100-40gb")
    steps = {c.step: c for c in result.candidates}
    assert [steps[f"3a. expert parallelism {n}"].fits for n in (2, 4, 8)] == [False, False, False]
    both = [c for c in result.candidates if c.layout.ep == 8 and c.layout.sdp > 1]
    assert [c.layout.sdp for c in both] == [2, 4, 8, 16, 32, 64]
    assert not both[0].fits and all(c.fits for c in both[1:])
    assert all(c.step.startswith("3a. expert parallelism 8, sharded data parallelism") for c in both)
