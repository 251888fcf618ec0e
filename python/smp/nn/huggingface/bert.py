"""SMP v1's Bert support: hooks for BertLayer (-> smp.nn.DistributedTransformerLayer) and
BertEncoder (-> smp.nn.DistributedTransformer, SMP's `get_hf_bert_transformer_hooks`), and
state_dict translation (see bert_like.py for the key mapping).

The translate functions work on whole tensors. `translate_hf_state_dict_to_smdistributed_bert`
translates only while BertLayer or BertEncoder is registered to a distributed module (otherwise
smp's graph tensor parallelism keeps Hugging Face's keys and the same dict comes back);
`translate_state_dict_to_hf_bert` translates layers in smp.nn's keys, and returns a state_dict
without any as it is.
"""

from __future__ import annotations

from typing import Any

from smp.nn.huggingface import bert_like
from smp.tensor_parallel import registration


def get_hf_bert_transformer_layer_hooks():
    """(init_hook, forward_hook, return_hook) for registering BertLayer to DistributedTransformerLayer."""
    return bert_like.layer_hooks("bert")


def get_hf_bert_transformer_hooks():
    """(init_hook, forward_hook, return_hook) for registering BertEncoder to DistributedTransformer."""
    return bert_like.encoder_hooks("bert")


def _registered() -> tuple[bool, bool]:
    from transformers.models.bert.modeling_bert import BertEncoder, BertLayer

    encoder = registration.registered(BertEncoder) is not None
    return encoder or registration.registered(BertLayer) is not None, encoder


def translate_hf_state_dict_to_smdistributed_bert(state_dict: dict[str, Any], *args: Any, **kwargs: Any):
    """A Hugging Face Bert state_dict -> the keys of the model built with its classes registered."""
    layer, encoder = _registered()
    return bert_like.to_smdistributed(state_dict, encoder) if layer else state_dict


def translate_state_dict_to_hf_bert(state_dict: dict[str, Any], *args: Any, **kwargs: Any):
    """Layers in smp.nn's keys -> Bert's (`max_seq_len` and SMP's other arguments are accepted)."""
    return bert_like.to_hf(state_dict)


__all__ = [
    "get_hf_bert_transformer_hooks",
    "get_hf_bert_transformer_layer_hooks",
    "translate_hf_state_dict_to_smdistributed_bert",
    "translate_state_dict_to_hf_bert",
]
