"""What the engine does to a microbatch's model inputs, its outputs, and the gradients it starts
the backward from."""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils import _pytree as pytree


def on_device(tree, device: torch.device):
    """CPU tensors moved to `device` (smp.step accepts CPU batches on a GPU rank and has checked
    that no tensor is on another accelerator): the capture and the stages then see the rank's
    device, as the module is there (a tensor made inside from x.device follows)."""

    def move(x):
        return x.to(device) if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x

    return pytree.tree_map(move, tree)


def cast_floating(tree, dtype: torch.dtype):
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return pytree.tree_map(cast, tree)


def output_gradients(
    tensors: list[torch.Tensor], grad_tensors: list, scale: float, implicit_ones: bool = False
) -> list[torch.Tensor | None]:
    """The gradients model.backward starts from: ones for a scalar loss given without one, each
    multiplied by `scale` (averaging over microbatches, fp16 loss scaling). With `implicit_ones`
    (the caller runs torch.autograd.backward itself), an unscaled scalar's stays None: autograd
    makes its ones, as it does for loss.backward()."""
    grads: list[torch.Tensor | None] = []
    for t, g in zip(tensors, grad_tensors, strict=True):
        if g is None:
            if t.numel() != 1:
                raise ValueError(
                    f"smp: model.backward got a tensor of shape {tuple(t.shape)} without grad_tensors; "
                    "reduce it to a scalar loss or pass grad_tensors"
                )
            if implicit_ones and scale == 1.0:
                grads.append(None)
                continue
            g = torch.ones_like(t)
        grads.append(g * scale if scale != 1.0 else g)
    return grads


def guarded(outputs, mb):
    """The model's outputs, a backward into which that did not come through model.backward is an
    error: the step function called loss.backward(), which skips smp's backward (the pipeline's
    gradient messages, loss scaling, averaging). One hook per output tensor, not per parameter.
    The hook holds the microbatch weakly: the microbatch holds the outputs, and a cycle through
    a tensor's hooks is one the garbage collector cannot see (every step's inputs, outputs and,
    without a backward, activations would stay)."""
    hook = None
    for t in _tensors(outputs):
        if t.requires_grad:
            hook = hook or functools.partial(_refuse_manual_backward, weakref.ref(mb))
            t.register_hook(hook)
    return outputs


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in a model's outputs. Tensors, tuples, lists and dicts (Hugging Face's
    ModelOutput is one) are walked here: pytree's walk of a ModelOutput cost tens of microseconds
    a step; other containers go through pytree."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    if tree is None or isinstance(tree, (int, float, bool, str)):
        return []
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _refuse_manual_backward(microbatch: weakref.ref, grad: torch.Tensor) -> None:
    mb = microbatch()
    if mb is not None and mb.backward_calls == 0:
        raise RuntimeError(
            "smp: loss.backward() was called inside an @smp.step function; call model.backward(loss) "
            "instead, which runs this rank's part of the backward and sends gradients to the other stages"
        )
