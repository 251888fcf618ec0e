"""SMP v1's Hugging Face support: `smp.nn.huggingface.<model>`.

SMP v1 replaced Hugging Face layers by its own distributed transformer classes, whose
state_dict keys differed, and shipped hooks for registering them and functions that renamed
keys both ways. `gpt2`, `gptj`, `gptneox`, `bert` and `roberta` (gpt2.py, gptj.py, gptneox.py,
bert.py, roberta.py) have SMP's hooks for their blocks or whole models and real translate
functions (see there; causal_lm.py holds what the rotary models share). `gptneo` has SMP's hook
function, which raises a NotImplementedError naming what smp.nn's layers lack (local attention,
unscaled scores: graph_only.py), and translate functions that return the state_dict they are
given, as for the other models: smp's graph tensor parallelism shards the model's own layers and
keeps the module's keys (`max_seq_len` and other SMP arguments are accepted). The submodules
gpt2, gptj, gptneo, gptneox, bert, roberta, t5 and vit each hold the names SMP's did, so
`from smp.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2` (and the same under
`smdistributed.modelparallel.torch`) works unchanged.
"""

from __future__ import annotations

import sys
import types

from smp.nn.huggingface.graph_only import identity_translation

MODELS = ("gpt2", "gptj", "gptneo", "gptneox", "bert", "roberta", "t5", "vit")


def _translate_names(model: str) -> list[str]:
    names = [
        f"translate_state_dict_to_hf_{model}",
        f"translate_hf_state_dict_to_smdistributed_{model}",
        f"translate_hf_{model}_state_dict_to_smdistributed",  # the older GPT-J spelling
    ]
    if model == "gpt2":  # per-layer variants
        names += [
            "translate_state_dict_to_hf_gpt2_layer",
            "translate_hf_state_dict_to_smdistributed_gpt2_layer",
        ]
    return names


def _submodule(model: str) -> types.ModuleType:
    module = types.ModuleType(
        f"{__name__}.{model}", f"SMP v1's {model} translate functions (identities in smp)."
    )
    for name in _translate_names(model):
        setattr(module, name, identity_translation)
    module.__all__ = _translate_names(model)
    return module


_REAL = ("gpt2", "gptj", "gptneo", "gptneox", "bert", "roberta")  # modules of their own

for _model in MODELS:
    if _model not in _REAL:
        globals()[_model] = sys.modules[f"{__name__}.{_model}"] = _submodule(_model)

from smp.nn.huggingface import bert, gpt2, gptj, gptneo, gptneox, roberta  # noqa: E402, F401  (in MODELS)

__all__ = ["MODELS", "identity_translation", *MODELS]
