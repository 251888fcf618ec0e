"""SMP v1's GPT-J names: `get_hf_gptj_transformer_hooks` (GPTJForCausalLM ->
DistributedTransformerLMHead in SMP) and the translate functions. smp.nn cannot express GPT-J
(see graph_only.py): the hook function raises a NotImplementedError saying so, and the graph
tensor parallelism shards the unmodified model, whose keys stay Hugging Face's."""

from __future__ import annotations

from smp.nn.huggingface.graph_only import identity_translation, unsupported

_MISSING = (
    "rotary position embeddings (GPT-J's rotary_dim, applied to part of each head), no parallel "
    "residual (attention and MLP both reading one ln_1, added together), no bias-free q/k/v and "
    "attention-output projections, and no untied LM head with a bias"
)


def get_hf_gptj_transformer_hooks():
    """SMP v1's (init_hook, forward_hook, return_hook) for GPTJForCausalLM: not expressible in smp.nn."""
    raise unsupported("gptj", "get_hf_gptj_transformer_hooks", "GPTJForCausalLM", _MISSING)


translate_hf_state_dict_to_smdistributed_gptj = identity_translation
translate_state_dict_to_hf_gptj = identity_translation
translate_hf_gptj_state_dict_to_smdistributed = identity_translation  # SMP's older name

__all__ = [
    "get_hf_gptj_transformer_hooks",
    "translate_hf_gptj_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_gptj",
    "translate_state_dict_to_hf_gptj",
]
