"""SMP v1's GPT-2 support: hooks that map Hugging Face's GPT2Block onto
smp.nn.DistributedTransformerLayer, and state_dict translation between the two.

    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from smp.nn.huggingface.gpt2 import get_hf_gpt2_transformer_layer_hooks
    smp.tp_register_with_module(GPT2Block, smp.nn.DistributedTransformerLayer,
                                *get_hf_gpt2_transformer_layer_hooks())
    with smp.tensor_parallelism():
        model = GPT2LMHeadModel(config)   # every block is a DistributedTransformerLayer

Key mapping of one block (HF's Conv1D weights are [in, out], smp's linears [out, in]):
ln_1 -> attention.pre_layernorm; attn.c_attn (q|k|v fused) -> attention.{query,key,value};
attn.c_proj -> attention.dense; ln_2 -> output.pre_layernorm; mlp.c_fc -> output.dense1;
mlp.c_proj -> output.dense2. The translate functions work on whole tensors (smp.nn.full_state_dict
gathers a distributed model's shards).

Without registration smp's graph tensor parallelism trains GPT2Block itself and keeps Hugging
Face's keys, so the model-level functions return a state_dict with nothing to translate as the
same dict: `translate_hf_state_dict_to_smdistributed_gpt2` translates blocks only while GPT2Block
is registered to a distributed module, `translate_state_dict_to_hf_gpt2` only blocks in smp's keys.
"""

from __future__ import annotations

from typing import Any

import torch

from smp.nn.huggingface import causal_lm, masks
from smp.nn.transformer import ACTIVATIONS
from smp.tensor_parallel import registration

_HF_MARK, _SMP_MARK = "attn.c_attn.weight", "attention.query.weight"
_PAIRS = {  # HF suffix -> smp suffix, for the tensors that move with a transpose of the weight
    "attn.c_proj": "attention.dense",
    "mlp.c_fc": "output.dense1",
    "mlp.c_proj": "output.dense2",
}
_NORMS = {"ln_1": "attention.pre_layernorm", "ln_2": "output.pre_layernorm"}
_QKV = ("query", "key", "value")
_HF_BUFFERS = ("attn.bias", "attn.masked_bias")  # older transformers' causal-mask buffers


def _unsupported(what: str, fix: str, module: str = "DistributedTransformerLayer") -> ValueError:
    return ValueError(f"smp.nn.huggingface.gpt2: {what} is not supported by {module}; {fix}")


def init_hook(config, layer_idx=None):
    """GPT2Block(config, layer_idx) -> DistributedTransformerLayer's arguments."""
    return (), _layer_kwargs(config)


def _layer_kwargs(config) -> dict[str, Any]:
    if config.add_cross_attention:
        raise _unsupported("add_cross_attention=True", "keep GPT2Block unregistered (graph TP shards it)")
    if (
        config.scale_attn_by_inverse_layer_idx
        or config.reorder_and_upcast_attn
        or not config.scale_attn_weights
    ):
        raise _unsupported(
            "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn / scale_attn_weights=False",
            "use GPT-2's default attention scaling, or keep GPT2Block unregistered",
        )
    if config.activation_function not in ACTIVATIONS:
        raise _unsupported(
            f"activation_function={config.activation_function!r}", f"use one of {sorted(ACTIVATIONS)}"
        )
    return causal_lm.gpt_layer_kwargs(config) | {"add_cross_attention": False}


def forward_hook(
    hidden_states,
    cache=None,
    attention_mask=None,
    encoder_hidden_states=None,
    encoder_attention_mask=None,
    use_cache=False,
    **kwargs,
):
    """GPT2Block's call -> ((hidden_states, additive attention mask),), {}."""
    if encoder_hidden_states is not None:
        raise _unsupported("encoder_hidden_states (cross attention)", "keep GPT2Block unregistered")
    if use_cache and cache is not None and cache.get_seq_length() > 0:
        # The layer keeps no keys/values: a first call (training, a prompt) is right, but a call
        # that needs earlier tokens' keys (generation's next step) would silently not be.
        raise _unsupported("a key/value cache holding earlier tokens", "generate with use_cache=False")
    return ((hidden_states, masks.additive(attention_mask, hidden_states.dtype)),), {}


def return_hook(output):
    """(hidden_states, attention_mask) -> hidden_states, as GPT2Block returns."""
    return output[0]


def get_hf_gpt2_transformer_layer_hooks():
    """(init_hook, forward_hook, return_hook) for registering GPT2Block."""
    return init_hook, forward_hook, return_hook


# --- the whole model: GPT2LMHeadModel -> DistributedTransformerLMHead ------------------------


_LM_HEAD = "DistributedTransformerLMHead"


def lm_head_init_hook(config):
    """GPT2LMHeadModel(config) -> DistributedTransformerLMHead's arguments (SMP's
    `use_distributed_transformer`: the embeddings, every block, ln_f and the tied head)."""
    if not config.tie_word_embeddings:
        raise _unsupported(
            "tie_word_embeddings=False",
            "its head is the word embedding: tie them, or register GPT2Block instead",
            _LM_HEAD,
        )
    if config.embd_pdrop != config.resid_pdrop:
        raise _unsupported(
            f"embd_pdrop={config.embd_pdrop} != resid_pdrop={config.resid_pdrop}",
            "its embeddings are dropped with hidden_dropout_prob: make them equal, or register GPT2Block",
            _LM_HEAD,
        )
    layer = _layer_kwargs(config)
    del layer["add_cross_attention"]
    return (), {
        **layer,
        "num_layers": config.n_layer,
        "vocab_size": config.vocab_size,
        "num_positions": config.n_positions,
        "num_token_types": 0,
        "add_lm_head": True,
    }


def _gpt2_lm_head_model() -> type:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel


# GPT2LMHeadModel's call -> ((input_ids, attention_mask, None, position_ids, labels),), {}: HF's mask
# (1 = attend) becomes SMP's (1 = masked), and labels are shifted by one position, as GPT-2 compares
# logits[:, :-1] with labels[:, 1:] (the last position ignored, -100); the rotary models' hook.
lm_head_forward_hook = causal_lm.lm_head_forward_hook(
    "gpt2", _gpt2_lm_head_model, token_types="token_type_ids (GPT-2 adds wte(token_type_ids))"
)


def lm_head_return_hook(output):
    """The loss (given labels) or the logits -> transformers' CausalLMOutputWithCrossAttentions.
    With labels the loss is the vocabulary-parallel cross entropy and logits are None (they are
    never gathered)."""
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    if output.dim() == 0:
        return CausalLMOutputWithCrossAttentions(loss=output)
    return CausalLMOutputWithCrossAttentions(logits=output)


def get_hf_gpt2_transformer_lm_head_hooks():
    """(init_hook, forward_hook, return_hook) for registering GPT2LMHeadModel to
    DistributedTransformerLMHead."""
    return lm_head_init_hook, lm_head_forward_hook, lm_head_return_hook


# --- state_dict translation -------------------------------------------------------


def translate_hf_state_dict_to_smdistributed_gpt2_layer(state_dict: dict[str, Any], prefix: str = ""):
    """One GPT2Block's whole tensors (keys `prefix` + HF suffix) -> DistributedTransformerLayer's."""
    out = {k: v for k, v in state_dict.items() if not k.startswith(prefix)}
    get = lambda suffix: state_dict[prefix + suffix]  # noqa: E731
    for hf, ours in _NORMS.items():
        for kind in ("weight", "bias"):
            out[f"{prefix}{ours}.{kind}"] = get(f"{hf}.{kind}")
    weight, bias = get("attn.c_attn.weight"), get("attn.c_attn.bias")
    for name, w, b in zip(_QKV, weight.chunk(3, dim=1), bias.chunk(3), strict=True):
        out[f"{prefix}attention.{name}.weight"] = w.t().contiguous()
        out[f"{prefix}attention.{name}.bias"] = b.clone()
    for hf, ours in _PAIRS.items():
        out[f"{prefix}{ours}.weight"] = get(f"{hf}.weight").t().contiguous()
        out[f"{prefix}{ours}.bias"] = get(f"{hf}.bias")
    known = {f"{prefix}{s}" for s in _hf_suffixes()} | {prefix + b for b in _HF_BUFFERS}
    out.update({k: v for k, v in state_dict.items() if k.startswith(prefix) and k not in known})
    return out


def translate_state_dict_to_hf_gpt2_layer(state_dict: dict[str, Any], prefix: str = ""):
    """One DistributedTransformerLayer's whole tensors -> GPT2Block's keys (under `prefix`)."""
    out = {k: v for k, v in state_dict.items() if not k.startswith(prefix)}
    get = lambda suffix: state_dict[prefix + suffix]  # noqa: E731
    for hf, ours in _NORMS.items():
        for kind in ("weight", "bias"):
            out[f"{prefix}{hf}.{kind}"] = get(f"{ours}.{kind}")
    out[f"{prefix}attn.c_attn.weight"] = torch.cat([get(f"attention.{n}.weight").t() for n in _QKV], 1)
    out[f"{prefix}attn.c_attn.bias"] = torch.cat([get(f"attention.{n}.bias") for n in _QKV])
    for hf, ours in _PAIRS.items():
        out[f"{prefix}{hf}.weight"] = get(f"{ours}.weight").t().contiguous()
        out[f"{prefix}{hf}.bias"] = get(f"{ours}.bias")
    known = {f"{prefix}{s}" for s in _smp_suffixes()}
    out.update({k: v for k, v in state_dict.items() if k.startswith(prefix) and k not in known})
    return out


def _hf_suffixes() -> list[str]:
    names = [*_NORMS, "attn.c_attn", *_PAIRS]
    return [f"{n}.{kind}" for n in names for kind in ("weight", "bias")]


def _smp_suffixes() -> list[str]:
    names = [*_NORMS.values(), *(f"attention.{n}" for n in _QKV), *_PAIRS.values()]
    return [f"{n}.{kind}" for n in names for kind in ("weight", "bias")]


def _block_prefixes(state_dict: dict[str, Any], mark: str) -> list[str]:
    return [
        k[: -len(mark)]
        for k, v in state_dict.items()
        if k.endswith(mark) and isinstance(v, torch.Tensor) and v.dim() == 2
    ]


# GPT2LMHeadModel's own keys <-> DistributedTransformerLMHead's (blocks: h.<i> <-> seq_layers.<i>).
_LM_HEAD_KEYS = {
    "transformer.wte.weight": "word_embedding.weight",
    "transformer.wpe.weight": "position_embedding.weight",
    "transformer.ln_f.weight": "layernorm.weight",
    "transformer.ln_f.bias": "layernorm.bias",
}
_HF_BLOCKS, _SMP_BLOCKS = "transformer.h.", "transformer.seq_layers."
_HF_HEAD = "lm_head.weight"  # tied to the word embedding: not a separate tensor in smp.nn


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict: dict[str, Any], *args: Any, **kwargs: Any):
    """A Hugging Face GPT-2 state_dict -> the keys of the model built with GPT-2's classes
    registered: DistributedTransformerLMHead's while GPT2LMHeadModel is registered, blocks in
    DistributedTransformerLayer's while GPT2Block is; otherwise `state_dict` itself."""
    from transformers import GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    whole = registration.registered(GPT2LMHeadModel) is not None
    if not whole and registration.registered(GPT2Block) is None:
        return state_dict  # graph TP keeps GPT2Block and its keys
    for prefix in _block_prefixes(state_dict, _HF_MARK):
        state_dict = translate_hf_state_dict_to_smdistributed_gpt2_layer(state_dict, prefix)
    if whole:
        state_dict = {
            _LM_HEAD_KEYS.get(k, _SMP_BLOCKS + k[len(_HF_BLOCKS) :] if k.startswith(_HF_BLOCKS) else k): v
            for k, v in state_dict.items()
            if k != _HF_HEAD
        }
    return state_dict


def translate_state_dict_to_hf_gpt2(state_dict: dict[str, Any], *args: Any, **kwargs: Any):
    """Blocks in DistributedTransformerLayer's keys -> GPT2Block's, and a whole
    DistributedTransformerLMHead's state -> GPT2LMHeadModel's (its tied `lm_head.weight`
    included); a state_dict with neither comes back as the same dict (`max_seq_len` and SMP's
    other arguments are accepted)."""
    reverse = {v: k for k, v in _LM_HEAD_KEYS.items()}
    if "word_embedding.weight" in state_dict:
        state_dict = {
            reverse.get(k, _HF_BLOCKS + k[len(_SMP_BLOCKS) :] if k.startswith(_SMP_BLOCKS) else k): v
            for k, v in state_dict.items()
        }
        state_dict[_HF_HEAD] = state_dict["transformer.wte.weight"]
    for prefix in _block_prefixes(state_dict, _SMP_MARK):
        state_dict = translate_state_dict_to_hf_gpt2_layer(state_dict, prefix)
    return state_dict


__all__ = [
    "forward_hook",
    "get_hf_gpt2_transformer_layer_hooks",
    "get_hf_gpt2_transformer_lm_head_hooks",
    "init_hook",
    "lm_head_forward_hook",
    "lm_head_init_hook",
    "lm_head_return_hook",
    "return_hook",
    "translate_hf_state_dict_to_smdistributed_gpt2",
    "translate_hf_state_dict_to_smdistributed_gpt2_layer",
    "translate_state_dict_to_hf_gpt2",
    "translate_state_dict_to_hf_gpt2_layer",
]
