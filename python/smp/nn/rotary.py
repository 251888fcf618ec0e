"""Rotary position embeddings for smp.nn's attention: the leading `rotary_dim` features of each
query and key head are rotated by angles that grow with the token's position.

Two layouts of the rotated pairs, as Hugging Face's models have them:
- interleaved (GPT-J's `rotate_every_two`): features (0, 1), (2, 3), ... form the pairs;
- halves (GPT-NeoX's and LLaMA's `rotate_half`): feature i pairs with i + rotary_dim / 2.

Angles are computed as both models compute them, in float32 (`position * inv_freq`, with
`inv_freq = 1 / base ** (arange(0, rotary_dim, 2) / rotary_dim)`), and their sines and cosines
cast to the activations' dtype, so a float64 or bf16 model rotates by the same numbers as Hugging
Face's. A rotation acts on each head alone: every tensor-parallel rank rotates its own heads.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check(module: str, rotary_dim: int | None, head_size: int, base: float) -> None:
    """A ValueError naming the bad value when rotary_dim cannot rotate heads of head_size."""
    if rotary_dim is None:
        return
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool) or rotary_dim <= 0:
        raise ValueError(
            f"smp.nn.{module}: rotary_dim={rotary_dim!r} must be a positive int (the number of leading "
            "features of each head to rotate), or None for no rotary embedding"
        )
    if rotary_dim > head_size:
        raise ValueError(
            f"smp.nn.{module}: rotary_dim={rotary_dim} is larger than attention_head_size={head_size}; "
            f"rotate at most the whole head (rotary_dim <= {head_size})"
        )
    if rotary_dim % 2:
        raise ValueError(
            f"smp.nn.{module}: rotary_dim={rotary_dim} is odd; rotations act on pairs of features: use "
            f"an even rotary_dim such as {rotary_dim - 1 if rotary_dim > 1 else 2}"
        )
    if not base > 0:
        raise ValueError(f"smp.nn.{module}: rotary_emb_base={base!r} must be positive (10000 is usual)")


def sin_cos(position_ids: Tensor, rotary_dim: int, base: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """sin and cos of the angles, [..., S, rotary_dim / 2] for position_ids [..., S], in `dtype`."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=position_ids.device)
    inv_freq = 1.0 / (base ** (steps / rotary_dim))
    angles = position_ids[..., None].float() * inv_freq
    return angles.sin().to(dtype), angles.cos().to(dtype)


def _rotate_interleaved(x: Tensor) -> Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rotate_halves(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply(t: Tensor, sin: Tensor, cos: Tensor, rotary_dim: int, interleaved: bool) -> Tensor:
    """Rotates the leading rotary_dim features of t [N, heads, S, head size]; sin and cos are
    [N or 1, S, rotary_dim / 2] (sin_cos's output)."""
    if interleaved:
        sin, cos = sin.repeat_interleave(2, -1), cos.repeat_interleave(2, -1)
        rotate = _rotate_interleaved
    else:
        sin, cos = torch.cat((sin, sin), -1), torch.cat((cos, cos), -1)
        rotate = _rotate_halves
    sin, cos = sin[:, None], cos[:, None]  # one angle per position for every head
    rot, rest = t[..., :rotary_dim], t[..., rotary_dim:]
    return torch.cat(((rot * cos) + (rotate(rot) * sin), rest), dim=-1)
