"""Hugging Face attention masks -> the additive masks smp.nn's attention layers add to scores."""

from __future__ import annotations

import torch
from torch import Tensor


def additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask (True = attend, SDPA's convention) becomes 0 / the dtype's minimum; a float
    mask is already additive; None stays None."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min)
