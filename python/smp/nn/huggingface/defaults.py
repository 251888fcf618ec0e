"""SMP v1's out-of-the-box Hugging Face models: built inside `smp.model_creation(tensor_parallelism=
True)` (or `smp.tensor_parallelism(distributed_transformer=True)`), these classes are replaced by
smp.nn's distributed transformer without any `smp.tp_register` call, as SMP v1 did:

    GPT2LMHeadModel, GPTJForCausalLM, GPTNeoXForCausalLM -> DistributedTransformerLMHead
    GPTNeoForCausalLM                                     -> DistributedTransformerLMHead
    BertEncoder, RobertaEncoder                           -> DistributedTransformer

SMP v1's scripts then reach the layers as `model.get_module().transformer.seq_layers`. Scripts
written for the model's own modules reach the same layers by the Hugging Face path
(`transformer.h`, `gpt_neox.layers`, `encoder.layer`): each replaced model also answers it, as an
attribute (not a registered submodule, so names and state_dict keys are smp.nn's alone).

The classes are registered when their transformers module is imported, so nothing is imported
before a model is built: `enable()` (called by the contexts above) registers the modules already
imported and installs an import hook for the others.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable

from torch import nn

from smp.nn.huggingface import bert, gpt2, gptj, gptneo, gptneox, roberta
from smp.tensor_parallel import registration


def _lm_head() -> type:
    from smp.nn.lm_head import DistributedTransformerLMHead

    return DistributedTransformerLMHead


def _transformer() -> type:
    from smp.nn.transformer import DistributedTransformer

    return DistributedTransformer


# module -> [(class name, distributed module, its hooks, (alias path, target path) pairs)]
_MODELS: dict[str, list[tuple[str, Callable[[], type], Callable[[], tuple], tuple]]] = {
    "transformers.models.gpt2.modeling_gpt2": [
        (
            "GPT2LMHeadModel",
            _lm_head,
            gpt2.get_hf_gpt2_transformer_lm_head_hooks,
            (("transformer.h", "transformer.seq_layers"),),
        )
    ],
    "transformers.models.gptj.modeling_gptj": [
        (
            "GPTJForCausalLM",
            _lm_head,
            gptj.get_hf_gptj_transformer_hooks,
            (("transformer.h", "transformer.seq_layers"),),
        )
    ],
    "transformers.models.gpt_neox.modeling_gpt_neox": [
        (
            "GPTNeoXForCausalLM",
            _lm_head,
            gptneox.get_hf_gptneox_transformer_lm_head_hooks,
            (("gpt_neox", "transformer"), ("transformer.layers", "transformer.seq_layers")),
        )
    ],
    "transformers.models.gpt_neo.modeling_gpt_neo": [
        (
            "GPTNeoForCausalLM",
            _lm_head,
            gptneo.get_hf_gptneo_transformer_lm_head_hooks,
            (("transformer.h", "transformer.seq_layers"),),
        )
    ],
    "transformers.models.bert.modeling_bert": [
        ("BertEncoder", _transformer, bert.get_hf_bert_transformer_hooks, (("layer", "seq_layers"),))
    ],
    "transformers.models.roberta.modeling_roberta": [
        ("RobertaEncoder", _transformer, roberta.get_hf_roberta_transformer_hooks, (("layer", "seq_layers"),))
    ],
}

_lock = threading.Lock()
_done: set[str] = set()


def enable() -> None:
    """Registers the default classes of the transformers modules imported so far, and of the others
    when they are imported."""
    with _lock:
        if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport())
        for name in _MODELS:
            module = sys.modules.get(name)
            if module is not None and getattr(module, "__spec__", None) is not None:
                _register(name, module)


def _register(name: str, module) -> None:
    if name in _done:
        return
    _done.add(name)
    for class_name, dist_module, hooks, aliases in _MODELS[name]:
        cls = getattr(module, class_name, None)
        if cls is not None:
            registration.register_default(cls, dist_module(), hooks(), _aliasing(aliases))


def _aliasing(pairs: tuple) -> Callable[[nn.Module], None]:
    def alias(root: nn.Module) -> None:
        for path, target in pairs:
            owner_path, _, leaf = path.rpartition(".")
            owner = root.get_submodule(owner_path)
            if not hasattr(owner, leaf):
                # In the instance's __dict__: found before nn.Module's lookup, never a submodule.
                object.__setattr__(owner, leaf, root.get_submodule(target))

    return alias


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers a default class right after its transformers module has run (transformers
    imports a model's module lazily, when the model is first built)."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _MODELS or fullname in _done:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            with _lock:
                _register(fullname, module)

        spec.loader.exec_module = exec_module  # this module's loader instance only
        return spec
