"""SMP v1's distributed transformer blocks: the output (MLP) layer, the transformer layer and a
stack of layers, with SMP's constructor arguments and tuple-in, tuple-out forwards (the attention
layer is attention.py's).

Megatron's cut: query/key/value and the MLP's first linear are column-parallel (each rank holds
num_attention_heads / tp heads and intermediate_size / tp features), the attention output and
the MLP's second linear row-parallel: one all-reduce per block forward and one backward. Norms
and the row-parallel biases are whole on every rank. State_dict keys follow SMP's reference
implementations: attention.{query,key,value,dense}, output.{dense1,dense2}, {pre_,}layernorm.

Residuals: SMP's reference code adds the residual only with post_layernorm; its real layers (and
every pre-LN model registered to them, GPT-2 through SMP's own hooks) add it in both modes, so
here the block returns `layernorm(x + out)` with post_layernorm and `x + out` without.

Options beyond SMP's documented arguments (defaults: the documented behaviour), for GPT-J,
GPT-NeoX and GPT-Neo: the attention's (`rotary_dim`, `rotary_interleaved`, `rotary_emb_base`,
`use_qkv_bias`, `use_attention_output_bias`, `attention_scores_in_fp32`, `zero_fully_masked_rows`,
`scale_attention_scores`, `attention_window`; see attention.py), passed through, and the parallel
residual: with `parallel_attn_output=True` (pre-LN only) the attention and the MLP both read the
layer's input x and the layer returns `x + (attention + mlp)` (GPT-NeoX's use_parallel_residual,
each branch with its own norm); `shared_pre_layernorm=True` feeds the MLP the attention's
normalized input instead (GPT-J's single ln_1; the MLP then has no norm). With rotary embeddings
the tuples may carry position_ids third: (hidden_states, attention_mask, position_ids) in and out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from smp.nn import tp_group
from smp.nn.attention import DistributedAttentionLayer, split_attention_inputs
from smp.nn.block_parts import ACTIVATIONS, check_layernorms, residual
from smp.nn.distributed_module import DistributedModule
from smp.nn.sharded_linear import ColumnParallelLinear, RowParallelLinear


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
        _branch_without_norm: bool = False,
    ):
        """`_branch_without_norm` (smp.nn-internal): the MLP branch of a layer with
        shared_pre_layernorm, fed the attention's normalized input: no norm of its own."""
        super().__init__()
        if not _branch_without_norm:
            check_layernorms("DistributedTransformerOutputLayer", pre_layernorm, post_layernorm)
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
        out = self.mlp(self.pre_layernorm(inp) if self.use_pre_layernorm else inp)
        out = residual(inp, out, self.fp32_residual_addition)
        return self.layernorm(out) if self.use_post_layernorm else out

    def mlp(self, x: Tensor) -> Tensor:
        """The MLP's contribution for the (normalized) input x, after its dropout, before any residual."""
        return self.dropout(self.dense2(ACTIVATIONS[self.activation](self.dense1(x))))


def _check_parallel_residual(module: str, parallel: bool, shared: bool, pre: bool, post: bool, cross: bool):
    if shared and not parallel:
        raise ValueError(
            f"smp.nn.{module}: shared_pre_layernorm=True needs parallel_attn_output=True (the MLP reads "
            "the attention's normalized input only when both read the layer's input)"
        )
    if parallel and (not pre or post):
        raise ValueError(
            f"smp.nn.{module}: parallel_attn_output=True with pre_layernorm={pre}, post_layernorm={post}; "
            "the parallel residual (x + attention(norm(x)) + mlp(norm(x))) is pre-LN: set "
            "pre_layernorm=True and post_layernorm=False"
        )
    if parallel and cross:
        raise ValueError(
            f"smp.nn.{module}: parallel_attn_output=True with add_cross_attention=True; a cross "
            "attention sits between the two branches: use parallel_attn_output=False"
        )


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
        attention_window: int | None = None,
    ):
        super().__init__()
        _check_parallel_residual(
            "DistributedTransformerLayer",
            parallel_attn_output,
            shared_pre_layernorm,
            pre_layernorm,
            post_layernorm,
            add_cross_attention,
        )
        self.add_cross_attention = add_cross_attention
        self.parallel_attn_output, self.shared_pre_layernorm = parallel_attn_output, shared_pre_layernorm
        self.fp32_residual_addition = fp32_residual_addition
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
        options = dict(
            rotary_dim=rotary_dim,
            rotary_interleaved=rotary_interleaved,
            rotary_emb_base=rotary_emb_base,
            use_qkv_bias=use_qkv_bias,
            use_attention_output_bias=use_attention_output_bias,
            attention_scores_in_fp32=attention_scores_in_fp32,
            zero_fully_masked_rows=zero_fully_masked_rows,
            scale_attention_scores=scale_attention_scores,
        )
        self.attention = DistributedAttentionLayer(
            causal_mask_size=causal_mask_size, attention_window=attention_window, **attention, **options
        )
        if add_cross_attention:
            self.cross_attention = DistributedAttentionLayer(cross_attention=True, **attention)
        if shared_pre_layernorm:
            common.update(pre_layernorm=False, _branch_without_norm=True)
        self.output = DistributedTransformerOutputLayer(
            intermediate_size=intermediate_size, activation=activation, **common
        )

    def forward(self, inputs):
        if self.add_cross_attention:
            hidden_states, cross_states, attention_mask, cross_mask = inputs
            out = self.attention((hidden_states, attention_mask))
            out = self.output(self.cross_attention((out, cross_states, cross_mask)))
            return out, cross_states, attention_mask, cross_mask
        hidden_states, attention_mask, position_ids = split_attention_inputs(
            "DistributedTransformerLayer", inputs
        )
        if self.parallel_attn_output:
            out = self._parallel_branches(hidden_states, attention_mask, position_ids)
        else:
            out = self.output(self.attention(tuple(inputs)))
        return (out, *inputs[1:])

    def _parallel_branches(self, x: Tensor, attention_mask, position_ids) -> Tensor:
        attention, output = self.attention, self.output
        normed = attention.pre_layernorm(x)
        attn = attention.attend(normed, attention_mask, position_ids)
        mlp = output.mlp(normed if self.shared_pre_layernorm else output.pre_layernorm(x))
        # (attention + mlp) + x: the order GPT-J and GPT-NeoX add them in.
        return residual(x, attn + mlp, self.fp32_residual_addition)


def _windows(windows: Sequence[int | None] | None, num_layers: int) -> list[int | None]:
    if windows is None:
        return [None] * num_layers
    if len(windows) != num_layers:
        raise ValueError(
            f"smp.nn.DistributedTransformer: attention_windows has {len(windows)} entries for "
            f"num_layers={num_layers}; give one per layer (None for global attention)"
        )
    return list(windows)


class DistributedTransformer(DistributedModule):
    """num_layers DistributedTransformerLayers in `seq_layers` (an nn.Sequential), each built with
    the other arguments; forward takes and returns the layers' tuples. With both pre_layernorm and
    post_layernorm, the stack's input and output are normalized too (`pre_layernorm`,
    `layernorm`), as SMP documents. `attention_windows` (smp's addition, GPT-Neo's local layers):
    per layer, its attention_window (None: global)."""

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
    ):
        super().__init__()
        windows = _windows(attention_windows, num_layers)
        layer: dict[str, Any] = dict(
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
        )
        self.num_layers = num_layers
        self.seq_layers = nn.Sequential(
            *(DistributedTransformerLayer(**layer, attention_window=window) for window in windows)
        )
        self.outer_norms = pre_layernorm and post_layernorm
        if self.outer_norms:
            self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
            self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)

    def forward(self, inputs):
        if not self.outer_norms:
            return self.seq_layers(inputs)
        out = self.seq_layers((self.pre_layernorm(inputs[0]), *inputs[1:]))
        return (self.layernorm(out[0]), *out[1:])


__all__ = [
    "ACTIVATIONS",
    "DistributedAttentionLayer",
    "DistributedTransformer",
    "DistributedTransformerLayer",
    "DistributedTransformerOutputLayer",
]
