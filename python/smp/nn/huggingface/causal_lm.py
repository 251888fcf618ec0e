"""What the hooks of Hugging Face's rotary causal LMs (GPT-J, GPT-NeoX) share: the forward and
return hooks that map a `<Model>ForCausalLM` call onto smp.nn.DistributedTransformerLMHead and
a block's call onto DistributedTransformerLayer, and the state_dict translation of the whole model
given each model's key names and per-layer mapping (gptj.py, gptneox.py).

The LM-head hooks compute what the model's forward does for a training or prompt call: HF's mask
(1 = attend) becomes SMP's (1 = masked), labels are shifted as HF's causal-LM loss shifts them,
and the loss is the mean cross entropy over labels != -100 (vocabulary-parallel: logits None).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch

from smp.nn.huggingface import masks

LM_HEAD = "DistributedTransformerLMHead"
LAYER = "DistributedTransformerLayer"


def unsupported(model: str, what: str, fix: str, module: str = LM_HEAD) -> ValueError:
    return ValueError(f"smp.nn.huggingface.{model}: {what} is not supported by {module}; {fix}")


def lm_head_forward_hook(
    model: str, hf_class: Callable[[], type], token_types: str = "token_type_ids"
) -> Callable:
    """The forward hook of `<Model>ForCausalLM` (hf_class() returns the class); `token_types`
    names the refused token_type_ids in the error (with what the model would do with them)."""

    def forward_hook(*args, **kwargs):
        call = inspect.signature(hf_class().forward).bind(None, *args, **kwargs).arguments
        extra = call.pop("kwargs", {})
        cache = call.get("cache", call.get("past_key_values"))
        refused = {
            "inputs_embeds": call.get("inputs_embeds") is not None,
            token_types: call.get("token_type_ids") is not None,
            "encoder_hidden_states (cross attention)": call.get("encoder_hidden_states") is not None,
            "a key/value cache holding earlier tokens": cache is not None and cache.get_seq_length() > 0,
            "logits_to_keep": not isinstance(call.get("logits_to_keep", 0), int)
            or call.get("logits_to_keep"),
            "output_attentions / output_hidden_states": bool(
                extra.get("output_attentions") or extra.get("output_hidden_states")
            ),
            "return_dict=False": extra.get("return_dict") is False,
        }
        for what, bad in refused.items():
            if bad:
                raise unsupported(
                    model, what, "call the model with input_ids, attention_mask, position_ids and labels"
                )
        input_ids, mask, labels = call.get("input_ids"), call.get("attention_mask"), call.get("labels")
        if mask is not None:
            if mask.dim() != 2:
                raise unsupported(
                    model, f"a {mask.dim()}-d attention_mask", "pass HF's [batch, sequence] mask of 1s and 0s"
                )
            mask = (mask == 0).to(torch.long)  # SMP's convention: 1 = masked
        if labels is not None:  # HF compares logits[:, :-1] with labels[:, 1:]
            ignored = torch.full_like(labels[..., :1], -100)
            labels = torch.cat([labels[..., 1:], ignored], dim=-1)
        return ((input_ids, mask, None, call.get("position_ids"), labels),), {}

    return forward_hook


def lm_head_return_hook(output):
    """The loss (given labels; logits None, never gathered) or the logits -> CausalLMOutputWithPast."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if output.dim() == 0:
        return CausalLMOutputWithPast(loss=output)
    return CausalLMOutputWithPast(logits=output)


def layer_forward_hook(model: str, block_class: Callable[[], type]) -> Callable:
    """The forward hook of a block (block_class() returns its class) called with hidden_states, an
    attention mask and position ids: the layer computes its rotary embedding from the position
    ids itself, so the block's precomputed position_embeddings are not needed."""

    def forward_hook(*args, **kwargs):
        call = inspect.signature(block_class().forward).bind(None, *args, **kwargs).arguments
        hidden_states, mask = call["hidden_states"], call.get("attention_mask")
        cache = call.get("cache", call.get("layer_past"))
        if call.get("use_cache") and cache is not None and cache.get_seq_length() > 0:
            raise unsupported(
                model, "a key/value cache holding earlier tokens", "generate with use_cache=False", LAYER
            )
        return ((hidden_states, masks.additive(mask, hidden_states.dtype), call.get("position_ids")),), {}

    return forward_hook


def layer_return_hook(output):
    """(hidden_states, attention_mask, position_ids) -> hidden_states, as the block returns."""
    return output[0]


# --- state_dict translation ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelKeys:
    """A causal LM's Hugging Face keys around its blocks."""

    embedding: str  # "transformer.wte.weight"
    blocks: str  # "transformer.h." (block i's keys start with blocks + "i.")
    final_norm: str  # "transformer.ln_f"
    heads: tuple[str, ...]  # the head's module names read (the first one written): ("lm_head",)


_SMP_BLOCKS = "transformer.seq_layers."
_LayerMap = Callable[[dict[str, Any]], dict[str, Any]]  # one block's {suffix: tensor} -> the other's


def _layers(state_dict: dict[str, Any], blocks: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """{"<i>": {suffix: value}} for the keys under blocks + "<i>.", and the other keys."""
    pattern = re.compile(rf"^{re.escape(blocks)}(\d+)\.(.+)$")
    layers: dict[str, dict[str, Any]] = {}
    rest = {}
    for key, value in state_dict.items():
        match = pattern.match(key)
        if match:
            layers.setdefault(match.group(1), {})[match.group(2)] = value
        else:
            rest[key] = value
    return layers, rest


def _tied(head, embedding, tie: bool | None) -> bool:
    if tie is not None:
        return tie
    if head is None:
        return True  # save_pretrained writes a tied head once, under the embedding's name
    if not isinstance(head, torch.Tensor) or not isinstance(embedding, torch.Tensor):
        return False
    same_storage = head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()
    return same_storage or (head.shape == embedding.shape and torch.equal(head, embedding))


def model_to_smp(
    state_dict: dict[str, Any], keys: ModelKeys, layer_map: _LayerMap, tie: bool | None
) -> dict[str, Any]:
    """A whole `<Model>ForCausalLM` state -> DistributedTransformerLMHead's."""
    layers, rest = _layers(state_dict, keys.blocks)
    out = {"word_embedding.weight": rest.pop(keys.embedding)}
    for kind in ("weight", "bias"):
        out[f"layernorm.{kind}"] = rest.pop(f"{keys.final_norm}.{kind}")
    head = next((name for name in keys.heads if f"{name}.weight" in rest), keys.heads[0])
    weight, bias = rest.pop(f"{head}.weight", None), rest.pop(f"{head}.bias", None)
    if not _tied(weight, out["word_embedding.weight"], tie):
        out["lm_head.weight"] = weight
    if bias is not None:
        out["lm_head.bias"] = bias
    for index, layer in layers.items():
        out.update({f"{_SMP_BLOCKS}{index}.{k}": v for k, v in layer_map(layer).items()})
    out.update(rest)
    return out


def model_to_hf(state_dict: dict[str, Any], keys: ModelKeys, layer_map: _LayerMap) -> dict[str, Any]:
    """DistributedTransformerLMHead's whole state -> `<Model>ForCausalLM`'s (a tied head is the
    embedding's tensor under the head's name, as the HF model's own state_dict has it)."""
    layers, rest = _layers(state_dict, _SMP_BLOCKS)
    out = {keys.embedding: rest.pop("word_embedding.weight")}
    for index, layer in layers.items():
        out.update({f"{keys.blocks}{index}.{k}": v for k, v in layer_map(layer).items()})
    for kind in ("weight", "bias"):
        out[f"{keys.final_norm}.{kind}"] = rest.pop(f"layernorm.{kind}")
    out[f"{keys.heads[0]}.weight"] = rest.pop("lm_head.weight", out[keys.embedding])
    if "lm_head.bias" in rest:
        out[f"{keys.heads[0]}.bias"] = rest.pop("lm_head.bias")
    out.update(rest)
    return out


def blocks_to(state_dict: dict[str, Any], blocks: str, layer_map: _LayerMap) -> dict[str, Any]:
    """Every block under `blocks` mapped by layer_map, its prefix kept (a registered block class)."""
    layers, rest = _layers(state_dict, blocks)
    for index, layer in layers.items():
        rest.update({f"{blocks}{index}.{k}": v for k, v in layer_map(layer).items()})
    return rest


def rename(layer: dict[str, Any], mapping: dict[str, str], dropped: tuple[str, ...] = ()) -> dict[str, Any]:
    """A block's {suffix: tensor} with module names renamed by `mapping` (the rest kept as they
    are, `dropped` suffixes left out: old transformers' mask and rotary buffers)."""
    out = {}
    for suffix, value in layer.items():
        if suffix in dropped:
            continue
        module, _, kind = suffix.rpartition(".")
        out[f"{mapping[module]}.{kind}" if module in mapping else suffix] = value
    return out


def is_smp_lm_head(state_dict: dict[str, Any]) -> bool:
    return "word_embedding.weight" in state_dict and any(k.startswith(_SMP_BLOCKS) for k in state_dict)


def has_smp_blocks(state_dict: dict[str, Any], blocks: str) -> bool:
    return any(k.startswith(blocks) and ".attention.query." in k for k in state_dict)


__all__ = [
    "ModelKeys",
    "blocks_to",
    "has_smp_blocks",
    "is_smp_lm_head",
    "layer_forward_hook",
    "layer_return_hook",
    "lm_head_forward_hook",
    "lm_head_return_hook",
    "model_to_hf",
    "model_to_smp",
    "rename",
    "unsupported",
]


def gpt_layer_kwargs(config) -> dict[str, Any]:
    """The DistributedTransformerLayer arguments of a config with GPT-2's names (GPT-2, GPT-J):
    a pre-LN causal block."""
    return {
        "num_attention_heads": config.n_head,
        "attention_head_size": config.n_embd // config.n_head,
        "hidden_size": config.n_embd,
        "intermediate_size": config.n_inner or 4 * config.n_embd,
        "attention_dropout_prob": config.attn_pdrop,
        "hidden_dropout_prob": config.resid_pdrop,
        "activation": config.activation_function,
        "layernorm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range,
        "use_normal_initialization": True,
        "causal_mask_size": config.n_positions,
        "pre_layernorm": True,
        "post_layernorm": False,
    }
