"""Eight transformers architectures as small as they come, each chosen for what tensor
parallelism must handle in it (built from configs: no downloads).

| name | what it brings |
| qwen3 | QK-norm (per-head RMSNorm weights), grouped-query attention, rotary, tied embeddings |
| mixtral | mixture of experts (top-2 router, expert banks), grouped-query attention |
| falcon | multi-query attention in a fused query_key_value, parallel attention + MLP, FalconLinear |
| bloom | ALiBi, per-head fused query_key_value ([heads, 3, head_dim]) |
| gptj | parallel attention + MLP, rotary on part of each head |
| gpt_neox | per-head fused query_key_value, rotary, parallel residual |
| gpt2 | Conv1D (addmm on [in, out] weights), fused c_attn, tied embeddings |
| llama | rotary, grouped-query attention, gated MLP |
"""

from __future__ import annotations

import hf_cases
import torch
from hf_cases import SEQ, VOCAB

_SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=2)


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(
        Qwen3Config(
            **_SMALL,
            intermediate_size=64,
            num_key_value_heads=2,
            head_dim=8,
            tie_word_embeddings=True,
            max_position_embeddings=SEQ,
        )
    )


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            **_SMALL,
            intermediate_size=64,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=SEQ,
            router_aux_loss_coef=0.0,
        )
    )


def mixtral_ties():
    """Mixtral whose router scores experts 0 and 1 alike (equal rows): every token's top-2 is a
    tie at the first step, which every rank (and one process) must break the same way."""
    model = mixtral()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight[1] = layer.mlp.gate.weight[0]
    return model


def falcon():
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(
        FalconConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_attention_heads=4,
            num_hidden_layers=2,
            multi_query=True,
            parallel_attn=True,
            bias=False,
            alibi=False,
            new_decoder_architecture=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
    )


def bloom():
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(
        BloomConfig(
            vocab_size=VOCAB, hidden_size=32, n_head=4, n_layer=2, hidden_dropout=0.0, attention_dropout=0.0
        )
    )


def gptj():
    from transformers import GPTJConfig, GPTJForCausalLM

    return GPTJForCausalLM(
        GPTJConfig(
            vocab_size=VOCAB,
            n_embd=32,
            n_head=4,
            n_layer=2,
            rotary_dim=4,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            **_SMALL,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            rotary_pct=0.5,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
    )


def gpt2():
    return hf_cases.gpt2(layers=2)


def llama():
    return hf_cases.llama(layers=2)


BUILDERS = {f.__name__: f for f in (qwen3, mixtral, falcon, bloom, gptj, gpt_neox, gpt2, llama)}


def batch(step, n):
    g = torch.Generator().manual_seed(7000 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return {"ids": ids, "labels": ids}


def _case(build):
    def make():
        return (
            build(),
            batch,
            lambda m, b: m(input_ids=b["ids"], labels=b["labels"], use_cache=False),
            lambda out, b: out.loss,
        )

    return make


# pipeline_cases' entries: "arch_<name>".
CASES = {f"arch_{name}": _case(build) for name, build in BUILDERS.items()}
CASES["arch_mixtral_ties"] = _case(mixtral_ties)
