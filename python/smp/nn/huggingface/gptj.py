"""SMP v1's GPT-J support: hooks that map Hugging Face's GPTJForCausalLM onto
smp.nn.DistributedTransformerLMHead (SMP's `get_hf_gptj_transformer_hooks`) or its GPTJBlock onto
DistributedTransformerLayer (`get_hf_gptj_transformer_layer_hooks`), and state_dict translation.

    from transformers import GPTJForCausalLM
    from smp.nn.huggingface.gptj import get_hf_gptj_transformer_hooks
    smp.tp_register_with_module(GPTJForCausalLM, smp.nn.DistributedTransformerLMHead,
                                *get_hf_gptj_transformer_hooks())
    with smp.tensor_parallelism():
        model = GPTJForCausalLM(config)   # one DistributedTransformerLMHead

GPT-J in smp.nn's terms: pre-LN blocks with a parallel residual on one norm (x + attn(ln_1(x)) +
mlp(ln_1(x)): parallel_attn_output, shared_pre_layernorm), interleaved rotary embeddings on the
first rotary_dim features of each head, bias-free q/k/v/out projections, no position table, and
an untied head with a bias.

Key mapping of one block (all nn.Linear, nothing transposed): ln_1 -> attention.pre_layernorm;
attn.{q,k,v}_proj -> attention.{query,key,value}; attn.out_proj -> attention.dense; mlp.fc_in ->
output.dense1; mlp.fc_out -> output.dense2. With the whole model registered besides:
transformer.wte -> word_embedding, transformer.h.<i> -> transformer.seq_layers.<i>,
transformer.ln_f -> layernorm, lm_head -> lm_head. The functions work on whole tensors
(smp.nn.full_state_dict, or a DistributedModel's state_dict(), gathers the shards).
`translate_hf_state_dict_to_smdistributed_gptj` translates only while GPTJForCausalLM or
GPTJBlock is registered (otherwise smp's graph tensor parallelism keeps HF's keys and the dict
comes back as it is); `translate_state_dict_to_hf_gptj` translates what is in smp.nn's keys.
"""

from __future__ import annotations

from typing import Any

from smp.nn.block_parts import ACTIVATIONS
from smp.nn.huggingface import causal_lm
from smp.tensor_parallel import registration

_LAYER = {
    "ln_1": "attention.pre_layernorm",
    "attn.q_proj": "attention.query",
    "attn.k_proj": "attention.key",
    "attn.v_proj": "attention.value",
    "attn.out_proj": "attention.dense",
    "mlp.fc_in": "output.dense1",
    "mlp.fc_out": "output.dense2",
}
_OLD_BUFFERS = ("attn.bias", "attn.masked_bias")  # older transformers' causal-mask buffers
_KEYS = causal_lm.ModelKeys(
    embedding="transformer.wte.weight",
    blocks="transformer.h.",
    final_norm="transformer.ln_f",
    heads=("lm_head",),
)


def _causal_lm_class():
    from transformers import GPTJForCausalLM

    return GPTJForCausalLM


def _block_class():
    from transformers.models.gptj.modeling_gptj import GPTJBlock

    return GPTJBlock


def _refuse(what: str, fix: str, module: str = causal_lm.LM_HEAD) -> ValueError:
    return causal_lm.unsupported("gptj", what, fix, module)


def _layer_kwargs(config, module: str) -> dict[str, Any]:
    if config.rotary_dim is None:
        raise _refuse(
            "rotary_dim=None (Hugging Face's GPT-J then rotates hidden_size features per head)",
            "set config.rotary_dim to at most the head size",
            module,
        )
    if config.activation_function not in ACTIVATIONS:
        raise _refuse(
            f"activation_function={config.activation_function!r}", f"use one of {sorted(ACTIVATIONS)}", module
        )
    return causal_lm.gpt_layer_kwargs(config) | {
        "rotary_dim": config.rotary_dim,
        "rotary_interleaved": True,
        "rotary_emb_base": 10000.0,  # GPT-J's create_sinusoidal_positions
        "use_qkv_bias": False,
        "use_attention_output_bias": False,
        "attention_scores_in_fp32": True,
        "zero_fully_masked_rows": True,  # HF's default (SDPA) attention
        "parallel_attn_output": True,
        "shared_pre_layernorm": True,
    }


def lm_head_init_hook(config):
    """GPTJForCausalLM(config) -> DistributedTransformerLMHead's arguments."""
    if config.tie_word_embeddings:
        raise _refuse(
            "tie_word_embeddings=True (GPT-J's head has a bias of its own)",
            "use GPT-J's default tie_word_embeddings=False, or register GPTJBlock instead",
        )
    if config.embd_pdrop != config.resid_pdrop:
        raise _refuse(
            f"embd_pdrop={config.embd_pdrop} != resid_pdrop={config.resid_pdrop}",
            "its embeddings are dropped with hidden_dropout_prob: make them equal, or register GPTJBlock",
        )
    return (), {
        **_layer_kwargs(config, causal_lm.LM_HEAD),
        "num_layers": config.n_layer,
        "vocab_size": config.vocab_size,
        "num_positions": config.n_positions,
        "num_token_types": 0,
        "add_lm_head": True,
        "use_position_embedding": False,
        "tie_word_embeddings": False,
        "lm_head_bias": True,
    }


def get_hf_gptj_transformer_hooks():
    """(init_hook, forward_hook, return_hook) for registering GPTJForCausalLM to
    DistributedTransformerLMHead (SMP's use_distributed_transformer path)."""
    forward_hook = causal_lm.lm_head_forward_hook("gptj", _causal_lm_class)
    return lm_head_init_hook, forward_hook, causal_lm.lm_head_return_hook


get_hf_gptj_transformer_lm_head_hooks = get_hf_gptj_transformer_hooks  # the other models' spelling


def layer_init_hook(config, layer_idx=None):
    """GPTJBlock(config, layer_idx) -> DistributedTransformerLayer's arguments."""
    return (), _layer_kwargs(config, causal_lm.LAYER)


def get_hf_gptj_transformer_layer_hooks():
    """(init_hook, forward_hook, return_hook) for registering GPTJBlock to DistributedTransformerLayer."""
    forward_hook = causal_lm.layer_forward_hook("gptj", _block_class)
    return layer_init_hook, forward_hook, causal_lm.layer_return_hook


# --- state_dict translation ------------------------------------------------------------------


def _layer_to_smp(layer: dict[str, Any]) -> dict[str, Any]:
    return causal_lm.rename(layer, _LAYER, _OLD_BUFFERS)


def _layer_to_hf(layer: dict[str, Any]) -> dict[str, Any]:
    return causal_lm.rename(layer, {v: k for k, v in _LAYER.items()})


def translate_hf_state_dict_to_smdistributed_gptj(
    state_dict: dict[str, Any], *args: Any, tie_word_embeddings: bool | None = None, **kwargs: Any
):
    """A Hugging Face GPT-J state_dict -> the keys of the model built with GPT-J's classes
    registered: DistributedTransformerLMHead's while GPTJForCausalLM is registered, blocks in
    DistributedTransformerLayer's while GPTJBlock is; otherwise `state_dict` itself
    (`max_seq_len` and SMP's other arguments are accepted)."""
    if registration.registered(_causal_lm_class()) is not None:
        return causal_lm.model_to_smp(state_dict, _KEYS, _layer_to_smp, tie_word_embeddings)
    if registration.registered(_block_class()) is not None:
        return causal_lm.blocks_to(state_dict, _KEYS.blocks, _layer_to_smp)
    return state_dict  # graph TP keeps GPTJBlock and its keys


def translate_state_dict_to_hf_gptj(state_dict: dict[str, Any], *args: Any, **kwargs: Any):
    """A whole DistributedTransformerLMHead's state -> GPTJForCausalLM's, blocks in
    DistributedTransformerLayer's keys -> GPTJBlock's; a state_dict with neither comes back as
    it is."""
    if causal_lm.is_smp_lm_head(state_dict):
        return causal_lm.model_to_hf(state_dict, _KEYS, _layer_to_hf)
    if causal_lm.has_smp_blocks(state_dict, _KEYS.blocks):
        return causal_lm.blocks_to(state_dict, _KEYS.blocks, _layer_to_hf)
    return state_dict


# SMP's older name
translate_hf_gptj_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_gptj

__all__ = [
    "get_hf_gptj_transformer_hooks",
    "get_hf_gptj_transformer_layer_hooks",
    "get_hf_gptj_transformer_lm_head_hooks",
    "layer_init_hook",
    "lm_head_init_hook",
    "translate_hf_gptj_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_gptj",
    "translate_state_dict_to_hf_gptj",
]
