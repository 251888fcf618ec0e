"""The work of one microbatch on one pipeline rank, in seconds on a Hardware: its matmuls, its
memory-bound kernels and its tensor-parallel collectives, forward and backward.

- Matmuls: each of a layer's matrices as its tensor-parallel shard (model_facts.Matmul), forward
  [T, k] x [k, n], backward the input gradient [T, n] x [n, k] and the weight gradient
  [k, T] x [T, n] (T = the microbatch's tokens). Attention's scores and context are batched
  matmuls per head: eager attention writes and reads the [seq, seq] scores through memory (the
  roofline makes them memory-bound), fused attention (sdpa / flash) keeps them on chip, and its
  backward computes the scores again (2.5 forwards of matmuls, as FlashAttention's), all at the
  hardware's fused-attention rate (`attention_tflops`; by default its matmul rate).
- Memory-bound kernels (norms, activations, softmax, dropout, residual adds): a module's layer
  has its forward's elementwise bytes measured (measured_facts.py: every operation's inputs and
  outputs, views and matmuls left out); a config's are estimated from what autograd saves
  (model_facts.Saved, the validated memory model): each saved tensor was written by one kernel and
  read by the next in the forward (2x its bytes). The backward reads what the forward wrote and
  writes and reads the gradients: 1.5 times the forward's bytes. Each dispatched operation pays the
  hardware's per-kernel overhead (forward: the layer's ATen operations; backward: 1.6 times as
  many, as measured on Hugging Face GPT-2 and Llama blocks).
- Transcendental operations (exp, tanh, log, erf, sigmoid, softmax), where measured on a module:
  each element costs the hardware's `transcendental_ns` beyond its memory traffic (a CPU core: a
  few ns; a GPU: 0, its special-function units keep them memory-bound): a layer's forward and
  backward elements, cut as its bytes; the head side's (the loss over the logits) once per
  microbatch, vocabulary-parallel under TP.
- Checkpointed layers run their forward once more in the backward (matmuls, kernels and TP
  collectives).
- Context parallelism (cp = C): every rank runs 1/C of each sequence's tokens, so its matmuls,
  memory-bound kernels and TP collectives are those of mb x seq / C tokens, and attention's
  quadratic part is 1/C too (the load-balanced cut gives each rank 1/C of the score blocks). cp's
  own traffic around attention is context_costs.py's.
- A mixture of experts: each MoE layer's routed experts' matrices (model_facts.Matmul.experts) run
  as E/ep grouped matmuls on the rank (its whole experts), each on its share of the top_k x T
  (token, expert) pairs that reach the rank's experts: top_k x T x ep / E rows each, the router
  sending evenly. So the compute per token is top_k experts', not E's. Under ep with tensor
  parallelism each expert is whole, and each tp rank sends its 1/tp of the tp group's tokens. A matrix
  only some layers have (MoE and dense layers mixed) counts for its share of them. ep's all-to-alls are
  expert_costs.py's.
- Tensor parallelism all-reduces the layer's [T, hidden] output twice forward and its input
  gradient twice backward (attention and MLP), and the embedding's output and the head's input
  gradient once each; it brings the tp group's inputs together on every stage, and the
  vocabulary-parallel loss all-reduces its maximum and sums on the last (latency-bound: a few
  bytes a token); nothing overlaps them.
"""

from __future__ import annotations

import dataclasses

from smp.planner import kernels
from smp.planner.hardware import Hardware
from smp.planner.layout import Layout
from smp.planner.memory import Workload, compute_bytes, held
from smp.planner.model_facts import ModelFacts
from smp.planner.runtime_costs import SMP, RuntimeCosts

BACKWARD_OPS = 1.6  # backward ATen operations per forward one (HF GPT-2: 1.76, Llama: 1.77)
FORWARD_TRAFFIC, BACKWARD_TRAFFIC = 2.0, 3.0  # memory traffic per byte autograd saves
FUSED_ATTENTION_BACKWARD = 2.5  # FlashAttention's backward: 5 matmuls to the forward's 2


@dataclasses.dataclass(frozen=True)
class Pass:
    """Seconds of a forward or backward of one microbatch through some layers."""

    matmul: float = 0.0
    memory: float = 0.0  # memory-bound kernels and per-kernel overheads
    tp_comm: float = 0.0

    def __add__(self, other: Pass) -> Pass:
        return Pass(self.matmul + other.matmul, self.memory + other.memory, self.tp_comm + other.tp_comm)

    def __mul__(self, k: float) -> Pass:
        return Pass(self.matmul * k, self.memory * k, self.tp_comm * k)

    @property
    def total(self) -> float:
        return self.matmul + self.memory + self.tp_comm


@dataclasses.dataclass(frozen=True)
class RankWork:
    """One microbatch on one pipeline rank: forward, backward (recompute included)."""

    rank: int
    forward: Pass
    backward: Pass

    @property
    def total(self) -> float:
        return self.forward.total + self.backward.total


def dtype_of(layout: Layout) -> str:
    return "bf16" if layout.bf16 else "fp16" if layout.fp16 else "fp32"


def rank_work(
    facts: ModelFacts,
    layout: Layout,
    workload: Workload,
    hw: Hardware,
    rank: int,
    mb: int,
    runtime: RuntimeCosts = SMP,
) -> RankWork:
    layers, first, last = held(layout, rank, facts.layers)
    fwd_layer, bwd_layer = _layer(facts, layout, workload, hw, mb)
    forward = fwd_layer * layers
    backward = bwd_layer * layers
    if layout.checkpoint_group:
        backward = backward + fwd_layer * layers  # the recomputed forward
    tokens = rank_tokens(layout, workload, mb)
    boundary = tokens * facts.hidden * compute_bytes(layout)
    tp_group = kernels.Group(layout.tp, 1)
    tp_one = kernels.all_reduce(hw, boundary, tp_group, workload.gpus_per_node, workload.gpus)
    forward = forward + Pass(tp_comm=_input_gathers(layout, workload, hw, runtime, tokens))
    if first:
        forward = forward + Pass(tp_comm=tp_one) + _saved_traffic(facts.saved_before, layout, hw, mb)
        backward = backward + _saved_traffic(facts.saved_before, layout, hw, mb, backward=True)
    if last:
        head_f, head_b = _head(facts, layout, hw, tokens)
        # The loss's exp and log over the logits (vocabulary-parallel under TP), forward and backward.
        loss = kernels.transcendental(hw, facts.head_transcendental * mb / (layout.tp * layout.cp))
        head_f = head_f + Pass(memory=loss)
        head_f = head_f + Pass(tp_comm=_loss_all_reduces(layout, workload, hw, runtime, tokens))
        if runtime.gathers_logits:
            head_f = head_f + _logits_out(facts, layout, workload, hw, mb)
        forward = forward + head_f + _saved_traffic(facts.saved_after, layout, hw, mb)
        backward = backward + head_b + Pass(tp_comm=tp_one)
        backward = backward + _saved_traffic(facts.saved_after, layout, hw, mb, backward=True)
    return RankWork(rank, forward, backward)


def _input_gathers(
    layout: Layout, workload: Workload, hw: Hardware, runtime: RuntimeCosts, tokens: int
) -> float:
    """The tp group's inputs brought together on every stage (smp: each input tensor all-gathered
    into SMP v1's combined batch, every stage running with the step's inputs; Megatron: broadcast
    from tp rank 0 on the stages that read the batch): the tokens' int64 ids, latency-bound.
    Under prescaled_batch the tp ranks read the same batch: nothing to bring together."""
    if layout.tp == 1 or layout.prescaled_batch:
        return 0.0
    group = kernels.Group(layout.tp, 1)
    one = kernels.all_gather(hw, tokens * 8, group, workload.gpus_per_node, workload.gpus)
    return runtime.input_collectives * one


def _loss_all_reduces(
    layout: Layout, workload: Workload, hw: Hardware, runtime: RuntimeCosts, tokens: int
) -> float:
    """The vocabulary-parallel cross-entropy's all-reduces over the tp group: the logits' maximum,
    the sum of their exponentials and the target's logit, a float per token each (smp joins the
    last two into one all-reduce)."""
    if layout.tp == 1:
        return 0.0
    group = kernels.Group(layout.tp, 1)
    one = kernels.all_reduce(hw, tokens * 4, group, workload.gpus_per_node, workload.gpus)
    return runtime.loss_all_reduces * one


def _logits_out(facts: ModelFacts, layout: Layout, workload: Workload, hw: Hardware, mb: int) -> Pass:
    """The logits leave the model whole (the script reads them): under TP the vocabulary shards
    are gathered over the tp group and laid out whole (a copy: [tp, tokens, V / tp] to
    [tokens, V]). cp's gather of the sequence is context_costs.logits_seconds'."""
    if layout.tp == 1:
        return Pass()
    nbytes = mb * facts.logits_elements / layout.cp * compute_bytes(layout)
    group = kernels.Group(layout.tp, 1)
    gather = kernels.all_gather(hw, nbytes, group, workload.gpus_per_node, workload.gpus)
    return Pass(memory=kernels.memory_pass(hw, 2 * nbytes, 1), tp_comm=gather)


def rank_tokens(layout: Layout, workload: Workload, mb: int) -> int:
    """Tokens of one microbatch a rank computes: its cp cut of mb sequences."""
    return mb * workload.seq_len // layout.cp


def expert_tokens(layout: Layout, tokens: int) -> int:
    """Of a rank's `tokens`, those it sends to the experts: under ep with tp, its part of the tp
    group's (the group's ranks hold the same tokens and split them)."""
    return tokens // layout.tp if layout.ep > 1 else tokens


def _layer(facts: ModelFacts, layout: Layout, workload: Workload, hw: Hardware, mb: int) -> tuple[Pass, Pass]:
    """(forward, backward) of one layer for one microbatch, recompute not included."""
    dtype, tp = dtype_of(layout), layout.tp
    tokens = rank_tokens(layout, workload, mb)
    fwd = bwd = 0.0
    for matrix in facts.matmuls:
        k, n = matrix.per_rank(1 if matrix.experts and layout.ep > 1 else tp)  # (ep: experts whole)
        rows, banks = tokens, 1
        if matrix.experts:  # the rank's E/ep experts, each on its share of the pairs
            banks = max(1, matrix.experts // layout.ep)
            rows = max(1, round(expert_tokens(layout, tokens) * facts.top_k / banks))
        fwd += matrix.share * kernels.matmul(hw, dtype, rows, n, k, banks)
        backward = kernels.matmul(hw, dtype, rows, k, n, banks) + kernels.matmul(hw, dtype, k, n, rows, banks)
        bwd += matrix.share * backward
    attn_f, attn_b = attention(facts, layout, workload, hw, mb)
    boundary = tokens * facts.hidden * compute_bytes(layout)
    group = kernels.Group(tp, 1)
    two = 2 * kernels.all_reduce(hw, boundary, group, workload.gpus_per_node, workload.gpus)
    ops = facts.layer_ops or 0
    if facts.layer_traffic:  # measured on the module, in its 4-byte floats; cut as the saved bytes
        elem, saved = compute_bytes(layout), facts.saved_layer
        share = saved.per_rank(elem, tp) / max(saved.per_rank(elem, 1), 1.0)
        nbytes = facts.layer_traffic * elem / 4 * share * mb / layout.cp
        per_rank = share * mb / layout.cp  # (the transcendental work is cut as the bytes)
        f_mem = kernels.memory_pass(hw, nbytes, ops) + kernels.transcendental(
            hw, facts.layer_transcendental * per_rank
        )
        b_mem = kernels.memory_pass(
            hw, BACKWARD_TRAFFIC / FORWARD_TRAFFIC * nbytes, ops * BACKWARD_OPS
        ) + kernels.transcendental(hw, facts.layer_transcendental_backward * per_rank)
        return Pass(fwd + attn_f, f_mem, two), Pass(bwd + attn_b, b_mem, two)
    forward = Pass(fwd + attn_f, tp_comm=two) + _saved_traffic(facts.saved_layer, layout, hw, mb, ops=ops)
    backward = Pass(bwd + attn_b, tp_comm=two)
    backward = backward + _saved_traffic(facts.saved_layer, layout, hw, mb, backward=True, ops=ops)
    return forward, backward


def attention(
    facts: ModelFacts, layout: Layout, workload: Workload, hw: Hardware, mb: int
) -> tuple[float, float]:
    """(forward, backward) seconds of the scores and context matmuls, every head of the rank (its
    rows of the scores under cp: 1/cp of them)."""
    seq, dtype = workload.seq_len, dtype_of(layout)
    rows = seq // layout.cp
    head_dim = facts.head_dim or facts.hidden // facts.heads
    batch = mb * max(1, facts.heads // layout.tp)
    if facts.eager_attention:
        scores = kernels.matmul(hw, dtype, rows, seq, head_dim, batch)
        context = kernels.matmul(hw, dtype, rows, head_dim, seq, batch)
        return scores + context, 2 * (scores + context)
    # Fused: the matmuls' FLOPs at the fused kernel's rate (a GPU's: its matmul rate), the scores
    # never leave the chip.
    flops = 2 * 2.0 * rows * seq * head_dim * batch
    fused = flops / (hw.attention_peak(dtype) * kernels.wave_efficiency(hw, rows, head_dim, batch))
    return fused, FUSED_ATTENTION_BACKWARD * fused


def _head(facts: ModelFacts, layout: Layout, hw: Hardware, tokens: int) -> tuple[Pass, Pass]:
    """The logits' matmul (vocabulary-parallel under TP): forward, and its two gradients."""
    dtype, vocab = dtype_of(layout), max(1, facts.vocab // layout.tp)
    forward = kernels.matmul(hw, dtype, tokens, vocab, facts.hidden)
    backward = kernels.matmul(hw, dtype, tokens, facts.hidden, vocab) + kernels.matmul(
        hw, dtype, facts.hidden, vocab, tokens
    )
    return Pass(forward), Pass(backward)


def _saved_traffic(
    saved, layout: Layout, hw: Hardware, mb: int, backward: bool = False, ops: int = 0
) -> Pass:
    nbytes = saved.per_rank(compute_bytes(layout), layout.tp) * mb / layout.cp
    factor, kernels_run = (BACKWARD_TRAFFIC, ops * BACKWARD_OPS) if backward else (FORWARD_TRAFFIC, ops)
    return Pass(memory=kernels.memory_pass(hw, factor * nbytes, kernels_run))
