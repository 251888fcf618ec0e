"""Views, dim moves, slices on other dims, tuples and `arange`: the sequence moves with its dim."""

from __future__ import annotations

import operator

import torch

from ..layout import Cut, view_cut
from ..registry import Plan, rule
from .common import dim_of, val

aten = torch.ops.aten


def _single(rw, node) -> tuple[torch.fx.Node, Cut] | None:
    """The node's first input and its cut, when it has one."""
    x = node.args[0]
    layout = rw.layout(x)
    return (x, layout) if isinstance(layout, Cut) else None


def _local_sizes(rw, node, cut: Cut) -> list[int]:
    return rw.seq.local_shape(list(val(node).shape), cut)


# --- views ---------------------------------------------------------------------


def _view_plan(rw, node, x, in_cut: Cut, out_cut: Cut) -> Plan:
    local = _local_sizes(rw, node, out_cut)
    if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return Plan(out_cut, {x.name: in_cut}, args=(x, local))

    def emit(r):  # flatten / unflatten: a reshape to the local sizes
        return r.emit(aten.reshape.default, (r.cut_to(x, in_cut), local), origin=node)

    return Plan(out_cut, {x.name: in_cut}, emit=emit)


def view_forward(rw, node) -> Plan | None:
    found = _single(rw, node)
    if found is None or val(node) is None:
        return None
    x, cut = found
    out_cut = view_cut(val(x).shape, val(node).shape, cut, rw.seq.length)
    return None if out_cut is None else _view_plan(rw, node, x, cut, out_cut)


def view_pull(rw, node, cut: Cut) -> Plan | None:
    x = node.args[0]
    in_cut = view_cut(val(node).shape, val(x).shape, cut, rw.seq.length)
    if in_cut is None or view_cut(val(x).shape, val(node).shape, in_cut, rw.seq.length) != cut:
        return None
    return _view_plan(rw, node, x, in_cut, cut)


rule(
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    pull=view_pull,
)(view_forward)


# --- dims that move ----------------------------------------------------------------


def _dim_map(node) -> list[int | None] | None:
    """For each result dim, the input dim it is (None: new); None for ops this does not describe."""
    x, out, target = val(node.args[0]), val(node), node.target
    if x is not None and target is aten.unbind.int:  # a list of results (val(node) is None)
        d = dim_of(node.args[1] if len(node.args) > 1 else 0, x.dim())
        return [i for i in range(x.dim()) if i != d]
    if x is None or out is None:
        return None
    nin, nout = x.dim(), out.dim()
    if target is aten.unsqueeze.default:
        d = dim_of(node.args[1], nout)
        return [None if i == d else (i if i < d else i - 1) for i in range(nout)]
    if target is aten.transpose.int or target is aten.t.default:
        a, b = (0, 1) if target is aten.t.default else (dim_of(node.args[1], nin), dim_of(node.args[2], nin))
        order = list(range(nin))
        order[a], order[b] = order[b], order[a]
        return order
    if target is aten.permute.default:
        return [dim_of(d, nin) for d in node.args[1]]
    if target in (aten.select.int, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        if target is aten.squeeze.default:
            gone = {i for i in range(nin) if x.shape[i] == 1}
        elif target is aten.squeeze.dims:
            gone = {dim_of(d, nin) for d in node.args[1] if x.shape[dim_of(d, nin)] == 1}
        else:
            d = dim_of(node.args[1], nin)
            gone = {d} if target is aten.select.int or x.shape[d] == 1 else set()
        return [i for i in range(nin) if i not in gone]
    if target in (aten.slice.Tensor, aten.expand.default):
        return [None] * (nout - nin) + list(range(nin))
    return None


def _touches(node, cut: Cut, nin: int) -> bool:
    """Whether the op acts along the cut dim itself (a slice or select of it)."""
    if node.target in (aten.slice.Tensor, aten.select.int, aten.unbind.int):
        d = node.args[1] if len(node.args) > 1 else 0
        return dim_of(d, nin) == cut.dim
    return False


def _moved_plan(rw, node, in_cut: Cut | None, out_cut: Cut) -> Plan:
    x = node.args[0]
    if node.target is aten.expand.default:
        sizes = list(node.args[1])
        sizes[out_cut.dim] = _local_sizes(rw, node, out_cut)[out_cut.dim]
        return Plan(out_cut, {x.name: in_cut}, args=(x, sizes))
    if node.target is aten.unbind.int:
        return Plan([out_cut] * len(val_list(node)), {x.name: in_cut})
    return Plan(out_cut, {x.name: in_cut})


def val_list(node) -> list:
    value = node.meta.get("val")
    return list(value) if isinstance(value, (list, tuple)) else []


def moved_forward(rw, node) -> Plan | None:
    found = _single(rw, node)
    mapping = _dim_map(node)
    if found is None or mapping is None:
        return None
    x, cut = found
    if _touches(node, cut, val(x).dim()) or cut.dim not in mapping:
        return None
    return _moved_plan(rw, node, cut, cut.moved(mapping.index(cut.dim)))


def moved_pull(rw, node, cut: Cut) -> Plan | None:
    mapping = _dim_map(node)
    if mapping is None or node.target is aten.unbind.int or cut.dim >= len(mapping):
        return None
    source = mapping[cut.dim]
    x = node.args[0]
    if source is None or val(x).shape[source] == 1:  # a new or broadcast dim
        return _moved_plan(rw, node, None, cut) if node.target is aten.expand.default else None
    in_cut = cut.moved(source)
    if _touches(node, in_cut, val(x).dim()) or (rw.cut_only(x) and rw.layout(x) != in_cut):
        return None
    return _moved_plan(rw, node, in_cut, cut)


rule(
    aten.unsqueeze.default,
    aten.transpose.int,
    aten.t.default,
    aten.permute.default,
    aten.select.int,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.slice.Tensor,
    aten.expand.default,
    aten.unbind.int,
    pull=moved_pull,
)(moved_forward)


# --- tuples --------------------------------------------------------------------


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def split_forward(rw, node) -> Plan | None:
    found = _single(rw, node)
    if found is None:
        return None
    x, cut = found
    dim = dim_of(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), val(x).dim())
    if dim == cut.dim:
        return None
    return Plan([cut] * len(val_list(node)), {x.name: cut})


@rule(operator.getitem)
def getitem_forward(rw, node) -> Plan | None:
    layout = rw.layout(node.args[0])
    if not isinstance(layout, list) or layout[node.args[1]] is None:
        return None
    return Plan(layout[node.args[1]], {node.args[0].name: layout})


def cat_pull(rw, node, cut: Cut) -> Plan | None:
    tensors, dim = node.args[0], dim_of(node.args[1] if len(node.args) > 1 else 0, val(node).dim())
    if dim == cut.dim:
        return None
    wants = {}
    for t in tensors:
        if val(t).shape[cut.dim] != rw.seq.full_size(cut) or (rw.cut_only(t) and rw.layout(t) != cut):
            return None
        wants[t.name] = cut
    return Plan(cut, wants)


@rule(aten.cat.default, pull=cat_pull)
def cat_forward(rw, node) -> Plan | None:
    cuts = {rw.layout(t) for t in node.args[0] if rw.cut_only(t)} or {rw.layout(t) for t in node.args[0]}
    if len(cuts) != 1 or not isinstance(next(iter(cuts)), Cut):
        return None
    return cat_pull(rw, node, cuts.pop())


# --- positions -------------------------------------------------------------------


def _arange_bounds(node) -> tuple[float, float] | None:
    """(start, step) of an arange over the sequence."""
    if node.target is aten.arange.default:
        return 0, 1
    args = list(node.args) + [1] * (3 - len(node.args))
    return (args[0], args[2]) if node.target is aten.arange.start_step else (args[0], 1)


def arange_pull(rw, node, cut: Cut) -> Plan | None:
    """The positions this rank holds: two aranges, one per chunk (global positions)."""
    if cut != Cut(0) or val(node).shape[0] != rw.seq.length:
        return None
    start, step = _arange_bounds(node)
    chunk = rw.seq.chunk

    def emit(r):
        parts = [
            r.emit(
                aten.arange.start_step,
                (start + step * c * chunk, start + step * (c + 1) * chunk, step),
                node.kwargs,
                origin=node,
            )
            for c in rw.seq.chunks()
        ]
        return r.emit(aten.cat.default, (parts,), origin=node)

    return Plan(cut, emit=emit)


@rule(aten.arange.default, aten.arange.start, aten.arange.start_step, pull=arange_pull)
def arange_forward(rw, node) -> Plan | None:
    out = val(node)
    return Plan(Cut(0)) if out is not None and out.dim() == 1 and out.shape[0] == rw.seq.length else None
