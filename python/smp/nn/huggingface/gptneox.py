"""SMP v1's GPT-NeoX names: `get_hf_gptneox_transformer_lm_head_hooks` (GPTNeoXForCausalLM ->
DistributedTransformerLMHead in SMP) and the translate functions. smp.nn cannot express
GPT-NeoX (see graph_only.py): the hook function raises a NotImplementedError saying so, and the
graph tensor parallelism shards the unmodified model, whose keys stay Hugging Face's."""

from __future__ import annotations

from smp.nn.huggingface.graph_only import identity_translation, unsupported

_MISSING = (
    "rotary position embeddings (GPT-NeoX's rotary_pct of each head), no parallel residual "
    "(use_parallel_residual: attention and MLP on their own norms of one input, added together), "
    "and no untied output embedding (embed_out)"
)


def get_hf_gptneox_transformer_lm_head_hooks():
    """SMP v1's (init_hook, forward_hook, return_hook) for GPTNeoXForCausalLM: not expressible in smp.nn."""
    raise unsupported("gptneox", "get_hf_gptneox_transformer_lm_head_hooks", "GPTNeoXForCausalLM", _MISSING)


translate_hf_state_dict_to_smdistributed_gptneox = identity_translation
translate_state_dict_to_hf_gptneox = identity_translation
translate_hf_gptneox_state_dict_to_smdistributed = identity_translation  # the older spelling

__all__ = [
    "get_hf_gptneox_transformer_lm_head_hooks",
    "translate_hf_gptneox_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_gptneox",
    "translate_state_dict_to_hf_gptneox",
]
