"""What the planner knows of a model: its parameters (Params), the matmuls of a layer (Matmul),
the bytes it saves for backward (Saved), and all of it together (ModelFacts). model_facts.py
reads them from a dense config, moe_facts.py adds a mixture of experts' experts."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Saved:
    """Bytes saved for backward per sample (one sequence): floating-point elements (whose size
    follows the training precision) and fixed bytes (masks, indices, fp32 statistics), each
    split into what every tensor-parallel rank keeps whole and what is cut across the group."""

    replicated_elements: float = 0.0
    sharded_elements: float = 0.0
    replicated_bytes: float = 0.0
    sharded_bytes: float = 0.0

    def per_rank(self, element_bytes: int, tp: int) -> float:
        return (
            self.replicated_elements * element_bytes
            + self.replicated_bytes
            + (self.sharded_elements * element_bytes + self.sharded_bytes) / tp
        )

    def __add__(self, other: Saved) -> Saved:
        return Saved(
            *(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True))
        )

    def __mul__(self, k: float) -> Saved:
        return Saved(*(a * k for a in dataclasses.astuple(self)))


@dataclasses.dataclass(frozen=True)
class Params:
    """A part's parameter count and how much of it tensor parallelism cuts."""

    total: int = 0
    sharded: int = 0

    def per_rank(self, tp: int) -> float:
        return self.total - self.sharded + self.sharded / tp


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One of a layer's weight matrices as a token batch multiplies it: [tokens, k] x [k, n].
    Tensor parallelism cuts `n` (column-parallel: q/k/v, the MLP's first matrices) or `k`
    (row-parallel: the attention output, the MLP's last)."""

    k: int
    n: int
    cut: str  # "n" or "k"
    experts: int = 0  # a routed expert's matrix: E banks, each token through top_k of them
    share: float = 1.0  # the fraction of the layers that have this matrix (MoE and dense mixed)

    def per_rank(self, tp: int) -> tuple[int, int]:
        """(k, n) on one tensor-parallel rank."""
        return (self.k, self.n // tp) if self.cut == "n" else (self.k // tp, self.n)


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    source: str  # where the counts come from, for the report
    seq_len: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    # Parameters: the embedding side (before the first layer), one layer, the head side (after).
    before: Params
    layer: Params
    after: Params
    # A head weight tied to the input embedding: counted once in `before`; a pipeline whose
    # last stage is not the first keeps a replica there (smp replicates shared parameters).
    tied: Params
    # Saved for backward per sample: embedding side, one layer, head side (with the loss), and
    # what a checkpointed layer keeps instead of its activations (its input).
    saved_before: Saved
    saved_layer: Saved
    saved_after: Saved
    saved_layer_input: Saved
    # The largest tensor the head makes per sample (the logits), for the backward's working memory.
    logits_elements: float
    # Forward FLOPs per token: one layer, and the head (the embedding is a lookup).
    layer_flops_per_token: float
    head_flops_per_token: float
    # For the step time (step_time.py): a layer's matrices, the attention's head size, and
    # whether attention materializes its [seq, seq] scores (eager) or is fused (sdpa, flash).
    matmuls: tuple[Matmul, ...] = ()
    head_dim: int = 0
    eager_attention: bool = False
    # Dropout on the attention's weights: under cp "p2p" gathers keys and values instead (the
    # ring draws no dropout).
    attention_dropout: bool = False
    layer_ops: int = 0  # ATen operations one layer's forward dispatches (each a kernel)
    # Bytes a layer's forward elementwise operations (neither matmuls nor views) read and write per
    # sample, in the module's dtype (4-byte floats), where measured on a module (0: estimated from
    # the saved activations, stage_work.py).
    layer_traffic: float = 0.0
    # Elements of transcendental operations (exp, tanh, log, erf, sigmoid, softmax) per sample: a
    # layer's forward and its backward, and the head side's (loss included) forward and backward
    # together, where measured on a module (measured_facts.py; 0: not counted). They cost a CPU
    # core time beyond their memory traffic (Hardware.transcendental_ns).
    layer_transcendental: float = 0.0
    layer_transcendental_backward: float = 0.0
    head_transcendental: float = 0.0
    # A mixture of experts (0 experts: dense). `layer` then holds what is not a routed expert
    # (attention, norms, router, shared experts, the dense layers' MLPs: the average per layer);
    # `expert` is one routed expert's parameters, E of them in each of `moe_layers` layers.
    experts: int = 0
    top_k: int = 0
    moe_layers: int = 0
    expert: Params = Params()

    @property
    def parameters(self) -> int:
        return self.before.total + self.layers * self.layer.total + self.after.total + self.expert_total

    @property
    def expert_total(self) -> int:
        """Every routed expert's parameters, over every MoE layer."""
        return self.moe_layers * self.experts * self.expert.total

    @property
    def active_parameters(self) -> int:
        """The parameters one token goes through: top_k experts per MoE layer, not E."""
        return self.parameters - self.moe_layers * (self.experts - self.top_k) * self.expert.total

    def layer_experts(self, tp: int, ep: int = 1) -> float:
        """A layer's routed experts' parameters on one rank (the average per layer): E / ep whole
        experts of every MoE layer; without ep each as its tensor-parallel shard, under ep whole on
        every rank of a tp group (smp leaves the experts out of the tp pass)."""
        if not self.experts:
            return 0.0
        return self.moe_layers / self.layers * self.experts / ep * self.expert.per_rank(tp if ep == 1 else 1)

    def layer_per_rank(self, tp: int, ep: int = 1) -> float:
        """A layer's parameters on one rank (the average per layer), its experts included."""
        return self.layer.per_rank(tp) + self.layer_experts(tp, ep)
