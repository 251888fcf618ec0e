"""Ops that work element by element or along one dimension: pointwise math, copies and casts,
softmax, reductions and layer norm. Each keeps its input's shards as long as it does not work
across the sharded dimension (a softmax over heads is local; one over features is not)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx

from ..layout import Shard
from ..registry import rule

if TYPE_CHECKING:
    from ..driver import Rewrite

aten = torch.ops.aten


# Every op tagged pointwise without a rule of its own, and a few that act pointwise untagged.
@rule(
    torch.Tag.pointwise,
    aten.type_as.default,
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.where.self,
    carries=True,
)
def pointwise(rw: Rewrite, node: fx.Node) -> None:
    """Sharded inputs must agree on the (broadcast) output dimension they are sharded on; a
    replicated input joins them only where it broadcasts along that dimension."""
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return rw.generic(node)
    found = set()
    for arg in node.all_input_nodes:
        layout = rw.layout[arg.name]
        if layout is not None:
            found.add(Shard(layout.dim + out.dim() - arg.meta["val"].dim(), layout.blocks))
    if not found:
        return rw.copy(node, None)
    if len(found) > 1:
        return rw.generic(node)
    (layout,) = found
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if rw.layout[arg.name] is None and isinstance(val, torch.Tensor):
            aligned = layout.dim - (out.dim() - val.dim())
            if aligned >= 0 and val.shape[aligned] != 1:
                return rw.generic(node)  # a full-size replicated operand: gather the others
    rw.copy(node, layout, *rw.local_args(node))


# Ops that keep every dimension: copies, dtype and device casts, dropout.
@rule(
    aten.dropout.default,
    aten.clone.default,
    aten.contiguous.default,
    aten._to_copy.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    carries=True,
)
# The same, but the pay-off walk (rules.layers.shards_pay_off) has never gone through detach or
# alias: counting them as carrying would change which linears are cut, a change of its own.
@rule(aten.detach.default, aten.alias.default)
def unchanged(rw: Rewrite, node: fx.Node) -> None:
    layout = rw.sharded_input(node, plain_blocks=False)
    if layout is not None:
        rw.keep(node, *layout)


@rule(aten.softmax.int, aten._softmax.default, carries=True)
# Log-softmax likewise; the pay-off walk counts it as a use of the shards (a loss over the logits
# usually follows it), as it always has.
@rule(aten.log_softmax.int, aten._log_softmax.default, uses_shards=True)
def along_dim(rw: Rewrite, node: fx.Node) -> None:
    """Softmax-like ops: local unless they work along the sharded dimension."""
    layout = rw.sharded_input(node, plain_blocks=False)
    if layout is None:
        return
    if node.args[1] % node.args[0].meta["val"].dim() == layout.dim:
        return rw.generic(node)
    rw.keep(node, *layout)


@rule(aten.sum.dim_IntList, aten.mean.dim, carries=True)
# Max and min reduce alike, but the pay-off walk has never gone through them (as detach above).
@rule(aten.amax.default, aten.amin.default)
def reduce(rw: Rewrite, node: fx.Node) -> None:
    """Reductions over other dimensions keep the shards, the sharded dimension moved down by the
    reduced ones before it (unless kept)."""
    layout = rw.sharded_input(node, plain_blocks=False)
    if layout is None:
        return
    nd = node.args[0].meta["val"].dim()
    dims = node.args[1] if len(node.args) > 1 else None
    dims = [dims] if isinstance(dims, int) else dims
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if not dims or layout.dim in {d % nd for d in dims}:
        return rw.generic(node)
    shift = 0 if keepdim else sum(d % nd < layout.dim for d in dims)
    rw.keep(node, layout.dim - shift, layout.blocks)


# Not carrying: a layer norm over the features needs them whole (BERT's MLM head), and whether
# it normalizes over the sharded dimension is only known once the layout is.
@rule(aten.layer_norm.default)
def layer_norm(rw: Rewrite, node: fx.Node) -> None:
    layout = rw.sharded_input(node, plain_blocks=False)
    if layout is None:
        return
    if layout.dim >= node.args[0].meta["val"].dim() - len(node.args[1]):
        return rw.generic(node)  # normalizes over the sharded dimension
    rw.keep(node, *layout)
