"""SMP v1's DistributedAttentionLayer: multi-head attention with its heads cut over the
tensor-parallel group.

query/key/value are column-parallel (each rank computes num_attention_heads / tp heads), the
output projection `dense` row-parallel (one all-reduce). Everything per head (rotary embeddings,
scores, masks, softmax) runs on this rank's heads only.

Options beyond SMP's documented arguments, for the rotary models Hugging Face has (each defaults
to the documented behaviour):
- `rotary_dim`: rotate the leading rotary_dim features of every query and key head by the
  token's position (rotary.py), with `rotary_interleaved` (GPT-J's pairs) or not (GPT-NeoX's
  halves) and `rotary_emb_base`. The input tuple may then carry position_ids third:
  `(hidden_states, attention_mask, position_ids)` (default: 0, 1, ... along the sequence).
- `use_qkv_bias` / `use_attention_output_bias`: GPT-J's projections have no biases.
- `attention_scores_in_fp32`: with fp16/bf16 activations, q·kᵀ, the masks and the softmax in
  float32 and the probabilities cast back, as GPT-J's and GPT-NeoX's attention do.
- `zero_fully_masked_rows`: a query whose every key is masked (a left-padded position under the
  causal mask) attends to nothing (zero probabilities), as torch's scaled_dot_product_attention,
  Hugging Face's default attention, has it; otherwise (SMP's) the softmax of its masked scores.
- `scale_attention_scores=False`: q·kᵀ is not divided by sqrt(head size) (GPT-Neo's).
- `attention_window=W` (with causal_mask_size): local attention, each query sees itself and the
  W - 1 keys before it (GPT-Neo's "local" layers, its window_size).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from smp import ops
from smp.nn import rotary, tp_group
from smp.nn.block_parts import check_layernorms, residual
from smp.nn.distributed_module import DistributedModule
from smp.nn.sharded_linear import ColumnParallelLinear, RowParallelLinear

_HALF = (torch.float16, torch.bfloat16)


def split_attention_inputs(module: str, inputs) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(hidden_states, attention_mask[, position_ids]) -> the three, position_ids None if absent."""
    if not isinstance(inputs, (tuple, list)) or len(inputs) not in (2, 3):
        raise ValueError(
            f"smp.nn.{module}: expected the tuple (hidden_states, attention_mask) or (hidden_states, "
            f"attention_mask, position_ids), got {type(inputs).__name__} of length "
            f"{len(inputs) if isinstance(inputs, (tuple, list)) else 'n/a'}"
        )
    return inputs[0], inputs[1], inputs[2] if len(inputs) == 3 else None


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
        rotary_dim: int | None = None,
        rotary_interleaved: bool = False,
        rotary_emb_base: float = 10000.0,
        use_qkv_bias: bool = True,
        use_attention_output_bias: bool = True,
        attention_scores_in_fp32: bool = False,
        zero_fully_masked_rows: bool = False,
        scale_attention_scores: bool = True,
        attention_window: int | None = None,
    ):
        super().__init__()
        check_layernorms("DistributedAttentionLayer", pre_layernorm, post_layernorm)
        _check_window(attention_window, causal_mask_size, cross_attention)
        rotary.check("DistributedAttentionLayer", rotary_dim, attention_head_size, rotary_emb_base)
        if rotary_dim is not None and cross_attention:
            raise ValueError(
                f"smp.nn.DistributedAttentionLayer: rotary_dim={rotary_dim} with cross_attention=True; "
                "rotary embeddings rotate a sequence's queries against its own keys: use rotary_dim=None "
                "for cross attention"
            )
        self.local_heads = tp_group.divide(
            "DistributedAttentionLayer", "num_attention_heads", num_attention_heads
        )
        self.num_attention_heads, self.attention_head_size = num_attention_heads, attention_head_size
        self.hidden_size, self.cross_attention = hidden_size, cross_attention
        self.use_pre_layernorm, self.use_post_layernorm = pre_layernorm, post_layernorm
        self.fp32_residual_addition = fp32_residual_addition
        self.rotary_dim, self.rotary_interleaved = rotary_dim, rotary_interleaved
        self.rotary_emb_base = float(rotary_emb_base)
        self.attention_scores_in_fp32 = attention_scores_in_fp32
        self.zero_fully_masked_rows = zero_fully_masked_rows
        self.score_divisor = math.sqrt(attention_head_size) if scale_attention_scores else None
        width = num_attention_heads * attention_head_size
        init = dict(
            use_normal_initialization=use_normal_initialization,
            initializer_range=initializer_range,
            initialize_with_same_seed=initialize_with_same_seed,
        )
        owner = {"owner": "DistributedAttentionLayer"}
        self.query = ColumnParallelLinear(hidden_size, width, bias=use_qkv_bias, **init, **owner)
        self.key = ColumnParallelLinear(hidden_size, width, bias=use_qkv_bias, **init, **owner)
        self.value = ColumnParallelLinear(hidden_size, width, bias=use_qkv_bias, **init, **owner)
        self.dense = RowParallelLinear(width, hidden_size, bias=use_attention_output_bias, **init, **owner)
        self.dropout1 = nn.Dropout(attention_dropout_prob)
        self.dropout2 = nn.Dropout(hidden_dropout_prob)
        if pre_layernorm:
            self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        if post_layernorm:
            self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        self.causal_mask_size = causal_mask_size
        if causal_mask_size is not None and not cross_attention:
            causal = torch.tril(torch.ones(causal_mask_size, causal_mask_size, dtype=torch.bool))
            if attention_window is not None:  # and not the keys attention_window or more back
                causal = causal & ~torch.tril(causal, -attention_window)
            self.register_buffer("causal_mask", causal, persistent=False)  # not a checkpoint entry
        else:
            self.causal_mask = None

    def _heads(self, t: Tensor) -> Tensor:
        """[N, S, local heads * head size] -> [N, local heads, S, head size]."""
        return t.reshape(*t.shape[:-1], self.local_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, inputs):
        if self.cross_attention:
            (hidden_states, cross_states, attention_mask), position_ids = inputs, None
        else:
            hidden_states, attention_mask, position_ids = split_attention_inputs(
                "DistributedAttentionLayer", inputs
            )
            cross_states = None
        x = self.pre_layernorm(hidden_states) if self.use_pre_layernorm else hidden_states
        out = self.attend(x, attention_mask, position_ids, cross_states)
        out = residual(hidden_states, out, self.fp32_residual_addition)
        return self.layernorm(out) if self.use_post_layernorm else out

    def attend(
        self,
        x: Tensor,
        attention_mask: Tensor | None,
        position_ids: Tensor | None = None,
        cross_states: Tensor | None = None,
    ) -> Tensor:
        """The attention's contribution for the (normalized) input x: the output projection after
        its dropout, before any residual (what a parallel-residual layer adds up)."""
        source = x if cross_states is None else cross_states
        q, k, v = self._heads(self.query(x)), self._heads(self.key(source)), self._heads(self.value(source))
        if self.rotary_dim is not None:
            q, k = self._rotate(q, k, position_ids)
        if self.attention_scores_in_fp32 and q.dtype in _HALF:
            q, k = q.float(), k.float()
        scores = torch.matmul(q, k.transpose(-1, -2))
        if self.score_divisor is not None:
            scores = scores / self.score_divisor
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
        probs = F.softmax(scores, dim=-1)
        if self.zero_fully_masked_rows:
            # Masked scores sit at the dtype's minimum (or -inf); a row without any other attends to nothing.
            visible = scores > torch.finfo(scores.dtype).min / 2
            probs = probs.masked_fill(~visible.any(-1, keepdim=True), 0.0)
        probs = self.dropout1(probs.to(v.dtype))
        context = torch.matmul(probs, v).permute(0, 2, 1, 3)
        context = context.reshape(*context.shape[:-2], self.local_heads * self.attention_head_size)
        return self.dropout2(self.dense(context))

    def _rotate(self, q: Tensor, k: Tensor, position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        if position_ids is None:
            position_ids = torch.arange(q.shape[-2], device=q.device)[None]
        elif position_ids.dim() == 1:
            position_ids = position_ids[None]
        sin, cos = rotary.sin_cos(position_ids, self.rotary_dim, self.rotary_emb_base, q.dtype)
        return (
            rotary.apply(q, sin, cos, self.rotary_dim, self.rotary_interleaved),
            rotary.apply(k, sin, cos, self.rotary_dim, self.rotary_interleaved),
        )


def _check_window(window: int | None, causal_mask_size: int | None, cross_attention: bool) -> None:
    if window is None:
        return
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(
            f"smp.nn.DistributedAttentionLayer: attention_window={window!r} must be a positive int (the "
            "number of keys a query sees: itself and the ones before it)"
        )
    if causal_mask_size is None or cross_attention:
        raise ValueError(
            f"smp.nn.DistributedAttentionLayer: attention_window={window} needs causal self-attention; "
            "pass causal_mask_size (the longest sequence) and cross_attention=False"
        )


__all__ = ["DistributedAttentionLayer", "split_attention_inputs"]
