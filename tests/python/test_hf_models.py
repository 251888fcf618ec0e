"""Hugging Face transformers models, unmodified, trained with smp in each layout: parity with one
process training the same model on the same global batch."""

from __future__ import annotations

import pipeline_cases
import pytest
from harness import run_ranks

LOSS_RTOL = 1e-4
PARAM_ATOL = 1e-4
# The first step's gradients, relative to the largest: measured 0.8e-7 to 5.2e-7 over every
# layout, model and rank. Adam's steps hide a wrong gradient scale (gradients 1.1x theirs train
# parameters within PARAM_ATOL); these do not.
GRAD_RTOL = 2e-6
MODELS = ["hf_gpt2", "hf_llama", "hf_bert"]

LAYOUTS = {
    "pp2": (2, {"pipeline_parallel_degree": 2, "microbatches": 2}),
    "tp2": (2, {"tensor_parallel_degree": 2}),
    "pp2_tp2": (4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2}),
    # zero_bubble here: its split at the linear layers meets GPT-2's Conv1D (addmm on [in, out]
    # weights), Llama's bias-free projections and BERT's, with data-parallel buckets and sharded state.
    "pp2_rdp2_sharded_zero_bubble": (
        4,
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 2,
            "shard_optimizer_state": True,
            "pipeline": "zero_bubble",
        },
    ),
    # zero_bubble_v: four stages in a V on two ranks (rank 0 holds the embeddings and the head,
    # so GPT-2's tied embedding/head meets on one rank), tensor-parallel inside each.
    "pp2_tp2_zero_bubble_v": (
        4,
        {
            "pipeline_parallel_degree": 2,
            "tensor_parallel_degree": 2,
            "microbatches": 4,
            "pipeline": "zero_bubble_v",
        },
    ),
}

# Per model, layers of block 0 that tensor parallelism must shard (Megatron's column/row pairs).
SHARDED = {
    "hf_gpt2": ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"],
    "hf_llama": [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ],
    "hf_bert": [
        "attention.self.query.weight",
        "attention.self.key.weight",
        "attention.self.value.weight",
        "attention.output.dense.weight",
        "intermediate.dense.weight",
        "output.dense.weight",
    ],
}


def _train(rank, world_size, config):
    results = {}
    for case in MODELS:
        r = pipeline_cases.train_smp(rank, world_size, case, config, 3, 8)
        keep = ("loss_err", "param_err", "grad_err", "distributed", "local_numel", "full_numel")
        results[case] = {k: r[k] for k in keep}
    return results


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity(layout):
    world_size, config = LAYOUTS[layout]
    tp = config.get("tensor_parallel_degree", 1)
    per_rank = run_ranks(_train, world_size, config, timeout=600)
    for by_model in per_rank:
        for case, r in by_model.items():
            assert r["loss_err"] < LOSS_RTOL, (case, r["loss_err"])
            assert r["param_err"] < PARAM_ATOL, (case, r["param_err"])
            assert r["grad_err"] < GRAD_RTOL, (case, r["grad_err"])
            for name in r["distributed"]:  # every shard is exactly 1/tp of its parameter
                assert r["local_numel"][name] * tp == r["full_numel"][name], (case, name)
            if tp == 1:
                assert not r["distributed"], (case, r["distributed"])
    if tp > 1:  # the blocks' layers really run sharded (not gathered and computed whole)
        for case, layers in SHARDED.items():
            distributed = {n for by_model in per_rank for n in by_model[case]["distributed"]}
            for layer in layers:
                assert any(n.endswith(f".0.{layer}") for n in distributed), (case, layer, sorted(distributed))
        # BERT's MLM head: its dense layer feeds a LayerNorm over the features, so sharding it would
        # only gather its output again; it stays replicated, the tied decoder is vocab-parallel.
        bert = {n for by_model in per_rank for n in by_model["hf_bert"]["distributed"]}
        assert "cls.predictions.transform.dense.weight" not in bert
        assert "bert.embeddings.word_embeddings.weight" in bert
