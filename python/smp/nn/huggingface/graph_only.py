"""SMP v1's hook functions for models that smp.nn's layers cannot express (GPT-Neo), and the
translate functions of models the graph pass shards.

SMP v1 registered GPTNeoForCausalLM to its DistributedTransformerLMHead, which had grown options
for it (local attention, unscaled scores). smp's DistributedTransformerLMHead has the options GPT-J
and GPT-NeoX need (gptj.py, gptneox.py) but not GPT-Neo's, so a hook that claimed to map that model
onto it would compute another function. The hook function therefore raises a NotImplementedError
that names what is missing and the path that works: the unmodified model under
`smp.tensor_parallelism()`, which smp's graph tensor parallelism shards (attention heads, MLP,
vocabulary) while keeping Hugging Face's state_dict keys. That is why its translate functions
return the state_dict they are given.
"""

from __future__ import annotations

from typing import Any


def unsupported(model: str, function: str, model_class: str, missing: str) -> NotImplementedError:
    return NotImplementedError(
        f"smp.nn.huggingface.{model}.{function}: smp.nn.DistributedTransformerLMHead cannot compute "
        f"{model_class}: it has no {missing}. Do not register {model_class}; build it unmodified "
        f"under `with smp.tensor_parallelism(): model = {model_class}(config)` (tensor_parallel_degree "
        "> 1): smp's graph tensor parallelism shards its attention heads, MLP and vocabulary and keeps "
        f"Hugging Face's state_dict keys, so translate_hf_state_dict_to_smdistributed_{model} and "
        f"translate_state_dict_to_hf_{model} return the state_dict as it is"
    )


def identity_translation(state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Returns `state_dict`: under graph tensor parallelism the model keeps Hugging Face's keys
    (`max_seq_len` and SMP's other arguments are accepted)."""
    return state_dict
