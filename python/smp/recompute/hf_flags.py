"""Hugging Face's own gradient checkpointing (`model.gradient_checkpointing_enable()`), taken
over by smp: the layers HF would checkpoint become smp requests ("each"), and HF's flags are
turned off, so a layer is never recomputed twice and the capture never traces HF's wrapper."""

from __future__ import annotations

from torch import nn


def take(root: nn.Module) -> list[nn.Module]:
    """The modules HF would checkpoint under `root` (their flags now off), in model order."""
    flagged = [m for m in root.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not flagged:
        return []
    layers: list[nn.Module] = []
    for m in flagged:
        if _checkpoints_itself(m):
            layers.append(m)
        else:  # an older-style model: its forward checkpoints each layer of its layer lists
            for child in m.children():
                if isinstance(child, nn.ModuleList):
                    layers.extend(child)
    for m in flagged:
        m.gradient_checkpointing = False
    return list({id(m): m for m in layers}.values())  # once each, in model order


def _checkpoints_itself(module: nn.Module) -> bool:
    """transformers >= 4.52 layers (GradientCheckpointingLayer) checkpoint their own __call__."""
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)
