"""SMP v1's GPT-Neo support: hooks that map Hugging Face's GPTNeoForCausalLM onto
smp.nn.DistributedTransformerLMHead (SMP's `get_hf_gptneo_transformer_lm_head_hooks`), and
state_dict translation.

    from transformers import GPTNeoForCausalLM
    from smp.nn.huggingface.gptneo import get_hf_gptneo_transformer_lm_head_hooks
    smp.tp_register_with_module(GPTNeoForCausalLM, smp.nn.DistributedTransformerLMHead,
                                *get_hf_gptneo_transformer_lm_head_hooks())

GPT-Neo in smp.nn's terms: pre-LN blocks, learned positions, a tied head; attention with bias-free
q/k/v, scores in float32 and not divided by sqrt(head size) (scale_attention_scores=False), and
its "local" layers attending to the window_size keys up to each query (attention_windows).

Key mapping (all nn.Linear): transformer.wte -> word_embedding, transformer.wpe ->
position_embedding, transformer.h.<i> -> transformer.seq_layers.<i> with ln_1 ->
attention.pre_layernorm, attn.attention.{q,k,v}_proj -> attention.{query,key,value},
attn.attention.out_proj -> attention.dense, ln_2 -> output.pre_layernorm, mlp.c_fc ->
output.dense1, mlp.c_proj -> output.dense2; transformer.ln_f -> layernorm; lm_head (tied: the
embedding).
"""

from __future__ import annotations

from typing import Any

from smp.nn.block_parts import ACTIVATIONS
from smp.nn.huggingface import causal_lm
from smp.tensor_parallel import registration

_LAYER = {
    "ln_1": "attention.pre_layernorm",
    "attn.attention.q_proj": "attention.query",
    "attn.attention.k_proj": "attention.key",
    "attn.attention.v_proj": "attention.value",
    "attn.attention.out_proj": "attention.dense",
    "ln_2": "output.pre_layernorm",
    "mlp.c_fc": "output.dense1",
    "mlp.c_proj": "output.dense2",
}
_OLD_BUFFERS = ("attn.attention.bias", "attn.attention.masked_bias")  # causal-mask buffers
_KEYS = causal_lm.ModelKeys(
    embedding="transformer.wte.weight",
    blocks="transformer.h.",
    final_norm="transformer.ln_f",
    heads=("lm_head",),
)
_HF_POSITIONS, _SMP_POSITIONS = "transformer.wpe.weight", "position_embedding.weight"


def _causal_lm_class():
    from transformers import GPTNeoForCausalLM

    return GPTNeoForCausalLM


def _refuse(what: str, fix: str) -> ValueError:
    return causal_lm.unsupported("gptneo", what, fix)


def lm_head_init_hook(config):
    """GPTNeoForCausalLM(config) -> DistributedTransformerLMHead's arguments."""
    if not config.tie_word_embeddings:
        raise _refuse("tie_word_embeddings=False", "GPT-Neo's head is its word embedding: tie them")
    if config.embed_dropout != config.resid_dropout:
        raise _refuse(
            f"embed_dropout={config.embed_dropout} != resid_dropout={config.resid_dropout}",
            "its embeddings are dropped with hidden_dropout_prob: make them equal",
        )
    if config.activation_function not in ACTIVATIONS:
        raise _refuse(
            f"activation_function={config.activation_function!r}", f"use one of {sorted(ACTIVATIONS)}"
        )
    kinds = list(config.attention_layers)
    unknown = sorted(set(kinds) - {"global", "local"})
    if unknown:
        raise _refuse(f"attention layer types {unknown}", "use 'global' and 'local' layers")
    heads, hidden = config.num_heads, config.hidden_size
    return (), {
        "num_layers": config.num_layers,
        "num_attention_heads": heads,
        "attention_head_size": hidden // heads,
        "hidden_size": hidden,
        "intermediate_size": config.intermediate_size or 4 * hidden,
        "vocab_size": config.vocab_size,
        "num_positions": config.max_position_embeddings,
        "attention_dropout_prob": config.attention_dropout,
        "hidden_dropout_prob": config.resid_dropout,
        "activation": config.activation_function,
        "layernorm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range,
        "use_normal_initialization": True,
        "causal_mask_size": config.max_position_embeddings,
        "pre_layernorm": True,
        "post_layernorm": False,
        "num_token_types": 0,
        "add_lm_head": True,
        "use_qkv_bias": False,
        "use_attention_output_bias": True,
        "attention_scores_in_fp32": True,
        "scale_attention_scores": False,
        "attention_windows": [config.window_size if kind == "local" else None for kind in kinds],
    }


def get_hf_gptneo_transformer_lm_head_hooks():
    """(init_hook, forward_hook, return_hook) for registering GPTNeoForCausalLM to
    DistributedTransformerLMHead (SMP's use_distributed_transformer path)."""
    forward_hook = causal_lm.lm_head_forward_hook("gptneo", _causal_lm_class)
    return lm_head_init_hook, forward_hook, causal_lm.lm_head_return_hook


# --- state_dict translation ------------------------------------------------------------------


def _layer_to_smp(layer: dict[str, Any]) -> dict[str, Any]:
    return causal_lm.rename(layer, _LAYER, _OLD_BUFFERS)


def _layer_to_hf(layer: dict[str, Any]) -> dict[str, Any]:
    return causal_lm.rename(layer, {v: k for k, v in _LAYER.items()})


def translate_hf_state_dict_to_smdistributed_gptneo(state_dict: dict[str, Any], *args: Any, **kwargs: Any):
    """A Hugging Face GPT-Neo state_dict -> DistributedTransformerLMHead's keys while
    GPTNeoForCausalLM is registered (or was replaced by default); otherwise `state_dict` itself,
    as smp's graph tensor parallelism keeps Hugging Face's keys (`max_seq_len` and SMP's other
    arguments are accepted)."""
    if registration.registered(_causal_lm_class()) is None:
        return state_dict
    out = causal_lm.model_to_smp(state_dict, _KEYS, _layer_to_smp, True)
    out[_SMP_POSITIONS] = out.pop(_HF_POSITIONS)
    return out


def translate_state_dict_to_hf_gptneo(state_dict: dict[str, Any], *args: Any, **kwargs: Any):
    """A whole DistributedTransformerLMHead's state -> GPTNeoForCausalLM's; a state_dict in Hugging
    Face's keys comes back as it is."""
    if not causal_lm.is_smp_lm_head(state_dict):
        return state_dict
    out = causal_lm.model_to_hf(state_dict, _KEYS, _layer_to_hf)
    out[_HF_POSITIONS] = out.pop(_SMP_POSITIONS)
    return out


translate_hf_gptneo_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_gptneo  # older

__all__ = [
    "get_hf_gptneo_transformer_lm_head_hooks",
    "lm_head_init_hook",
    "translate_hf_gptneo_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_gptneo",
    "translate_state_dict_to_hf_gptneo",
]
