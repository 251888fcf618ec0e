"""What smp.nn's attention and MLP layers share: the activations they accept, SMP's rule on their
norms, and the residual addition."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ACTIVATIONS = {
    "gelu": F.gelu,
    "relu": F.relu,
    # Hugging Face's name for the tanh approximation GPT-2 and GPT-J use (smp's addition to SMP's two).
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def check_layernorms(module: str, pre: bool, post: bool) -> None:
    if not (pre or post):
        raise ValueError(
            f"smp.nn.{module}: pre_layernorm=False and post_layernorm=False; at least one must be True "
            "(SMP v1's rule): set post_layernorm=True (BERT-style) or pre_layernorm=True (GPT-style)"
        )


def residual(x: Tensor, out: Tensor, fp32: bool) -> Tensor:
    if fp32 and x.dtype != torch.float32:
        return (x.float() + out.float()).to(x.dtype)
    return x + out
