"""The planner counts context parallelism (docs/planner.md, docs/context_parallel.md): each cp
rank holds 1/cp of every sequence's activations and runs 1/cp of its work, pays the exchange
around attention its comm type says, and the walk raises cp before pipeline stages where one
sequence's activations are what does not fit."""

from __future__ import annotations

import pytest
import smp
from smp.planner import hardware, memory, model_facts, step_time
from smp.planner.layout import Layout, from_config

# A Llama-2-7B-shaped config (multi-head attention: kv heads = heads).
LLAMA_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
LONG = 131072
# 4 nodes of 8 A100 40 GB, 4 sequences a step: at 128k tokens one sequence's activations do not
# fit one tensor-parallel group of 8 GPUs, while the model's state does.
LONG_JOB = {"global_batch": 4, "gpus": 32, "hardware": "a100-40gb"}


def _facts(seq: int):
    return model_facts.from_hf_config(LLAMA_7B, seq)


def _workload(seq: int, gpus: int, batch: int = 1, per_node: int = 8) -> memory.Workload:
    hw = hardware.load("h100-sxm")
    return memory.Workload(seq, batch, gpus, min(gpus, per_node), hw.memory, hw)


def test_cp_halves_the_activations_and_keeps_the_parameters():
    """cp=2 on 2 GPUs, one sequence: every rank holds half of it. Parameters are whole on both
    ranks, while a sharded optimizer state is sharded over the two cp ranks."""
    facts, seq = _facts(32768), 32768
    base = Layout(bf16=True, checkpointing="none", shard_optimizer_state=True)
    one = memory.estimate(facts, base, _workload(seq, 1))
    two = memory.estimate(facts, base.replace(cp=2), _workload(seq, 2))
    assert two.activations == pytest.approx(one.activations / 2)
    assert two.recompute == pytest.approx(one.recompute / 2)
    assert two.parameters == one.parameters
    assert two.optimizer_state == pytest.approx(one.optimizer_state / 2)  # rdp x cp = 2 ranks
    assert two.total < one.total
    # sdp shards over its replicas' cp ranks too: sdp=2 at cp=2 is 4 shards.
    sdp = Layout(bf16=True, rdp=2, sdp=2)
    wide = memory.estimate(facts, sdp.replace(cp=2), _workload(seq, 4, batch=2))
    assert wide.parameters == pytest.approx(
        memory.estimate(facts, sdp, _workload(seq, 2, batch=2)).parameters / 2
    )


def _logits_gather(seq: int, c: int) -> float:
    """Seconds to all-gather one sequence's bf16 logits over c ranks at the H100's NVLink."""
    hw = hardware.load("h100-sxm")
    nbytes = seq * LLAMA_7B["vocab_size"] * 2
    return (c - 1) / c * nbytes / (hw.intra_node_gbps * 1e9 * hw.link_efficiency)


def test_the_logits_leave_whole_over_tp_and_cp():
    """The last stage gathers the logits for the script: over the tp group (vocabulary shards) and
    the cp group (sequence cuts), each at the link: a 4x vocabulary adds 3x its bytes' time (cp's
    with the copy putting the load-balanced chunks back in order; tp's copy is memory time)."""
    seq = 8192
    for layout, part in ((Layout(bf16=True, tp=2), "tp_comm"), (Layout(bf16=True, cp=2), "cp_comm")):
        small, big = (
            step_time.estimate(
                model_facts.from_hf_config(LLAMA_7B | {"vocab_size": v}, seq), layout, _workload(seq, 2)
            ).parts()[part]
            for v in (32000, 128000)
        )
        gather = 3 * _logits_gather(seq, 2)
        if part == "tp_comm":
            assert big - small == pytest.approx(gather, rel=0.1), (layout, small, big)
        else:
            assert gather < big - small < 2 * gather, (layout, small, big)


def _step(layout: Layout, seq: int, gpus: int, per_node: int = 8):
    return step_time.estimate(_facts(seq), layout, _workload(seq, gpus, per_node=per_node))


def test_cp_halves_the_work_and_adds_its_exchange():
    seq = 16384
    one = _step(Layout(bf16=True), seq, 1)
    two = _step(Layout(bf16=True, cp=2, cp_comm="all_gather"), seq, 2)
    assert one.cp_comm == 0.0
    assert two.cp_comm > 0.0 and two.parts()["cp_comm"] == two.cp_comm
    assert two.total == pytest.approx(sum(two.parts().values()))
    assert two.matmul == pytest.approx(one.matmul / 2, rel=0.05)  # attention's quadratic part too
    assert one.memory / 2 < two.memory < 0.6 * one.memory  # the bytes halve, not the kernel launches
    assert two.tokens == one.tokens and two.model_flops == one.model_flops


@pytest.mark.parametrize("c", [2, 4])
def test_a2a_and_the_ring_move_what_their_traffic_says(c):
    """Multi-head attention, per layer and rank of T tokens: the ring passes K and V (C - 1)
    times forward and twice that backward, 6 (C - 1) T h bytes-units; Ulysses' four all-to-alls
    move (C - 1) / C of q, k, v and the output each way, 8 (C - 1) / C T h: a2a / p2p = 4 / (3 C)."""
    seq = 131072
    ring = _step(Layout(bf16=True, cp=c), seq, c)
    ulysses = _step(Layout(bf16=True, cp=c, cp_comm="a2a"), seq, c)
    gathered = _step(Layout(bf16=True, cp=c, cp_comm="all_gather"), seq, c)
    # (besides each the same gather of the logits' cuts: they leave the model whole)
    logits = _logits_gather(seq, c)
    assert 0 < logits < 0.2 * ring.cp_traffic
    assert ulysses.cp_traffic - logits == pytest.approx(4 / (3 * c) * (ring.cp_traffic - logits), rel=0.05)
    assert gathered.cp_traffic == pytest.approx(ring.cp_traffic)
    # The ring hides behind attention (exposed = what outlasts it); all_gather and a2a do not.
    assert gathered.cp_comm == pytest.approx(gathered.cp_traffic)
    assert ulysses.cp_comm == pytest.approx(ulysses.cp_traffic)
    assert ring.cp_comm < gathered.cp_comm
    # Where the ring crosses nodes (slower links) more of it is exposed than inside one.
    short = 16384
    inside = _step(Layout(bf16=True, tp=4, cp=2), short, 8)
    across = _step(Layout(bf16=True, tp=4, cp=2), short, 8, per_node=4)
    assert across.cp_traffic > 5 * inside.cp_traffic
    assert across.cp_comm > inside.cp_comm


def test_the_walk_raises_cp_before_pipeline_stages_for_a_long_sequence():
    result = smp.plan(LLAMA_7B, seq_len=LONG, **LONG_JOB)
    first, best = result.first_fit, result.recommended_candidate
    assert first.layout.cp > 1 and first.layout.pp == 1, first.layout.describe()
    assert best.layout.cp > 1 and best.layout.pp == 1, best.layout.describe()
    assert best.time.cp_comm > 0
    assert LONG % (2 * best.layout.cp) == 0
    cp_steps = [c.step for c in result.candidates if c.layout.cp > 1]
    pp_steps = [c.step for c in result.candidates if c.layout.pp > 1]
    steps = [c.step for c in result.candidates]
    assert max(steps.index(s) for s in cp_steps) < min(steps.index(s) for s in pp_steps)
    assert f"cp={best.layout.cp} p2p" in result.table()
    assert "cp_comm" in result.table()
    assert result.recommended["context_parallel_degree"] == best.layout.cp


def test_a_short_sequence_needs_no_cp():
    result = smp.plan(LLAMA_7B, seq_len=4096, **LONG_JOB)
    assert result.recommended_candidate is not None
    assert all(c.layout.cp == 1 for c in result.candidates)
    assert any("5a. context parallelism: skipped" in n for n in result.notes)


def test_layout_round_trips_the_cp_keys():
    config = {"tensor_parallel_degree": 2, "context_parallel_degree": 4, "cp_comm_type": "a2a"}
    layout = from_config(config, 16)
    assert (layout.tp, layout.cp, layout.cp_comm, layout.rdp) == (2, 4, "a2a", 2)
    written = layout.smp_config()
    assert written["context_parallel_degree"] == 4 and written["cp_comm_type"] == "a2a"
    assert from_config(written, 16) == layout
    assert from_config({}, 4).smp_config()["context_parallel_degree"] == 1
    with pytest.raises(ValueError, match="context_parallel_degree"):
        from_config({"tensor_parallel_degree": 4, "context_parallel_degree": 4}, 8)
    with pytest.raises(ValueError, match="reduced_data_parallel_degree"):
        from_config({"context_parallel_degree": 2, "reduced_data_parallel_degree": 8}, 8)


def test_a_sequence_that_does_not_cut_into_2cp_chunks_is_never_proposed():
    odd = LONG - 2  # divides by 2, not by 4: no cp degree cuts it into 2 x cp chunks
    result = smp.plan(LLAMA_7B, seq_len=odd, **LONG_JOB)
    assert all(c.layout.cp == 1 for c in result.candidates)
    assert any("does not cut into 2 x 2 chunks" in n for n in result.notes)
    with pytest.raises(ValueError, match="pad it to 131072"):
        smp.plan(LLAMA_7B, seq_len=odd, **LONG_JOB, layout={"context_parallel_degree": 2})
    # a2a needs the heads per TP rank to divide by cp.
    with pytest.raises(ValueError, match="'a2a'"):
        smp.plan(
            {**LLAMA_7B, "num_attention_heads": 8, "num_key_value_heads": 8},
            seq_len=LONG,
            **LONG_JOB,
            layout={"tensor_parallel_degree": 4, "context_parallel_degree": 4, "cp_comm_type": "a2a"},
        )


def test_an_eager_attention_runs_by_the_comm_type_unless_its_weights_drop_out():
    """The pass reads HF's eager attention as sdpa (passes/context_parallel/eager.py), so its
    exchange is the comm type's; with dropout on the attention's weights the ring gathers."""
    seq = 16384
    eager = model_facts.from_hf_config(LLAMA_7B | {"_attn_implementation": "eager"}, seq)
    dropping = model_facts.from_hf_config(LLAMA_7B | {"attention_dropout": 0.1}, seq)
    assert eager.eager_attention and not eager.attention_dropout and dropping.attention_dropout

    def traffic(facts, comm):
        return step_time.estimate(facts, Layout(bf16=True, cp=4, cp_comm=comm), _workload(seq, 4))

    ring, gathered = traffic(eager, "p2p"), traffic(eager, "all_gather")
    assert ring.cp_comm < 0.5 * gathered.cp_comm  # the ring hides behind attention
    assert traffic(dropping, "p2p").cp_comm == pytest.approx(traffic(dropping, "all_gather").cp_comm)
    ulysses = traffic(dropping, "a2a")
    assert ulysses.cp_traffic == pytest.approx(traffic(_facts(seq), "a2a").cp_traffic)
