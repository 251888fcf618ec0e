"""What the planner knows about a model: parameter counts and the bytes autograd saves for
backward, per part (the embedding side before the layers, one layer, the head side after
them), for a given sequence length.

From a Hugging Face config (a dict or a config.json) the counts follow the transformer block
the config describes; nothing here is keyed on a model's name. The keys read, whatever the
family calls them: hidden size, layers, heads, key/value heads, head dim, intermediate size,
vocabulary, learned or rotary positions, token types, tied embeddings, gated MLP, norm kind,
biases (where a config does not say: LayerNorm models have them, RMSNorm ones do not), dropout.
Assumptions, stated once:
- attention is fused (PyTorch's scaled_dot_product_attention, as transformers uses by default):
  it saves q, k, v, its output and a per-head log-sum-exp, not the [seq, seq] scores. A config
  that asks for "eager" attention (`attn_implementation` / `_attn_implementation`) saves the
  softmax output too;
- a gated MLP (SwiGLU/GeGLU: silu, swish, swiglu, geglu activations) has three matrices and
  saves four [intermediate] tensors per token, a plain one two matrices and two tensors;
- the loss is computed in fp32 on the logits (transformers upcasts them), saving the fp32
  log-softmax;
- under tensor parallelism every block's matrices, the embedding and the head are sharded
  (the whole model built under smp.tensor_parallelism()); norms and positions stay replicated,
  and so do the tensors saved outside the sharded matmuls (norm inputs and outputs);
- a mixture of experts (moe_facts.py: Mixtral, OLMoE, Qwen-MoE keys) keeps E experts per MoE layer
  and sends each token through top_k of them: the parameters count E experts, the FLOPs and the
  saved activations top_k. Per-layer figures are the average over the layers (MoE and dense).
nn.Modules get measured counts instead: see measured_facts.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from smp.planner import moe_facts
from smp.planner.facts import Matmul, ModelFacts, Params, Saved  # (here too, for callers)
from smp.planner.json_file import read_object

_GATED_ACTIVATIONS = ("silu", "swish", "swiglu", "geglu")
# ATen operations a transformer layer's forward dispatches in eager PyTorch (views included),
# counted with a dispatch mode on Hugging Face blocks: GPT-2 41, Llama 77; dropout adds about
# 35 (GPT-2 with its three dropouts: 76). measured_facts.py counts a module's own.
LAYER_OPS = 60
DROPOUT_OPS = 35
# [intermediate]-sized tensors an activation function saves (its input included). Fused ones
# (gelu, relu, silu, gelu_pytorch_tanh) save their input; transformers' "gelu_new" is a Python
# formula (x * (1 + tanh(...))) whose autograd saves four (measured with measured_facts on GPT-2).
_ACTIVATION_SAVES = {"gelu_new": 4}
_DROPOUT_KEYS = (
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "hidden_dropout",
    "attention_dropout",
    "dropout",
)
_ATTENTION_DROPOUT_KEYS = ("attn_pdrop", "attention_probs_dropout_prob", "attention_dropout")


def load_hf_config(path: str) -> dict[str, Any]:
    """A config.json as a dict, with a clear error for a missing or malformed file."""
    return read_object(path, "the model config", "pass a Hugging Face config.json")


def _first(config: Mapping[str, Any], keys: tuple[str, ...], what: str, default: Any = ...) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is ...:
        raise ValueError(
            f"smp.plan: the model config has no {what} (looked for {', '.join(repr(k) for k in keys)}); "
            "pass a Hugging Face config.json of a transformer"
        )
    return default


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"smp.plan: the model config's {what} must be a positive integer, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class _Shape:
    """The block a Hugging Face config describes, under the names this module uses."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    positions: int  # learned position embeddings (0: rotary or none)
    token_types: int
    tied: bool
    gated: bool
    mlp_saves: int  # [intermediate] tensors a plain MLP saves
    norm_params: int  # per norm: hidden (RMSNorm) or 2 * hidden (LayerNorm)
    attention_bias: bool
    mlp_bias: bool
    dropout: bool
    attention_dropout: bool
    eager_attention: bool


def _shape(config: Mapping[str, Any]) -> _Shape:
    hidden = _positive_int(
        _first(config, ("hidden_size", "n_embd", "d_model", "dim"), "hidden size"), "hidden size"
    )
    heads = _positive_int(
        _first(config, ("num_attention_heads", "n_head", "num_heads"), "head count"), "head count"
    )
    kv_heads = _positive_int(
        _first(config, ("num_key_value_heads", "n_kv_heads"), "", heads), "key/value heads"
    )
    head_dim = _positive_int(_first(config, ("head_dim",), "", hidden // heads), "head dim")
    act = str(_first(config, ("hidden_act", "activation_function", "hidden_activation"), "", "gelu")).lower()
    rotary = any(k.startswith("rope") for k in config) or config.get("position_embedding_type") == "rotary"
    positions = 0 if rotary else int(_first(config, ("n_positions", "max_position_embeddings"), "", 0))
    # Biases where the config says; otherwise LayerNorm-era models (GPT-2, GPT-J, NeoX, Phi, BERT)
    # have them and RMSNorm-era ones (Llama, Mistral, Mixtral, Qwen's MLPs) do not.
    layer_norm = "rms_norm_eps" not in config
    bias = bool(config.get("attention_bias", config.get("bias", config.get("qkv_bias", layer_norm))))
    mlp_saves = 1 + _ACTIVATION_SAVES.get(act, 1)  # the activation's, then the down projection's input
    attn_impl = str(config.get("attn_implementation") or config.get("_attn_implementation") or "sdpa")
    return _Shape(
        hidden=hidden,
        layers=_positive_int(
            _first(config, ("num_hidden_layers", "n_layer", "num_layers"), "layer count"), "layers"
        ),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=_positive_int(
            _first(config, ("intermediate_size", "n_inner", "ffn_dim"), "", 4 * hidden), "intermediate size"
        ),
        vocab=_positive_int(_first(config, ("vocab_size",), "vocabulary size"), "vocabulary size"),
        positions=positions,
        token_types=int(config.get("type_vocab_size") or 0),
        tied=bool(config.get("tie_word_embeddings", True)),  # transformers' default
        gated=any(g in act for g in _GATED_ACTIVATIONS),
        mlp_saves=mlp_saves,
        norm_params=2 * hidden if layer_norm else hidden,
        attention_bias=bias,
        mlp_bias=bool(config.get("mlp_bias", bias and layer_norm)),
        dropout=any(float(config.get(k) or 0) > 0 for k in _DROPOUT_KEYS),
        attention_dropout=any(float(config.get(k) or 0) > 0 for k in _ATTENTION_DROPOUT_KEYS),
        eager_attention=attn_impl == "eager",
    )


def from_hf_config(config: Mapping[str, Any], seq_len: int) -> ModelFacts:
    """Counts for the transformer a Hugging Face config describes, at `seq_len` tokens per sample."""
    if not isinstance(config, Mapping):
        raise ValueError(
            f"smp.plan: model must be a Hugging Face config (dict or path), got {type(config).__name__}"
        )
    s = _shape(config)
    h, hd = s.hidden, s.head_dim
    q, kv = s.heads * hd, s.kv_heads * hd
    n_mats = 3 if s.gated else 2
    attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv + h) if s.attention_bias else 0)
    mlp = n_mats * h * s.intermediate + (((n_mats - 1) * s.intermediate + h) if s.mlp_bias else 0)
    layer = Params(attn + mlp + 2 * s.norm_params, attn + mlp)
    embedding = s.vocab * h
    before = Params(embedding + (s.positions + s.token_types) * h, embedding)
    head = Params(0 if s.tied else embedding, 0 if s.tied else embedding)
    after = Params(head.total + s.norm_params, head.sharded)
    facts = ModelFacts(
        source="Hugging Face config (formula, see smp/planner/model_facts.py)",
        seq_len=seq_len,
        hidden=h,
        layers=s.layers,
        heads=s.heads,
        kv_heads=s.kv_heads,
        vocab=s.vocab,
        before=before,
        layer=layer,
        after=after,
        tied=Params(embedding, embedding) if s.tied else Params(),
        saved_before=_saved_embedding(s, seq_len),
        saved_layer=_saved_layer(s, seq_len),
        saved_after=_saved_head(s, seq_len),
        saved_layer_input=Saved(replicated_elements=seq_len * h),
        logits_elements=seq_len * s.vocab,
        layer_flops_per_token=2 * (attn + mlp) + 4 * seq_len * q,  # matmuls, then scores and context
        head_flops_per_token=2 * embedding,
        matmuls=_matmuls(s),
        head_dim=hd,
        eager_attention=s.eager_attention,
        attention_dropout=s.attention_dropout,
        layer_ops=LAYER_OPS + (DROPOUT_OPS if s.dropout else 0),
    )
    moe = moe_facts.read(config, s.layers, s.intermediate)
    return facts if moe is None else moe_facts.with_experts(facts, s, moe, attn, seq_len)


def _matmuls(s: _Shape) -> tuple[Matmul, ...]:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    first = (2 if s.gated else 1) * s.intermediate  # gate and up side by side, or the one matrix
    return (
        Matmul(s.hidden, q + 2 * kv, "n"),
        Matmul(q, s.hidden, "k"),
        Matmul(s.hidden, first, "n"),
        Matmul(s.intermediate, s.hidden, "k"),
    )


def _saved_embedding(s: _Shape, seq: int) -> Saved:
    # The lookup saves the int64 token ids; the sum with positions saves nothing.
    return Saved(replicated_bytes=seq * (8 + (s.hidden if s.dropout else 0)))


def _saved_layer(s: _Shape, seq: int) -> Saved:
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    # Two norms, each saving its input and its output (the next matmul's input).
    replicated = 4 * h
    # q, k, v and the attention output (also the output projection's input); the MLP's
    # intermediates (gated: gate, up, act(gate), product; plain: the activation's, and its output).
    sharded = q + 2 * kv + q + (4 if s.gated else s.mlp_saves) * s.intermediate
    sharded_bytes = 4 * s.heads  # fp32 log-sum-exp per head
    if s.eager_attention:
        sharded += s.heads * seq  # the softmax output
        if s.dropout:  # its mask, and the dropped-out probabilities the context matmul saves
            sharded_bytes += s.heads * seq
            sharded += s.heads * seq
    replicated_bytes = 2 * h if s.dropout else 0  # residual dropout masks (one byte each)
    return Saved(seq * replicated, seq * sharded, seq * replicated_bytes, seq * sharded_bytes)


def _saved_head(s: _Shape, seq: int) -> Saved:
    # The final norm's input and output, and the loss's fp32 log-softmax (vocab-parallel under
    # tensor parallelism). The logits themselves are not saved (the matmul saves its inputs);
    # they count as working memory while they are alive.
    return Saved(replicated_elements=seq * 2 * s.hidden, sharded_bytes=seq * s.vocab * 4)
