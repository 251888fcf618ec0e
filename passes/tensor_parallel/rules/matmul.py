"""Matrix products over sharded heads: q @ k^T, attention weights @ v, and scaled dot-product
attention, local on each rank when the operands are sharded on a batch-like dimension (heads)
and never on the one the product contracts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx

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
    if _CONTRACTED in (da, db) or (da is not None and db is not None and da != db):
        return rw.generic(node)
    dim = da if da is not None else db
    if dim >= nd - 2 and da is not None and db is not None:
        return rw.generic(node)  # both sharded on a matrix dimension: the product mixes the slices
    # The other operand must not hold full-size data along that dimension.
    for layout, val in ((la, va), (lb, vb)):
        aligned = dim - (nd - val.dim())
        is_batch = dim < nd - 2
        if layout is None and is_batch and aligned >= 0 and val.shape[aligned] != 1:
            return rw.generic(node)
    rw.copy(node, Shard(dim), (rw.env[a.name], rw.env[b.name]), {})


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
    """Attention with q, k and v sharded on heads runs per head: local. A mask with a heads
    dimension is split alike; one that broadcasts over heads is used whole."""
    q, k, v = node.args[:3]
    if not all(rw.layout[t.name] == Shard(1) for t in (q, k, v)) or q.meta["val"].dim() != 4:
        return rw.generic(node)
    args = [rw.env[q.name], rw.env[k.name], rw.env[v.name], *node.args[3:]]
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
