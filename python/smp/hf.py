"""What running a Hugging Face transformers model as a captured graph needs, without touching
the model's code."""

from __future__ import annotations

import inspect

import torch


def call_defaults(module: torch.nn.Module) -> dict:
    """Keyword arguments smp adds to every call of a captured transformers model (the caller's win).

    `use_cache=False`: with the cache on (the configs' default) the forward also returns a
    `DynamicCache` of every layer's keys and values. Training never reads it, torch.export
    cannot return it (it is not a pytree), and a pipeline would ship it between stages.
    """
    config = getattr(module, "config", None)
    if config is None or not getattr(config, "use_cache", False):
        return {}
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in parameters else {}


def save_pretrained(module: torch.nn.Module, state_dict: dict, directory: str, **kwargs) -> None:
    """Writes `state_dict` (the full model's) with `module`'s config as transformers would.

    The partitioned module holds only this rank's stage and shards, so the files are written
    from a fresh copy of its class built on the meta device (no memory), given the full weights.
    """
    with torch.device("meta"):
        fresh = type(module)(module.config)
    generation = getattr(module, "generation_config", None)
    if generation is not None:
        fresh.generation_config = generation
    state = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    fresh.save_pretrained(directory, state_dict=state, safe_serialization=True, **kwargs)
