"""smp.nn: SMP v1's explicit tensor-parallel modules and the names real scripts import.

The Distributed* modules are real nn.Modules whose parameters are this rank's shards over smp's
tensor-parallel group and whose forwards call smp's sharded ops (`smp.ops`); at
tensor_parallel_degree 1 (or before smp.init) they hold whole weights and compute exactly what
their dense counterparts do. `smp.tp_register` maps a model's own classes onto them. The graph
tensor-parallel pass never cuts their parameters again. `full_state_dict` / `load_full_state_dict`
convert between their shards and whole tensors (collectives over the tensor-parallel group).

`FusedLayerNorm` is torch's LayerNorm under SMP's name (same arguments and state_dict keys;
torch's kernel is already fused). `smp.nn.huggingface.<model>` holds SMP's hooks for Hugging Face
blocks and its state_dict translate functions.
"""

from __future__ import annotations

from torch import nn

from smp.nn import huggingface
from smp.nn.distributed_module import DistributedModule, shard_dims
from smp.nn.embedding import DistributedEmbedding
from smp.nn.full_state import full_state_dict, load_full_state_dict
from smp.nn.lm_head import DistributedTransformerLMHead
from smp.nn.sharded_linear import ColumnParallelLinear, DistributedLinear, RowParallelLinear
from smp.nn.transformer import (
    DistributedAttentionLayer,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerOutputLayer,
)


class FusedLayerNorm(nn.LayerNorm):
    """SMP v1's FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True): nn.LayerNorm."""


DistributedLayerNorm = FusedLayerNorm  # SMP v1's name; a norm is whole on every rank

__all__ = [
    "ColumnParallelLinear",
    "DistributedAttentionLayer",
    "DistributedEmbedding",
    "DistributedLayerNorm",
    "DistributedLinear",
    "DistributedModule",
    "DistributedTransformer",
    "DistributedTransformerLMHead",
    "DistributedTransformerLayer",
    "DistributedTransformerOutputLayer",
    "FusedLayerNorm",
    "RowParallelLinear",
    "full_state_dict",
    "huggingface",
    "load_full_state_dict",
    "shard_dims",
]
