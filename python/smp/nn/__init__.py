"""smp.nn: the SMP v1 `smp.nn` names real scripts import.

`FusedLayerNorm` is torch's LayerNorm under SMP's name (same arguments and state_dict keys;
torch's kernel is already fused). `smp.nn.huggingface.<model>` holds SMP's state_dict
translate functions, which are identities here: smp trains the model's own modules, so its
state_dicts already have the Hugging Face keys.
"""

from __future__ import annotations

from torch import nn

from smp.nn import huggingface


class FusedLayerNorm(nn.LayerNorm):
    """SMP v1's FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True): nn.LayerNorm."""


__all__ = ["FusedLayerNorm", "huggingface"]
