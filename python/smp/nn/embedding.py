"""SMP v1's DistributedEmbedding: an nn.Embedding whose table is cut along embedding_dim.

Each rank looks up its columns of every row and the slices are all-gathered (SMP v1 split this
layer "across the embedding_dim"; its state_dict key is nn.Embedding's `weight`, this rank's
columns). The vocabulary-parallel cut, which ties to an LM head, is DistributedTransformerLMHead's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from smp import ops
from smp.nn import initialization as init
from smp.nn import tp_group
from smp.nn.distributed_module import DistributedModule


class DistributedEmbedding(DistributedModule):
    """SMP v1's DistributedEmbedding(num_embeddings, embedding_dim, ...): nn.Embedding's arguments,
    global sizes; max_norm needs whole rows, so it is refused at tp > 1."""

    SHARD_DIMS = {"weight": 1}

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Tensor | None = None,
        initializer_range: float = 0.02,
        _skip_allgather: bool = False,
        _skip_scatter_and_merge: bool = False,
        use_normal_initialization: bool = False,
        initialize_with_same_seed: bool = False,
    ):
        super().__init__()
        local = tp_group.divide("DistributedEmbedding", "embedding_dim", embedding_dim)
        if max_norm is not None and tp_group.tp_size() > 1:
            raise ValueError(
                f"smp.nn.DistributedEmbedding: max_norm={max_norm} renormalizes whole rows, which no rank "
                "holds when the table is cut along embedding_dim; use max_norm=None, or nn.Embedding"
            )
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        # SMP's _skip_allgather: return this rank's columns, sharded on the last dimension.
        self.skip_allgather = _skip_allgather
        if _weight is not None:
            fill = lambda t, g: t.copy_(_weight)  # noqa: E731  (a whole table given: take its slice)
        elif use_normal_initialization:
            fill = init.normal(initializer_range)
        else:
            fill = init.normal(1.0)  # nn.Embedding's default

        def fill_with_padding(t: Tensor, g: torch.Generator | None) -> None:
            fill(t, g)
            if padding_idx is not None and _weight is None:
                t[padding_idx].zero_()

        self.new_parameter("weight", (num_embeddings, local), 1, fill_with_padding, initialize_with_same_seed)

    def forward(self, input: Tensor) -> Tensor:
        out = F.embedding(
            input,
            self.weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )
        group = self.shard_group()
        if group is None or self.skip_allgather:
            return out
        return ops.tp_gather(out, -1, group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} (embedding_dim sharded)"
