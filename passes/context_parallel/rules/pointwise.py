"""Elementwise ops (with broadcasting): the result holds the sequence where its cut inputs do;
a whole operand with the sequence on that dim is read cut, one of size 1 there as it is."""

from __future__ import annotations

import torch

from ..layout import Cut, aligned
from ..registry import Plan, rule
from .common import tensor_inputs, val

aten = torch.ops.aten


def pull(rw, node, cut: Cut) -> Plan | None:
    out = val(node)
    if out is None or cut.dim >= out.dim() or out.shape[cut.dim] != rw.seq.full_size(cut):
        return None
    wants = {}
    for n in tensor_inputs(node):
        v = val(n)
        dim = cut.dim - (out.dim() - v.dim())
        want = None if dim < 0 or v.shape[dim] == 1 else cut.moved(dim)
        if want is not None and v.shape[dim] != out.shape[cut.dim]:
            return None
        if rw.cut_only(n) and rw.layout(n) != want:
            return None
        wants[n.name] = want
    return Plan(cut, wants)


def forward(rw, node) -> Plan | None:
    out = val(node)
    if out is None:
        return None
    inputs = tensor_inputs(node)
    sources = [n for n in inputs if rw.cut_only(n)] or inputs
    cuts = set()
    for n in sources:
        layout = rw.layout(n)
        if isinstance(layout, Cut):
            cuts.add(aligned(layout, val(n).dim(), out.dim()))
    if len(cuts) != 1 or None in cuts:
        return None
    return pull(rw, node, cuts.pop())


_OPS = [
    "abs",
    "add.Tensor",
    "add.Scalar",
    "sub.Tensor",
    "sub.Scalar",
    "rsub.Scalar",
    "rsub.Tensor",
    "mul.Tensor",
    "mul.Scalar",
    "div.Tensor",
    "div.Scalar",
    "div.Tensor_mode",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "neg",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "tanh",
    "sigmoid",
    "relu",
    "gelu",
    "silu",
    "sin",
    "cos",
    "erf",
    "reciprocal",
    "clamp",
    "clamp_min",
    "clamp_max",
    "maximum",
    "minimum",
    "where.self",
    "where.ScalarOther",
    "where.ScalarSelf",
    "masked_fill.Scalar",
    "masked_fill.Tensor",
    "eq.Tensor",
    "eq.Scalar",
    "ne.Tensor",
    "ne.Scalar",
    "lt.Tensor",
    "lt.Scalar",
    "le.Tensor",
    "le.Scalar",
    "gt.Tensor",
    "gt.Scalar",
    "ge.Tensor",
    "ge.Scalar",
    "logical_and",
    "logical_or",
    "logical_not",
    "bitwise_and.Tensor",
    "bitwise_or.Tensor",
    "bitwise_not",
    "__and__.Tensor",
    "__or__.Tensor",
    "to.dtype",
    "to.dtype_layout",
    "to.device",
    "to.other",
    "_to_copy",
    "type_as",
    "clone",
    "contiguous",
    "alias",
    "detach",
    "lift_fresh_copy",
    "dropout",
    "native_dropout",
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_like",
    "fill.Scalar",
    "floor_divide",
    "remainder.Scalar",
    "remainder.Tensor",
    "fmod.Scalar",
    "isinf",
    "isnan",
    "nan_to_num",
    "sign",
    "floor",
    "ceil",
    "round",
    "log1p",
    "expm1",
    "softplus",
    "hardtanh",
    "leaky_relu",
    "elu",
    "mish",
    "hardswish",
    "hardsigmoid",
    "square",
    "lerp.Scalar",
    "addcmul",
]


def _op(name: str):
    packet, _, overload = name.partition(".")
    found = getattr(aten, packet, None)
    return getattr(found, overload or "default", None) if found is not None else None


rule(*[op for op in map(_op, _OPS) if op is not None], pull=pull)(forward)
