"""Reductions: over other dims the sequence stays cut; over the sequence each rank reduces its
positions and cp_reduce sums the ranks' parts (a mean divides by the whole sequence's count), so
the loss is the whole sequence's on every rank."""

from __future__ import annotations

import torch

from ..layout import Cut
from ..registry import Plan, rule
from .common import dim_of, val

aten = torch.ops.aten


def _reduced_dims(node, ndim: int) -> list[int]:
    if node.target in (aten.sum.default, aten.mean.default):
        return list(range(ndim))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or dims == []:
        return list(range(ndim))
    return sorted(dim_of(d, ndim) for d in ([dims] if isinstance(dims, int) else dims))


def _keepdim(node) -> bool:
    if node.target in (aten.sum.default, aten.mean.default):
        return False
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


@rule(aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default)
def reduction(rw, node) -> Plan | None:
    x = node.args[0]
    cut = rw.layout(x)
    if not isinstance(cut, Cut):
        return None
    dims = _reduced_dims(node, val(x).dim())
    if cut.dim not in dims:
        shift = 0 if _keepdim(node) else sum(d < cut.dim for d in dims)
        return Plan(cut.moved(cut.dim - shift), {x.name: cut})
    mean = node.target in (aten.mean.dim, aten.mean.default)
    count = 1
    for d in dims:
        count *= val(x).shape[d] * (rw.seq.size if d == cut.dim else 1)

    def emit(r):
        local = r.cut_to(x, cut)
        if node.target in (aten.sum.default, aten.mean.default):
            partial = r.emit(aten.sum.default, (local,), node.kwargs, origin=node)
        else:
            partial = r.emit(aten.sum.dim_IntList, (local, *node.args[1:]), node.kwargs, origin=node)
        total = r.reduce(partial)
        return r.emit(aten.div.Scalar, (total, count), origin=node) if mean else total

    return Plan(None, {x.name: cut}, emit=emit)


def _loss_args(node) -> dict:
    names = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    defaults = (None, None, None, 1, -100, 0.0)
    bound = dict(zip(names, defaults, strict=True))
    bound.update(zip(names, node.args, strict=False))
    bound.update(node.kwargs)
    return bound


@rule(aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)
def token_loss(rw, node) -> Plan | None:
    """A loss over tokens: each rank's tokens, summed over the group; "mean" divides by the whole
    sequence's count of targets that are not ignore_index (their weights' sum, with weights)."""
    a = _loss_args(node)
    x, target = a["self"], a["target"]
    cut = rw.layout(x)
    if not isinstance(cut, Cut) or (val(x).dim() > 1 and cut.dim == 1):
        return None
    target_cut = cut if cut.dim == 0 else cut.moved(cut.dim - 1)
    wants = {x.name: cut, target.name: target_cut}
    if a["reduction"] == 0:
        return Plan(target_cut, wants)

    def emit(r):
        local_x, local_t = r.cut_to(x, cut), r.cut_to(target, target_cut)
        weight = r.read(a["weight"], None)
        args = [local_x, local_t, weight, 2, a["ignore_index"]]
        if node.target is aten.cross_entropy_loss.default:
            args.append(a["label_smoothing"])
        total = r.reduce(r.emit(node.target, args, origin=node))
        if a["reduction"] == 2:
            return total
        valid = r.emit(aten.ne.Scalar, (local_t, a["ignore_index"]), origin=node)
        if weight is None:
            counted = r.emit(
                aten.sum.dim_IntList, (valid, [], False), {"dtype": val(node).dtype}, origin=node
            )
        else:
            index = r.emit(aten.clamp_min.default, (local_t, 0), origin=node)
            weights = r.emit(
                aten.mul.Tensor, (r.emit(aten.index.Tensor, (weight, [index]), origin=node), valid)
            )
            counted = r.emit(aten.sum.default, (weights,), origin=node)
        return r.emit(aten.div.Tensor, (total, r.reduce(counted)), origin=node)

    return Plan(None, wants, emit=emit)
