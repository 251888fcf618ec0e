"""Context parallelism: rewrites a captured graph so that each rank of a cp group runs this rank's
part of every sequence (the load-balanced cut: chunks r and 2C-1-r of 2C).

The sequence is found from the graph: its length is the one the attentions run over
(scaled_dot_product_attention's queries, or the [..., S, S] scores an eager softmax(QK^T)V
normalizes); an input holds it on its first dim after the batch dim of that length. From there
driver.py walks the graph: activations run cut, attentions (eager ones read as
scaled_dot_product_attention first: eager.py) become smp.cp_attention or Ulysses' all-to-alls
(rules/attention.py), position tables, masks and shifted labels built whole from the
inputs are read as this rank's positions (and computed only for them where their ops allow),
means over tokens divide by the whole sequence's count, and the model's outputs leave whole.
Bad input is a ContextParallelError naming the fix.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from . import rules  # noqa: F401  (importing registers every rule)
from .driver import Rewrite
from .eager import eager_to_sdpa
from .errors import ContextParallelError, where
from .layout import Cut, Sequence_

__all__ = ["ContextParallelError", "ContextParallelResult", "context_parallel", "sequence_length"]

aten = torch.ops.aten
COMM_TYPES = ("p2p", "all_gather", "a2a")


@dataclasses.dataclass
class ContextParallelResult:
    seq_len: int
    inputs: dict[str, int]  # input (placeholder) name -> the dim cut
    attention: list[str]  # each attention and how it was cut
    gathered: list[str]  # values gathered whole, and where


def context_parallel(
    gm: fx.GraphModule, group: torch.distributed.ProcessGroup, comm: str = "p2p"
) -> ContextParallelResult:
    """Rewrites `gm` (a graph from smp.passes.capture, maybe tensor-parallel already) in place to
    run this rank's part of the sequence over the cp group `group` (its ranks read the same
    inputs). `comm`: "p2p" (ring attention), "all_gather" or "a2a" (Ulysses)."""
    if comm not in COMM_TYPES:
        raise ValueError(f"smp context parallelism: cp_comm_type must be one of {COMM_TYPES}, got {comm!r}")
    size, rank = group.size(), group.rank()
    eager_to_sdpa(gm)  # written-out attentions run as any attention, by `comm`
    length = sequence_length(gm)
    if length % (2 * size):
        multiple = 2 * size
        raise ContextParallelError(
            f"smp context parallelism: the sequence length {length} does not divide into 2 x "
            f"context_parallel_degree = {multiple} chunks (each rank holds two, load-balanced for "
            f"causal attention); pad the sequences to a multiple of {multiple} (e.g. "
            f"{-(-length // multiple) * multiple})"
        )
    inputs = _input_dims(gm, length)
    rewrite = Rewrite(
        gm, group.group_name, Sequence_(length, size, rank), comm, {k: Cut(d) for k, d in inputs.items()}
    )
    gm.graph = rewrite.run()
    gm.recompile()
    return ContextParallelResult(length, inputs, rewrite.attention, rewrite.gathered)


def sequence_length(gm: fx.GraphModule) -> int:
    """The length of the sequence the graph's attentions run over."""
    found: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.target is aten.scaled_dot_product_attention.default:
            q = node.args[0].meta.get("val")
            if q is not None and q.dim() >= 2:
                found.setdefault(q.shape[-2], node)
        elif node.target in (aten.softmax.int, aten._softmax.default):
            scores = node.args[0].meta.get("val")
            if scores is not None and scores.dim() >= 2 and scores.shape[-1] == scores.shape[-2]:
                found.setdefault(scores.shape[-1], node)
    if not found:
        raise ContextParallelError(
            "smp context parallelism found no attention in the model (no "
            "scaled_dot_product_attention, no softmax over [..., S, S] scores), so no sequence "
            "dimension to cut; set context_parallel_degree=1 for this model"
        )
    if len(found) > 1:
        listed = "; ".join(f"{n} at node '{node.name}'{where(node)}" for n, node in found.items())
        raise ContextParallelError(
            f"smp context parallelism: the attentions run over sequences of different lengths ({listed}); "
            "it cuts one sequence (self-attention of one length): set context_parallel_degree=1 "
            "for this model"
        )
    return next(iter(found))


def _input_dims(gm: fx.GraphModule, length: int) -> dict[str, int]:
    """Each input's sequence dim: its first dim after the batch dim of the sequence's length."""
    dims, shapes = {}, []
    for node in gm.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor):
            shapes.append(f"{node.name} {tuple(value.shape)}")
            dim = next((d for d in range(1, value.dim()) if value.shape[d] == length), None)
            if dim is not None:
                dims[node.name] = dim
    if not dims:
        raise ContextParallelError(
            f"smp context parallelism: no input has a sequence dimension of the attention's length "
            f"{length} after its batch dimension (inputs: {', '.join(shapes) or 'none'}); pass the "
            "batch as [batch, sequence, ...] tensors, or set context_parallel_degree=1"
        )
    return dims
