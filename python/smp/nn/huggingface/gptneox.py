"""SMP v1's GPT-NeoX support: hooks that map Hugging Face's GPTNeoXForCausalLM onto
smp.nn.DistributedTransformerLMHead (SMP's `get_hf_gptneox_transformer_lm_head_hooks`) or its
GPTNeoXLayer onto DistributedTransformerLayer (`get_hf_gptneox_transformer_layer_hooks`), and
state_dict translation.

    from transformers import GPTNeoXForCausalLM
    from smp.nn.huggingface.gptneox import get_hf_gptneox_transformer_lm_head_hooks
    smp.tp_register_with_module(GPTNeoXForCausalLM, smp.nn.DistributedTransformerLMHead,
                                *get_hf_gptneox_transformer_lm_head_hooks())

GPT-NeoX in smp.nn's terms: pre-LN blocks, with use_parallel_residual a parallel residual on two
norms (x + attn(input_layernorm(x)) + mlp(post_attention_layernorm(x)): parallel_attn_output),
without it the usual sequential one; rotary embeddings on the first rotary_pct of each head's
features in rotate_half's layout, with rotary_emb_base (rope_theta); no position table; an
untied head without a bias (`embed_out`, `lm_head` in transformers 5), or the tied embedding.

Key mapping of one layer (all nn.Linear, nothing transposed): input_layernorm ->
attention.pre_layernorm; post_attention_layernorm -> output.pre_layernorm;
attention.query_key_value -> attention.{query,key,value} (HF's fused rows are per head
[q_h, k_h, v_h], head after head: split per head, fused back the same way); attention.dense ->
attention.dense; mlp.dense_h_to_4h -> output.dense1; mlp.dense_4h_to_h -> output.dense2. With the
whole model registered besides: gpt_neox.embed_in -> word_embedding, gpt_neox.layers.<i> ->
transformer.seq_layers.<i>, gpt_neox.final_layer_norm -> layernorm, embed_out / lm_head -> lm_head.

Splitting the fused projection needs the number of heads: the translate functions take
`num_attention_heads=`, and otherwise use the number of the models built with these hooks at
that hidden size (an error if those had different numbers).
"""

from __future__ import annotations

from typing import Any

import torch

from smp.nn.block_parts import ACTIVATIONS
from smp.nn.huggingface import causal_lm
from smp.tensor_parallel import registration

_LAYER = {
    "input_layernorm": "attention.pre_layernorm",
    "post_attention_layernorm": "output.pre_layernorm",
    "attention.dense": "attention.dense",
    "mlp.dense_h_to_4h": "output.dense1",
    "mlp.dense_4h_to_h": "output.dense2",
}
_FUSED, _QKV = "attention.query_key_value", ("query", "key", "value")
# Older transformers' buffers (causal mask, rotary frequencies), not parameters.
_OLD_BUFFERS = ("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq")

# hidden_size -> the numbers of attention heads of the models built with these hooks (see the
# docstring); a width built with two head counts is ambiguous and needs num_attention_heads=.
_heads_by_width: dict[int, set[int]] = {}


def _causal_lm_class():
    from transformers import GPTNeoXForCausalLM

    return GPTNeoXForCausalLM


def _block_class():
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer

    return GPTNeoXLayer


def _keys() -> causal_lm.ModelKeys:
    # transformers 5 calls the head lm_head (and renames embed_out when loading); 4.x embed_out.
    tied = str(getattr(_causal_lm_class(), "_tied_weights_keys", None))
    heads = ("embed_out", "lm_head") if "embed_out" in tied else ("lm_head", "embed_out")
    return causal_lm.ModelKeys(
        embedding="gpt_neox.embed_in.weight",
        blocks="gpt_neox.layers.",
        final_norm="gpt_neox.final_layer_norm",
        heads=heads,
    )


def _refuse(what: str, fix: str, module: str = causal_lm.LM_HEAD) -> ValueError:
    return causal_lm.unsupported("gptneox", what, fix, module)


def _rope(config, module: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor), from rope_parameters (transformers 5) or rotary_* (4.x)."""
    rope = getattr(config, "rope_parameters", None)
    if rope is None:  # transformers 4: rotary_pct, rotary_emb_base and an optional rope_scaling
        rope = {"rope_type": "default" if getattr(config, "rope_scaling", None) is None else "scaled"}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise _refuse(
            f"rope_type={kind!r} (a scaled rotary embedding)",
            "use the default rotary embedding, or keep GPTNeoXForCausalLM unregistered (graph TP shards it)",
            module,
        )
    theta = rope.get("rope_theta", getattr(config, "rotary_emb_base", 10000.0))
    return float(theta), float(rope.get("partial_rotary_factor", getattr(config, "rotary_pct", 1.0)))


def _layer_kwargs(config, module: str) -> dict[str, Any]:
    if config.hidden_act not in ACTIVATIONS:
        raise _refuse(f"hidden_act={config.hidden_act!r}", f"use one of {sorted(ACTIVATIONS)}", module)
    heads = config.num_attention_heads
    head_size = config.hidden_size // heads
    theta, fraction = _rope(config, module)
    bias = getattr(config, "attention_bias", True)
    _heads_by_width.setdefault(config.hidden_size, set()).add(heads)
    return {
        "num_attention_heads": heads,
        "attention_head_size": head_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "attention_dropout_prob": config.attention_dropout,
        "hidden_dropout_prob": config.hidden_dropout,
        "activation": config.hidden_act,
        "layernorm_epsilon": config.layer_norm_eps,
        "initializer_range": config.initializer_range,
        "use_normal_initialization": True,
        "causal_mask_size": config.max_position_embeddings,
        "pre_layernorm": True,
        "post_layernorm": False,
        "rotary_dim": int(head_size * fraction),  # GPT-NeoX's rotary_ndims
        "rotary_interleaved": False,
        "rotary_emb_base": theta,
        "use_qkv_bias": bias,
        "use_attention_output_bias": bias,
        "attention_scores_in_fp32": True,
        "zero_fully_masked_rows": True,  # HF's default (SDPA) attention
        "parallel_attn_output": config.use_parallel_residual,
        "shared_pre_layernorm": False,
    }


def lm_head_init_hook(config):
    """GPTNeoXForCausalLM(config) -> DistributedTransformerLMHead's arguments."""
    return (), {
        **_layer_kwargs(config, causal_lm.LM_HEAD),
        "num_layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "num_positions": config.max_position_embeddings,
        "num_token_types": 0,
        "add_lm_head": True,
        "use_position_embedding": False,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "lm_head_bias": False,
    }


def get_hf_gptneox_transformer_lm_head_hooks():
    """(init_hook, forward_hook, return_hook) for registering GPTNeoXForCausalLM to
    DistributedTransformerLMHead (SMP's use_distributed_transformer path)."""
    forward_hook = causal_lm.lm_head_forward_hook("gptneox", _causal_lm_class)
    return lm_head_init_hook, forward_hook, causal_lm.lm_head_return_hook


get_hf_gptneox_transformer_hooks = get_hf_gptneox_transformer_lm_head_hooks  # GPT-J's spelling


def layer_init_hook(config, layer_idx=None):
    """GPTNeoXLayer(config, layer_idx) -> DistributedTransformerLayer's arguments."""
    return (), _layer_kwargs(config, causal_lm.LAYER)


def get_hf_gptneox_transformer_layer_hooks():
    """(init_hook, forward_hook, return_hook) for registering GPTNeoXLayer to DistributedTransformerLayer."""
    forward_hook = causal_lm.layer_forward_hook("gptneox", _block_class)
    return layer_init_hook, forward_hook, causal_lm.layer_return_hook


# --- state_dict translation ------------------------------------------------------------------


def _heads(width: int, given: int | None) -> int:
    seen = _heads_by_width.get(width, set())
    if given is None and len(seen) > 1:
        raise ValueError(
            f"smp.nn.huggingface.gptneox: GPT-NeoX models of hidden_size={width} were built with "
            f"{sorted(seen)} attention heads, so the fused query_key_value's split is ambiguous: pass "
            "num_attention_heads=config.num_attention_heads"
        )
    heads = given if given is not None else next(iter(seen), None)
    if heads is None:
        raise ValueError(
            f"smp.nn.huggingface.gptneox: the number of attention heads of a model with hidden_size={width} "
            "is unknown (no GPT-NeoX model of that width was built with these hooks), and the fused "
            "query_key_value cannot be split without it: pass num_attention_heads=config.num_attention_heads"
        )
    if width % heads:
        raise ValueError(
            f"smp.nn.huggingface.gptneox: num_attention_heads={heads} does not divide hidden_size={width}"
        )
    return heads


def _layer_to_smp(heads: int | None):
    def convert(layer: dict[str, Any]) -> dict[str, Any]:
        unfused = {k: v for k, v in layer.items() if not k.startswith(_FUSED + ".")}
        out = causal_lm.rename(unfused, _LAYER, _OLD_BUFFERS)
        for kind in ("weight", "bias"):
            fused = layer.get(f"{_FUSED}.{kind}")
            if fused is None:
                continue
            n = _heads(fused.shape[0] // 3, heads)
            # [heads * (q, k, v) * head size, ...] -> per head and part -> each part's rows
            parts = fused.reshape(n, 3, -1, *fused.shape[1:]).unbind(1)
            for name, part in zip(_QKV, parts, strict=True):
                out[f"attention.{name}.{kind}"] = part.reshape(-1, *fused.shape[1:]).contiguous()
        return out

    return convert


def _layer_to_hf(heads: int | None):
    def convert(layer: dict[str, Any]) -> dict[str, Any]:
        parts_of = {f"attention.{name}.{kind}" for name in _QKV for kind in ("weight", "bias")}
        out = causal_lm.rename(
            {k: v for k, v in layer.items() if k not in parts_of}, {v: k for k, v in _LAYER.items()}
        )
        for kind in ("weight", "bias"):
            parts = [layer.get(f"attention.{name}.{kind}") for name in _QKV]
            if parts[0] is None:
                continue
            n = _heads(parts[0].shape[0], heads)
            per_head = [p.reshape(n, -1, *p.shape[1:]) for p in parts]
            out[f"{_FUSED}.{kind}"] = torch.stack(per_head, dim=1).reshape(-1, *parts[0].shape[1:])
        return out

    return convert


def translate_hf_state_dict_to_smdistributed_gptneox(
    state_dict: dict[str, Any],
    *args: Any,
    num_attention_heads: int | None = None,
    tie_word_embeddings: bool | None = None,
    **kwargs: Any,
):
    """A Hugging Face GPT-NeoX state_dict -> the keys of the model built with GPT-NeoX's classes
    registered: DistributedTransformerLMHead's while GPTNeoXForCausalLM is registered, layers in
    DistributedTransformerLayer's while GPTNeoXLayer is; otherwise `state_dict` itself
    (`max_seq_len` and SMP's other arguments are accepted)."""
    keys = _keys()
    if registration.registered(_causal_lm_class()) is not None:
        layer_map = _layer_to_smp(num_attention_heads)
        return causal_lm.model_to_smp(state_dict, keys, layer_map, tie_word_embeddings)
    if registration.registered(_block_class()) is not None:
        return causal_lm.blocks_to(state_dict, keys.blocks, _layer_to_smp(num_attention_heads))
    return state_dict  # graph TP keeps GPTNeoXLayer and its keys


def translate_state_dict_to_hf_gptneox(
    state_dict: dict[str, Any], *args: Any, num_attention_heads: int | None = None, **kwargs: Any
):
    """A whole DistributedTransformerLMHead's state -> GPTNeoXForCausalLM's, layers in
    DistributedTransformerLayer's keys -> GPTNeoXLayer's; a state_dict with neither comes back
    as it is."""
    keys = _keys()
    if causal_lm.is_smp_lm_head(state_dict):
        return causal_lm.model_to_hf(state_dict, keys, _layer_to_hf(num_attention_heads))
    if causal_lm.has_smp_blocks(state_dict, keys.blocks):
        return causal_lm.blocks_to(state_dict, keys.blocks, _layer_to_hf(num_attention_heads))
    return state_dict


# SMP's older name
translate_hf_gptneox_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_gptneox

__all__ = [
    "get_hf_gptneox_transformer_hooks",
    "get_hf_gptneox_transformer_layer_hooks",
    "get_hf_gptneox_transformer_lm_head_hooks",
    "layer_init_hook",
    "lm_head_init_hook",
    "translate_hf_gptneox_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_gptneox",
    "translate_state_dict_to_hf_gptneox",
]
