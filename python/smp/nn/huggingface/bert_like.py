"""What BERT and RoBERTa share (RobertaLayer is BertLayer): hooks mapping their layer onto
smp.nn.DistributedTransformerLayer and their encoder onto DistributedTransformer (post-LN), and
state_dict translation between the two.

Key mapping of one layer (both sides nn.Linear, so nothing is transposed):
attention.self.{query,key,value} -> attention.{query,key,value}; attention.output.dense ->
attention.dense; attention.output.LayerNorm -> attention.layernorm; intermediate.dense ->
output.dense1; output.dense -> output.dense2; output.LayerNorm -> output.layernorm. With the
encoder registered, `encoder.layer.<i>.` is `encoder.seq_layers.<i>.` besides.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from smp.nn.huggingface import masks
from smp.nn.transformer import ACTIVATIONS

_LAYER = {
    "attention.self.query": "attention.query",
    "attention.self.key": "attention.key",
    "attention.self.value": "attention.value",
    "attention.output.dense": "attention.dense",
    "attention.output.LayerNorm": "attention.layernorm",
    "intermediate.dense": "output.dense1",
    "output.dense": "output.dense2",
    "output.LayerNorm": "output.layernorm",
}
_HF_MARK, _SMP_MARK = "attention.self.query.weight", "attention.query.weight"


def _unsupported(model: str, what: str) -> ValueError:
    return ValueError(
        f"smp.nn.huggingface.{model}: {what} is not supported by smp.nn's transformer layers; keep the "
        "class unregistered (smp's graph tensor parallelism shards it as it is)"
    )


def layer_kwargs(model: str, config) -> dict[str, Any]:
    """DistributedTransformerLayer's arguments for a BERT-style config."""
    if config.is_decoder or config.add_cross_attention:
        raise _unsupported(model, "is_decoder / add_cross_attention")
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        raise _unsupported(model, f"position_embedding_type={config.position_embedding_type!r}")
    if config.hidden_act not in ACTIVATIONS:
        raise _unsupported(model, f"hidden_act={config.hidden_act!r}")
    return {
        "num_attention_heads": config.num_attention_heads,
        "attention_head_size": config.hidden_size // config.num_attention_heads,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "attention_dropout_prob": config.attention_probs_dropout_prob,
        "hidden_dropout_prob": config.hidden_dropout_prob,
        "activation": config.hidden_act,
        "layernorm_epsilon": config.layer_norm_eps,
        "initializer_range": config.initializer_range,
        "use_normal_initialization": True,
        "pre_layernorm": False,
        "post_layernorm": True,
    }


def layer_hooks(model: str) -> tuple[Callable, Callable, Callable]:
    """(init_hook, forward_hook, return_hook) for BertLayer / RobertaLayer."""

    def init_hook(config, layer_idx=None):
        return (), layer_kwargs(model, config)

    def forward_hook(
        hidden_states,
        attention_mask=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        cache=None,
        **kwargs,
    ):
        if encoder_hidden_states is not None:
            raise _unsupported(model, "encoder_hidden_states (cross attention)")
        return ((hidden_states, masks.additive(attention_mask, hidden_states.dtype)),), {}

    return init_hook, forward_hook, lambda output: output[0]


def encoder_hooks(model: str) -> tuple[Callable, Callable, Callable]:
    """(init_hook, forward_hook, return_hook) for BertEncoder / RobertaEncoder (SMP's
    `get_hf_<model>_transformer_hooks`): the encoder becomes a DistributedTransformer."""

    def init_hook(config):
        return (), {"num_layers": config.num_hidden_layers, **layer_kwargs(model, config)}

    def forward_hook(
        hidden_states,
        attention_mask=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        cache=None,
        use_cache=None,
        **kwargs,
    ):
        if encoder_hidden_states is not None:
            raise _unsupported(model, "encoder_hidden_states (cross attention)")
        return ((hidden_states, masks.additive(attention_mask, hidden_states.dtype)),), {}

    def return_hook(output):
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=output[0])

    return init_hook, forward_hook, return_hook


def _rename(state_dict: dict[str, Any], mark: str, mapping: dict[str, str], layers: tuple[str, str] | None):
    prefixes = [
        k[: -len(mark)] for k, v in state_dict.items() if k.endswith(mark) and isinstance(v, torch.Tensor)
    ]
    if not prefixes:
        return state_dict  # nothing to translate: the same dict
    out = {}
    for key, value in state_dict.items():
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is not None:
            rest = key[len(prefix) :]
            module, _, kind = rest.rpartition(".")
            key = prefix + (f"{mapping[module]}.{kind}" if module in mapping else rest)
            if layers is not None:
                key = re.sub(rf"(^|\.){layers[0]}\.(\d+)\.", rf"\1{layers[1]}.\2.", key, count=1)
        out[key] = value
    return out


def to_smdistributed(state_dict: dict[str, Any], encoder_registered: bool) -> dict[str, Any]:
    return _rename(state_dict, _HF_MARK, _LAYER, ("layer", "seq_layers") if encoder_registered else None)


def to_hf(state_dict: dict[str, Any]) -> dict[str, Any]:
    reverse = {v: k for k, v in _LAYER.items()}
    return _rename(state_dict, _SMP_MARK, reverse, ("seq_layers", "layer"))
