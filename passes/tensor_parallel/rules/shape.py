"""Shape ops on a sharded value: they keep it sharded, on the dimension its slices move to,
with any size that counts the sharded dimension made local (a view to [b, s, heads, d] on a
rank holds heads / size of them). One that would mix the slices gathers first."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
from torch import fx

from ..driver import Demote
from ..layout import Shard, view_dim
from ..registry import rule

if TYPE_CHECKING:
    from ..driver import Rewrite

aten = torch.ops.aten


@rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, carries=True)
def view(rw: Rewrite, node: fx.Node) -> None:
    layout = rw.sharded_input(node, plain_blocks=False)
    if layout is None:
        return
    before, after = list(node.args[0].meta["val"].shape), list(node.meta["val"].shape)
    dim = view_dim(before, after, layout.dim)
    if dim is None or (layout.blocks != 1 and after[dim] != before[layout.dim]):
        return rw.generic(node)  # blocks survive only a view that keeps their dimension
    if after[dim] % rw.size and rw.size % after[dim] == 0 and node.args[0].name in rw.origin:
        # Fewer key/value heads than ranks (multi-query, grouped-query attention): as Megatron
        # does, their projection stays whole on every rank, the query heads and the rest of the
        # block stay cut; the attention takes each rank's slice of the repeated heads.
        linear = rw.origin[node.args[0].name]
        raise Demote(
            linear,
            f"its {after[dim]} heads are fewer than tensor_parallel_degree={rw.size}: replicated on "
            "every rank (the query heads stay sharded)",
        )
    if after[dim] % rw.size:
        rw.demote_block(
            node,
            f"it splits {before[layout.dim]} features into {after[dim]} parts (heads), which do not "
            f"divide by tensor_parallel_degree={rw.size}",
        )
    sizes = list(after)
    sizes[dim] //= rw.size
    rw.keep(node, dim, layout.blocks, args=(None, sizes, *node.args[2:]))


@rule(aten.transpose.int, aten.t.default, carries=True)
def transpose(rw: Rewrite, node: fx.Node) -> None:
    layout = rw.sharded_input(node, plain_blocks=False)
    if layout is None:
        return
    nd = node.args[0].meta["val"].dim()
    a, b = (0, 1) if node.target is aten.t.default else (d % nd for d in node.args[1:3])
    rw.keep(node, {a: b, b: a}.get(layout.dim, layout.dim), layout.blocks)


@rule(aten.permute.default, carries=True)
def permute(rw: Rewrite, node: fx.Node) -> None:
    layout = rw.sharded_input(node, plain_blocks=False)
    if layout is not None:
        nd = node.args[0].meta["val"].dim()
        rw.keep(node, [d % nd for d in node.args[1]].index(layout.dim), layout.blocks)


@rule(aten.unsqueeze.default, carries=True)
def unsqueeze(rw: Rewrite, node: fx.Node) -> None:
    layout = rw.sharded_input(node, plain_blocks=False)
    if layout is not None:
        where = node.args[1] % node.meta["val"].dim()
        rw.keep(node, layout.dim + (where <= layout.dim), layout.blocks)


@rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, carries=True)
def squeeze(rw: Rewrite, node: fx.Node) -> None:
    layout = rw.sharded_input(node, plain_blocks=False)
    if layout is None:
        return
    before = node.args[0].meta["val"].shape
    dims = node.args[1] if len(node.args) > 1 else range(len(before))
    dims = [dims] if isinstance(dims, int) else dims
    removed = {d % len(before) for d in dims if before[d] == 1}
    rw.keep(node, layout.dim - sum(d < layout.dim for d in removed), layout.blocks)


@rule(aten.expand.default, carries=True)
def expand(rw: Rewrite, node: fx.Node) -> None:
    layout = rw.sharded_input(node)
    if layout is None:
        return
    sizes = list(node.args[1])
    dim = layout.dim + len(sizes) - node.args[0].meta["val"].dim()
    if sizes[dim] != -1:
        sizes[dim] //= rw.size
    rw.keep(node, dim, args=(None, sizes, *node.args[2:]))


@rule(aten.slice.Tensor, carries=True)
def slice_(rw: Rewrite, node: fx.Node) -> None:
    """A slice of another dimension keeps the shards; one that cuts the sharded dimension would
    take different elements on each rank: gathered."""
    layout = rw.sharded_input(node, plain_blocks=False)
    if layout is None:
        return
    shape = node.args[0].meta["val"].shape
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(shape)
    if dim == layout.dim and node.meta["val"].shape[dim] != shape[dim]:
        return rw.generic(node)
    rw.keep(node, layout.dim, layout.blocks)


@rule(aten.select.int, carries=True)
def select(rw: Rewrite, node: fx.Node) -> None:
    """Picking one index of another dimension keeps the shards, on a dimension one lower when the
    picked one came before (q, k and v of a per-head fused projection laid out [heads, 3, d])."""
    layout = rw.sharded_input(node, plain_blocks=False)
    if layout is None:
        return
    dim = node.args[1] % node.args[0].meta["val"].dim()
    if dim == layout.dim:
        return rw.generic(node)
    rw.keep(node, layout.dim - (dim < layout.dim), layout.blocks)


@rule(aten.cat.default, carries=True)
def cat(rw: Rewrite, node: fx.Node) -> None:
    """Tensors sharded alike, joined along another dimension, stay sharded."""
    tensors = node.args[0]
    nd = node.meta["val"].dim()
    dim = (node.args[1] if len(node.args) > 1 else 0) % nd
    layouts = {rw.layout[t.name] for t in tensors}
    if layouts == {None}:
        return rw.copy(node, None)
    if len(layouts) != 1 or None in layouts or next(iter(layouts))[0] == dim:
        return rw.generic(node)
    (layout,) = layouts
    args = ([rw.env[t.name] for t in tensors], *node.args[1:])
    rw.copy(node, Shard(*layout), args, {})


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, carries=True)
def split(rw: Rewrite, node: fx.Node) -> None:
    """Split along another dimension: every part keeps the layout. Along the sharded dimension,
    only the parts of a blocked layout (fused q/k/v into q, k, v) split locally, each part
    then plainly sharded."""
    layout = rw.layout[node.args[0].name]
    parts = node.meta["val"]
    if layout is None:
        return rw.copy(node, None)
    shape = node.args[0].meta["val"].shape
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(shape)
    if dim != layout.dim:
        args = (rw.env[node.args[0].name], *node.args[1:])
        rw.copy(node, [layout] * len(parts), args, node.kwargs)
        return
    if layout.blocks != len(parts) or len({p.shape[dim] for p in parts}) != 1:
        return rw.generic(node)
    second = node.args[1]  # split size, sizes, or chunk count: local sizes for the splits
    if node.target is aten.split.Tensor:
        second = second // rw.size
    elif node.target is aten.split_with_sizes.default:
        second = [s // rw.size for s in second]
    args = (rw.env[node.args[0].name], second, *node.args[2:])
    rw.copy(node, [Shard(dim)] * len(parts), args, node.kwargs)
    for i in range(len(parts)):
        rw.origin[f"{node.name}[{i}]"] = rw.origin.get(node.args[0].name, "")


@rule(operator.getitem, carries=True)
def getitem(rw: Rewrite, node: fx.Node) -> None:
    """One result of an op that returns several: the layout of that result."""
    source, index = node.args
    layouts = rw.layout.get(source.name)
    layout = layouts[index] if isinstance(layouts, list) else None
    rw.copy(node, layout, (rw.env[source.name], index), {})
    if layout is not None:
        rw.origin[node.name] = rw.origin.get(f"{source.name}[{index}]", "")
