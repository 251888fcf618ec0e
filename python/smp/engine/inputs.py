"""What the engine does to a microbatch's model inputs and output gradients before running them."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree


def on_device(tree, device: torch.device):
    """CPU tensors moved to `device` (smp.step accepts CPU batches on a GPU rank and has checked
    that no tensor is on another accelerator): the capture and the stages then see the rank's
    device, as the module is there (a tensor made inside from x.device follows)."""
    if device.type == "cpu":
        return tree

    def move(x):
        return x.to(device) if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x

    return pytree.tree_map(move, tree)


def cast_floating(tree, dtype: torch.dtype):
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return pytree.tree_map(cast, tree)


def output_gradients(tensors: list[torch.Tensor], grad_tensors: list, scale: float) -> list[torch.Tensor]:
    """The gradients model.backward starts from: ones for a scalar loss given without one, each
    multiplied by `scale` (averaging over microbatches, fp16 loss scaling)."""
    grads = []
    for t, g in zip(tensors, grad_tensors, strict=True):
        if g is None:
            if t.numel() != 1:
                raise ValueError(
                    f"smp: model.backward got a tensor of shape {tuple(t.shape)} without grad_tensors; "
                    "reduce it to a scalar loss or pass grad_tensors"
                )
            g = torch.ones_like(t)
        grads.append(g * scale if scale != 1.0 else g)
    return grads
