"""SMP v1's distributed transformer blocks: attention, output (MLP) layer, transformer layer and
a stack of layers, with SMP's constructor arguments and tuple-in, tuple-out forwards.

Megatron's cut: query/key/value and the MLP's first linear are column-parallel (each rank holds
num_attention_heads / tp heads and intermediate_size / tp features), the attention output and
the MLP's second linear row-parallel: one all-reduce per block forward and one backward. Norms
and the row-parallel biases are whole on every rank. State_dict keys follow SMP's reference
implementations: attention.{query,key,value,dense}, output.{dense1,dense2}, {pre_,}layernorm.

Residuals: SMP's reference code adds the residual only with post_layernorm; its real layers (and
every pre-LN model registered to them, GPT-2 through SMP's own hooks) add it in both modes, so
here the block returns `layernorm(x + out)` with post_layernorm and `x + out` without.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from smp import ops
from smp.nn import tp_group
from smp.nn.distributed_module import DistributedModule
from smp.nn.sharded_linear import ColumnParallelLinear, RowParallelLinear

ACTIVATIONS = {
    "gelu": F.gelu,
    "relu": F.relu,
    # Hugging Face's name for the tanh approximation GPT-2 uses (smp's addition to SMP's two).
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def _check_layernorms(module: str, pre: bool, post: bool) -> None:
    if not (pre or post):
        raise ValueError(
            f"smp.nn.{module}: pre_layernorm=False and post_layernorm=False; at least one must be True "
            "(SMP v1's rule): set post_layernorm=True (BERT-style) or pre_layernorm=True (GPT-style)"
        )


def _residual(x: Tensor, out: Tensor, fp32: bool) -> Tensor:
    if fp32 and x.dtype != torch.float32:
        return (x.float() + out.float()).to(x.dtype)
    return x + out


class DistributedAttentionLayer(DistributedModule):
    def __init__(
        self,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        cross_attention: bool = False,
        causal_mask_size: int | None = None,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        initialize_with_same_seed: bool = False,
        fp32_residual_addition: bool = False,
    ):
        super().__init__()
        _check_layernorms("DistributedAttentionLayer", pre_layernorm, post_layernorm)
        self.local_heads = tp_group.divide(
            "DistributedAttentionLayer", "num_attention_heads", num_attention_heads
        )
        self.num_attention_heads, self.attention_head_size = num_attention_heads, attention_head_size
        self.hidden_size, self.cross_attention = hidden_size, cross_attention
        self.use_pre_layernorm, self.use_post_layernorm = pre_layernorm, post_layernorm
        self.fp32_residual_addition = fp32_residual_addition
        width = num_attention_heads * attention_head_size
        init = dict(
            use_normal_initialization=use_normal_initialization,
            initializer_range=initializer_range,
            initialize_with_same_seed=initialize_with_same_seed,
        )
        owner = {"owner": "DistributedAttentionLayer"}
        self.query = ColumnParallelLinear(hidden_size, width, **init, **owner)
        self.key = ColumnParallelLinear(hidden_size, width, **init, **owner)
        self.value = ColumnParallelLinear(hidden_size, width, **init, **owner)
        self.dense = RowParallelLinear(width, hidden_size, **init, **owner)
        self.dropout1 = nn.Dropout(attention_dropout_prob)
        self.dropout2 = nn.Dropout(hidden_dropout_prob)
        if pre_layernorm:
            self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        if post_layernorm:
            self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        self.causal_mask_size = causal_mask_size
        if causal_mask_size is not None and not cross_attention:
            causal = torch.tril(torch.ones(causal_mask_size, causal_mask_size, dtype=torch.bool))
            self.register_buffer("causal_mask", causal, persistent=False)  # not a checkpoint entry
        else:
            self.causal_mask = None

    def _heads(self, t: Tensor) -> Tensor:
        """[N, S, local heads * head size] -> [N, local heads, S, head size]."""
        return t.reshape(*t.shape[:-1], self.local_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, inputs):
        if self.cross_attention:
            hidden_states, cross_states, attention_mask = inputs
        else:
            (hidden_states, attention_mask), cross_states = inputs, None
        x = self.pre_layernorm(hidden_states) if self.use_pre_layernorm else hidden_states
        source = x if cross_states is None else cross_states
        q, k, v = self._heads(self.query(x)), self._heads(self.key(source)), self._heads(self.value(source))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        if self.causal_mask is not None:
            sq, sk = scores.shape[-2], scores.shape[-1]
            if sk > self.causal_mask_size:
                raise ValueError(
                    f"smp.nn.DistributedAttentionLayer: sequence length {sk} exceeds causal_mask_size="
                    f"{self.causal_mask_size}; build the layer with causal_mask_size >= the longest sequence"
                )
            keep = self.causal_mask[sk - sq : sk, :sk]
            scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        if attention_mask is not None:  # additive, [N, 1, 1 or S, S]
            mask = attention_mask.to(scores.dtype)
            group = self.shard_group()
            if group is not None and mask.requires_grad:
                # Read by this rank's heads only: its gradient is summed over the group's heads.
                mask = ops.tp_copy(mask, group)
            scores = scores + mask
        probs = self.dropout1(F.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).permute(0, 2, 1, 3)
        context = context.reshape(*context.shape[:-2], self.local_heads * self.attention_head_size)
        out = self.dropout2(self.dense(context))
        out = _residual(hidden_states, out, self.fp32_residual_addition)
        return self.layernorm(out) if self.use_post_layernorm else out


class DistributedTransformerOutputLayer(DistributedModule):
    def __init__(
        self,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        fp32_residual_addition: bool = False,
        initialize_with_same_seed: bool = False,
    ):
        super().__init__()
        _check_layernorms("DistributedTransformerOutputLayer", pre_layernorm, post_layernorm)
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"smp.nn.DistributedTransformerOutputLayer: activation={activation!r} is not one of "
                f"{sorted(ACTIVATIONS)}; pass one of those"
            )
        tp_group.divide("DistributedTransformerOutputLayer", "intermediate_size", intermediate_size)
        self.activation = activation
        self.use_pre_layernorm, self.use_post_layernorm = pre_layernorm, post_layernorm
        self.fp32_residual_addition = fp32_residual_addition
        init = dict(
            use_normal_initialization=use_normal_initialization,
            initializer_range=initializer_range,
            initialize_with_same_seed=initialize_with_same_seed,
            owner="DistributedTransformerOutputLayer",
        )
        self.dense1 = ColumnParallelLinear(hidden_size, intermediate_size, **init)
        self.dense2 = RowParallelLinear(intermediate_size, hidden_size, **init)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        if pre_layernorm:
            self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        if post_layernorm:
            self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)

    def forward(self, inp: Tensor) -> Tensor:
        x = self.pre_layernorm(inp) if self.use_pre_layernorm else inp
        out = self.dropout(self.dense2(ACTIVATIONS[self.activation](self.dense1(x))))
        out = _residual(inp, out, self.fp32_residual_addition)
        return self.layernorm(out) if self.use_post_layernorm else out


class DistributedTransformerLayer(DistributedModule):
    def __init__(
        self,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        initialize_with_same_seed: bool = False,
        fp32_residual_addition: bool = False,
    ):
        super().__init__()
        self.add_cross_attention = add_cross_attention
        common = dict(
            hidden_size=hidden_size,
            hidden_dropout_prob=hidden_dropout_prob,
            layernorm_epsilon=layernorm_epsilon,
            initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization,
            pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm,
            initialize_with_same_seed=initialize_with_same_seed,
            fp32_residual_addition=fp32_residual_addition,
        )
        attention = dict(
            num_attention_heads=num_attention_heads,
            attention_head_size=attention_head_size,
            attention_dropout_prob=attention_dropout_prob,
            **common,
        )
        self.attention = DistributedAttentionLayer(causal_mask_size=causal_mask_size, **attention)
        if add_cross_attention:
            self.cross_attention = DistributedAttentionLayer(cross_attention=True, **attention)
        self.output = DistributedTransformerOutputLayer(
            intermediate_size=intermediate_size, activation=activation, **common
        )

    def forward(self, inputs):
        if self.add_cross_attention:
            hidden_states, cross_states, attention_mask, cross_mask = inputs
        else:
            hidden_states, attention_mask = inputs
        out = self.attention((hidden_states, attention_mask))
        if self.add_cross_attention:
            out = self.cross_attention((out, cross_states, cross_mask))
        out = self.output(out)
        if self.add_cross_attention:
            return out, cross_states, attention_mask, cross_mask
        return out, attention_mask


class DistributedTransformer(DistributedModule):
    """num_layers DistributedTransformerLayers in `seq_layers` (an nn.Sequential), each built with
    the other arguments; forward takes and returns the layers' tuples. With both pre_layernorm and
    post_layernorm, the stack's input and output are normalized too (`pre_layernorm`,
    `layernorm`), as SMP documents."""

    def __init__(
        self,
        num_layers: int = 12,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        initialize_with_same_seed: bool = False,
        fp32_residual_addition: bool = False,
    ):
        super().__init__()
        layer = dict(
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
        )
        self.num_layers = num_layers
        self.seq_layers = nn.Sequential(*(DistributedTransformerLayer(**layer) for _ in range(num_layers)))
        self.outer_norms = pre_layernorm and post_layernorm
        if self.outer_norms:
            self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
            self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)

    def forward(self, inputs):
        if not self.outer_norms:
            return self.seq_layers(inputs)
        out = self.seq_layers((self.pre_layernorm(inputs[0]), *inputs[1:]))
        return (self.layernorm(out[0]), *out[1:])
