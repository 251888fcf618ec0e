"""Ops that act along their last dims and keep the rest (embeddings, linear layers, norms,
softmax, tensor parallelism's ops): the sequence stays where it is; and matrix products, where
a cut keys' operand (the eager attention's K^T and V) is gathered."""

from __future__ import annotations

import torch

from ..layout import Cut, aligned
from ..registry import Plan, rule
from .common import dim_of, val

aten = torch.ops.aten


def _rowwise(arg: int, last: int):
    """A rule for ops whose input `arg` keeps every dim but its `last` trailing ones (or a
    `last` given by the op's normalized shape / softmax dim) and the sequence with them."""

    def trailing(node) -> int:
        if last >= 0:
            return last
        if node.target in _NORMS:
            return len(node.args[1])
        return None  # softmax-like: any dim but the reduced one

    def ok(node, x, cut: Cut) -> bool:
        n = trailing(node)
        if n is None:
            return dim_of(node.args[1], val(x).dim()) != cut.dim
        return cut.dim < val(x).dim() - n

    def plan(rw, node, cut: Cut) -> Plan:
        x = node.args[arg]
        outs = node.meta.get("val")
        out = [cut] * len(outs) if isinstance(outs, (tuple, list)) else cut
        return Plan(out, {x.name: cut})

    def forward(rw, node) -> Plan | None:
        x = node.args[arg]
        cut = rw.layout(x)
        if not isinstance(cut, Cut) or not ok(node, x, cut):
            return None
        return plan(rw, node, cut)

    def pull(rw, node, cut: Cut) -> Plan | None:
        x = node.args[arg]
        if cut.dim >= val(x).dim() or not ok(node, x, cut) or (rw.cut_only(x) and rw.layout(x) != cut):
            return None
        if val(x).shape[cut.dim] != rw.seq.full_size(cut):
            return None
        return plan(rw, node, cut)

    return forward, pull


_NORMS = (aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default)


def _register(ops, arg: int, last: int) -> None:
    forward, pull = _rowwise(arg, last)
    rule(*ops, pull=pull)(forward)


_register((aten.embedding.default,), 1, 0)
_register(("smp::vocab_parallel_embedding",), 0, 0)
_register((aten.linear.default, "smp::column_parallel_linear", "smp::row_parallel_linear"), 0, 1)
_register((aten.addmm.default,), 1, 1)
_register(_NORMS, 0, -1)
_register(
    (
        aten.softmax.int,
        aten._softmax.default,
        aten.log_softmax.int,
        aten._log_softmax.default,
        aten.cumsum.default,
    ),
    0,
    -1,
)


def _same_dim(rw, node) -> Plan | None:
    """Tensor parallelism's ops on one input along `dim` (or none): any other dim keeps the cut."""
    x = node.args[0]
    cut = rw.layout(x)
    if not isinstance(cut, Cut):
        return None
    if node.target._schema.name in ("smp::tp_gather", "smp::tp_split"):
        if dim_of(node.args[1], val(x).dim()) == cut.dim:
            return None
    return Plan(cut, {x.name: cut})


rule("smp::tp_gather", "smp::tp_split", "smp::tp_reduce", "smp::tp_copy")(_same_dim)


@rule("smp::vocab_parallel_cross_entropy")
def vocab_cross_entropy(rw, node) -> Plan | None:
    logits, target = node.args[0], node.args[1]
    cut = rw.layout(logits)
    if not isinstance(cut, Cut) or cut.dim == val(logits).dim() - 1:
        return None
    return Plan(cut, {logits.name: cut, target.name: cut})


# --- matrix products ----------------------------------------------------------------


def _matmul_plan(rw, node, cut: Cut) -> Plan | None:
    """The product's result cut by `cut`: rows (M) come from a, columns (N) from b, batch dims
    from both (each operand with the whole sequence there is read cut)."""
    a, b = node.args[0], node.args[1]
    out = val(node)
    if cut.dim >= out.dim() or out.shape[cut.dim] != rw.seq.full_size(cut):
        return None
    rows, cols = out.dim() - 2, out.dim() - 1
    if out.dim() < 2 or val(a).dim() < 2 or val(b).dim() < 2:
        return None
    wants = {a.name: None, b.name: None}
    if cut.dim == rows:
        wants[a.name] = cut.moved(val(a).dim() - 2)
    elif cut.dim == cols:
        wants[b.name] = cut.moved(val(b).dim() - 1)
    else:  # a batch dim
        for x in (a, b):
            inner = aligned(cut, out.dim(), val(x).dim())
            if inner is not None and val(x).shape[inner.dim] != 1:
                wants[x.name] = inner
    for x in (a, b):
        if rw.cut_only(x) and wants[x.name] is not None and rw.layout(x) != wants[x.name]:
            return None
    return Plan(cut, wants)


def matmul_forward(rw, node) -> Plan | None:
    """A cut a (rows or batch) gives the result's cut; a cut b that does not match is gathered
    (the keys of an eager attention: their columns are all the sequence's)."""
    a, b = node.args[0], node.args[1]
    out = val(node)
    if out is None or val(a) is None or val(b) is None or val(a).dim() < 2 or val(b).dim() < 2:
        return None
    la, lb = rw.layout(a), rw.layout(b)
    if isinstance(la, Cut) and la.dim != val(a).dim() - 1:
        cut = aligned(la, val(a).dim(), out.dim()) if la.dim < val(a).dim() - 2 else la.moved(out.dim() - 2)
    elif isinstance(lb, Cut) and lb.dim == val(b).dim() - 1 and not rw.cut_only(a):
        cut = lb.moved(out.dim() - 1)
    else:
        return None
    plan = _matmul_plan(rw, node, cut)
    if plan is not None and rw.cut_only(b) and plan.wants[b.name] is None:
        rw.attention.append(f"{node.name}: its keys' operand {b.name} gathered (an eager attention)")
    return plan


rule(aten.matmul.default, aten.bmm.default, aten.mm.default, pull=_matmul_plan)(matmul_forward)
