"""Matrix products over sharded heads: q @ k^T, attention weights @ v, and scaled dot-product
attention, local on each rank when the operands are sharded on a batch-like dimension (heads)
and never on the one the product contracts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx

from ..driver import Demote
from ..layout import Shard
from ..registry import rule

if TYPE_CHECKING:
    from ..driver import Rewrite

aten = torch.ops.aten

_CONTRACTED = "contracted"


@rule(aten.matmul.default, aten.bmm.default, uses_shards=True)
def matmul(rw: Rewrite, node: fx.Node) -> None:
    a, b = node.args[0], node.args[1]
    la, lb = rw.layout[a.name], rw.layout[b.name]
    va, vb, out = a.meta["val"], b.meta["val"], node.meta["val"]
    if la is None and lb is None:
        return rw.copy(node, None)
    if va.dim() < 2 or vb.dim() < 2:
        return rw.generic(node)
    if (la and la.blocks != 1) or (lb and lb.blocks != 1):
        return rw.generic(node)
    nd = out.dim()
    da, db = _out_dim(la, va, -1, nd), _out_dim(lb, vb, -2, nd)
    for contracted, other, other_dim in ((a, lb, db), (b, la, da)):
        if (da if contracted is a else db) == _CONTRACTED and other is not None and other_dim < nd - 2:
            _demote_cut_within_heads(rw, contracted)  # q @ k^T with q cut on heads, k within them
    if _CONTRACTED in (da, db) or (da is not None and db is not None and da != db):
        return rw.generic(node)
    dim = da if da is not None else db
    if dim >= nd - 2 and da is not None and db is not None:
        return rw.generic(node)  # both sharded on a matrix dimension: the product mixes the slices
    # A replicated operand with full-size data along that (batch-like: heads) dimension is cut
    # there too, locally (keys and values repeated for grouped-query attention).
    operands = []
    for operand, layout, val in ((a, la, va), (b, lb, vb)):
        aligned = dim - (nd - val.dim())
        if layout is not None or aligned < 0 or val.shape[aligned] == 1:
            operands.append(rw.env[operand.name] if layout is not None else rw.arg(operand, None))
        elif dim < nd - 2:
            operands.append(rw.arg(operand, Shard(aligned)))
        else:
            return rw.generic(node)
    rw.copy(node, Shard(dim), operands, {})


def _demote_cut_within_heads(rw: Rewrite, operand: fx.Node) -> None:
    """An attention operand cut on another dimension than heads, while the other operand is cut
    on heads: the keys/values of a single head (multi-query attention), whose linear cut its
    head_dim. That linear stays whole (each rank then takes its heads' slice of the repeated
    keys/values) rather than gathering every attention input."""
    linear = rw.origin.get(operand.name)
    if linear is not None:
        raise Demote(
            linear, "its output reaches attention cut within heads (fewer key/value heads than ranks)"
        )


def _out_dim(layout: Shard | None, val, contraction: int, nd: int):
    """Where an operand's sharded dimension lands in the product (None when it is replicated,
    _CONTRACTED when the product sums over it)."""
    if layout is None:
        return None
    if layout.dim == contraction % val.dim():
        return _CONTRACTED
    return layout.dim + nd - val.dim()


@rule(aten.scaled_dot_product_attention.default, uses_shards=True)
def sdpa(rw: Rewrite, node: fx.Node) -> None:
    """Attention with q, k and v sharded on heads runs per head: local. Replicated keys and values
    with q's heads (grouped-query attention after repeat_kv) and a mask with a heads dimension
    are split alike; a mask that broadcasts over heads is used whole."""
    q, k, v = node.args[:3]
    if rw.layout[q.name] != Shard(1) or q.meta["val"].dim() != 4:
        return rw.generic(node)
    heads = q.meta["val"].shape[1]
    for t in (k, v):  # replicated keys/values (grouped-query, repeated) are cut on heads here
        if rw.layout[t.name] not in (Shard(1), None):
            _demote_cut_within_heads(rw, t)
            return rw.generic(node)
        if rw.layout[t.name] is None and t.meta["val"].shape[1] != heads:
            return rw.generic(node)
    args = [rw.arg(t, Shard(1)) for t in (q, k, v)] + list(node.args[3:])
    kwargs = dict(node.kwargs)
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        original = node.args[3] if len(node.args) > 3 else node.kwargs["attn_mask"]
        shape = original.meta["val"].shape
        head = 1 - (4 - len(shape))
        local = rw.arg(original, Shard(head) if head >= 0 and shape[head] != 1 else None)
        if len(args) > 3:
            args[3] = local
        else:
            kwargs["attn_mask"] = local
    rw.copy(node, Shard(1), args, kwargs)
