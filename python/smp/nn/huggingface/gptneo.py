"""SMP v1's GPT-Neo names: `get_hf_gptneo_transformer_lm_head_hooks` (GPTNeoForCausalLM ->
DistributedTransformerLMHead in SMP) and the translate functions. smp.nn cannot express
GPT-Neo (see graph_only.py): the hook function raises a NotImplementedError saying so, and the
graph tensor parallelism shards the unmodified model, whose keys stay Hugging Face's."""

from __future__ import annotations

from smp.nn.huggingface.graph_only import identity_translation, unsupported

_MISSING = (
    "local (windowed) attention for GPT-Neo's 'local' layers, no unscaled attention scores (GPT-Neo "
    "does not divide by sqrt(head size)), and no bias-free q/k/v projections"
)


def get_hf_gptneo_transformer_lm_head_hooks():
    """SMP v1's (init_hook, forward_hook, return_hook) for GPTNeoForCausalLM: not expressible in smp.nn."""
    raise unsupported("gptneo", "get_hf_gptneo_transformer_lm_head_hooks", "GPTNeoForCausalLM", _MISSING)


translate_hf_state_dict_to_smdistributed_gptneo = identity_translation
translate_state_dict_to_hf_gptneo = identity_translation
translate_hf_gptneo_state_dict_to_smdistributed = identity_translation  # the older spelling

__all__ = [
    "get_hf_gptneo_transformer_lm_head_hooks",
    "translate_hf_gptneo_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_gptneo",
    "translate_state_dict_to_hf_gptneo",
]
