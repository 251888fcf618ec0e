"""SMP v1's DistributedTransformerLMHead: embeddings, a DistributedTransformer and an LM head
tied to the word embedding.

The word embedding is cut by vocabulary rows (vocab_size / tp per rank); the head reuses those
rows, so its logits are vocab-sharded and, given labels, the loss is the vocabulary-parallel
cross entropy (logits never gathered). Position and token-type embeddings are whole on every rank.

Options beyond SMP's documented arguments (defaults: the documented model), for GPT-J and
GPT-NeoX: the layers' (`rotary_dim`, ..., `parallel_attn_output`, `shared_pre_layernorm`; see
transformer.py), `use_position_embedding=False` (no position table: rotary models; the position
ids then reach every layer's rotary embedding), and `tie_word_embeddings=False`: a head of its
own, `lm_head` (weight [vocab, hidden] cut by vocabulary rows like the embedding, and a bias with
`lm_head_bias=True`, GPT-J's), still vocabulary-parallel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from smp import ops
from smp.nn import initialization as init
from smp.nn import tp_group
from smp.nn.distributed_module import DistributedModule
from smp.nn.sharded_linear import ColumnParallelLinear
from smp.nn.transformer import DistributedTransformer


class VocabParallelEmbedding(DistributedModule):
    """A word embedding cut by rows: this rank holds vocab_size / tp of them (`weight`)."""

    SHARD_DIMS = {"weight": 0}

    def __init__(self, vocab_size: int, hidden_size: int, fill: init.Fill, same_seed: bool):
        super().__init__()
        local = tp_group.divide("DistributedTransformerLMHead", "vocab_size", vocab_size)
        self.new_parameter("weight", (local, hidden_size), 0, fill, same_seed)

    def forward(self, input_ids: Tensor) -> Tensor:
        group = self.shard_group()
        if group is None:
            return F.embedding(input_ids, self.weight)
        start = tp_group.tp_rank() * self.weight.shape[0]
        return ops.vocab_parallel_embedding(input_ids, self.weight, start, None, group)


class _NormalEmbedding(nn.Embedding):
    """A whole table drawn from N(0, std) (use_normal_initialization), also when delayed
    initialization draws it again (reset_parameters)."""

    def __init__(self, num: int, dim: int, std: float):
        self.std = std
        super().__init__(num, dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, self.std)


def _table(num: int, dim: int, normal: bool, std: float) -> nn.Embedding | None:
    if not num:
        return None
    return _NormalEmbedding(num, dim, std) if normal else nn.Embedding(num, dim)


class DistributedTransformerLMHead(DistributedModule):
    """forward(inputs): inputs = (input_ids, attention_mask, token_type_ids, position_ids, labels),
    with (..., cross_states, cross_mask, labels) in the middle under add_cross_attention.
    attention_mask is [N, S] with 1 at masked positions (SMP's convention), or None; token_type_ids
    and position_ids may be None. Returns the loss (mean cross entropy over labels != -100) when
    labels are given, else the logits [N, S, vocab_size] (the hidden states without add_lm_head).
    With pre_layernorm alone a final LayerNorm (`layernorm`) follows the transformer, as pre-LN
    models (GPT-2's ln_f) need."""

    def __init__(
        self,
        num_layers: int = 12,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        vocab_size: int = 30522,
        num_positions: int = 1024,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        num_token_types: int = 0,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        add_lm_head: bool = True,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        initialize_with_same_seed: bool = False,
        fp32_residual_addition: bool = False,
        rotary_dim: int | None = None,
        rotary_interleaved: bool = False,
        rotary_emb_base: float = 10000.0,
        use_qkv_bias: bool = True,
        use_attention_output_bias: bool = True,
        attention_scores_in_fp32: bool = False,
        zero_fully_masked_rows: bool = False,
        parallel_attn_output: bool = False,
        shared_pre_layernorm: bool = False,
        scale_attention_scores: bool = True,
        attention_windows: Sequence[int | None] | None = None,
        use_position_embedding: bool = True,
        tie_word_embeddings: bool = True,
        lm_head_bias: bool = False,
    ):
        super().__init__()
        if lm_head_bias and tie_word_embeddings:
            raise ValueError(
                "smp.nn.DistributedTransformerLMHead: lm_head_bias=True with tie_word_embeddings=True; a "
                "head with a bias is a layer of its own here: pass tie_word_embeddings=False"
            )
        if lm_head_bias and not add_lm_head:
            raise ValueError(
                "smp.nn.DistributedTransformerLMHead: lm_head_bias=True with add_lm_head=False; there is "
                "no head to add the bias to: pass add_lm_head=True or lm_head_bias=False"
            )
        self.vocab_size, self.add_lm_head = vocab_size, add_lm_head
        self.rotary = rotary_dim is not None
        self.add_cross_attention = add_cross_attention
        # A pre-LN stack needs a final norm (GPT-2's ln_f); with both norms the stack ends with one.
        self.use_final_layernorm = pre_layernorm and not post_layernorm
        embedding_fill = init.normal(initializer_range if use_normal_initialization else 1.0)
        self.word_embedding = VocabParallelEmbedding(
            vocab_size, hidden_size, embedding_fill, initialize_with_same_seed
        )
        normal = use_normal_initialization
        positions = num_positions if use_position_embedding else 0
        self.position_embedding = _table(positions, hidden_size, normal, initializer_range)
        self.token_type_embedding = _table(num_token_types, hidden_size, normal, initializer_range)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.transformer = DistributedTransformer(
            num_layers=num_layers,
            num_attention_heads=num_attention_heads,
            attention_head_size=attention_head_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            attention_dropout_prob=attention_dropout_prob,
            hidden_dropout_prob=hidden_dropout_prob,
            activation=activation,
            layernorm_epsilon=layernorm_epsilon,
            initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization,
            causal_mask_size=causal_mask_size,
            add_cross_attention=add_cross_attention,
            pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm,
            initialize_with_same_seed=initialize_with_same_seed,
            fp32_residual_addition=fp32_residual_addition,
            rotary_dim=rotary_dim,
            rotary_interleaved=rotary_interleaved,
            rotary_emb_base=rotary_emb_base,
            use_qkv_bias=use_qkv_bias,
            use_attention_output_bias=use_attention_output_bias,
            attention_scores_in_fp32=attention_scores_in_fp32,
            zero_fully_masked_rows=zero_fully_masked_rows,
            parallel_attn_output=parallel_attn_output,
            shared_pre_layernorm=shared_pre_layernorm,
            scale_attention_scores=scale_attention_scores,
            attention_windows=attention_windows,
        )
        if self.use_final_layernorm:
            self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        # An untied head: vocabulary rows cut as the embedding's (the same vocab_parallel loss).
        self.lm_head = None
        if add_lm_head and not tie_word_embeddings:
            self.lm_head = ColumnParallelLinear(
                hidden_size,
                vocab_size,
                bias=lm_head_bias,
                use_normal_initialization=use_normal_initialization,
                initializer_range=initializer_range,
                initialize_with_same_seed=initialize_with_same_seed,
                owner="DistributedTransformerLMHead",
            )

    def forward(self, inputs):
        if self.add_cross_attention:
            input_ids, attention_mask, token_type_ids, position_ids, cross_states, cross_mask, labels = inputs
        else:
            input_ids, attention_mask, token_type_ids, position_ids, labels = inputs
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        hidden = self.word_embedding(input_ids)
        if self.position_embedding is not None:
            hidden = hidden + self.position_embedding(position_ids)
        if token_type_ids is not None and self.token_type_embedding is not None:
            hidden = hidden + self.token_type_embedding(token_type_ids)
        hidden = self.dropout(hidden)
        mask = None
        if attention_mask is not None:  # 1 = masked -> an additive [N, 1, 1, S] mask
            mask = attention_mask[:, None, None, :].to(hidden.dtype) * torch.finfo(hidden.dtype).min
        if self.add_cross_attention:
            extra = None if cross_mask is None else cross_mask[:, None, None, :].to(hidden.dtype)
            if extra is not None:
                extra = extra * torch.finfo(hidden.dtype).min
            hidden = self.transformer((hidden, cross_states, mask, extra))[0]
        elif self.rotary:  # the layers rotate queries and keys by these positions
            hidden = self.transformer((hidden, mask, position_ids))[0]
        else:
            hidden = self.transformer((hidden, mask))[0]
        if self.use_final_layernorm:
            hidden = self.layernorm(hidden)
        if not self.add_lm_head:
            return hidden
        return self._head(hidden, labels)

    def _head(self, hidden: Tensor, labels: Tensor | None) -> Tensor:
        group = self.shard_group()
        weight = self.word_embedding.weight if self.lm_head is None else self.lm_head.weight
        if self.lm_head is not None:
            # Through its own forward, so the graph pass sees the module and reports its shards.
            logits = self.lm_head(hidden)  # vocab-sharded when group is not None
        elif group is None:
            logits = F.linear(hidden, weight)
        else:
            logits = ops.column_parallel_linear(hidden, weight, None, group)  # vocab-sharded
        if group is None:
            if labels is None:
                return logits
            return F.cross_entropy(logits.flatten(0, -2), labels.flatten())
        if labels is None:
            return ops.tp_gather(logits, -1, group)
        start = tp_group.tp_rank() * weight.shape[0]
        losses = ops.vocab_parallel_cross_entropy(logits, labels, start, -100, group)
        return losses.sum() / (labels != -100).sum()
