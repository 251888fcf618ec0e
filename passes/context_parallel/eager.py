"""An attention written out, softmax(Q K^T * scale + mask) V (Hugging Face's
attn_implementation="eager"), read as the scaled_dot_product_attention it computes, so that the
rewrite runs it as any attention: the ring ("p2p"), the gather or Ulysses' all-to-alls, by
cp_comm_type (rules/attention.py). Left written out, its scores' columns are the whole
sequence, so its keys and values would be gathered whatever cp_comm_type says (rules/layers.py).

Only the exact form is read, each value on the way used by the next step alone:

    matmul(q, k.transpose(-1, -2))          q, k, v: [B, H, S, D], the same B and H
      (* or / a number)*                    the scale
      (+ mask | .masked_fill(m, -inf))?     an additive mask of q's dtype, or a bool one (nanoGPT)
      softmax(-1) (casts)* dropout?         HF's float32 softmax, cast back
    matmul(., v)

Anything else (the scores returned with output_attentions, a mask multiplied by the scale, a
fill other than -inf) keeps the written-out form and its gather.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch import fx

from .rules.common import CHECKS, val

aten = torch.ops.aten
_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_CASTS = (aten.to.dtype, aten._to_copy.default)
_SCALES = {aten.mul.Tensor: operator.mul, aten.div.Tensor: operator.truediv}


class _Attention(NamedTuple):
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    negate: bool  # the mask is masked_fill's (True: not attended), sdpa's is its negation
    scale: float
    dropout_p: float
    chain: list[fx.Node]  # the nodes replaced, from Q K^T to the softmax's last cast or dropout
    out: fx.Node  # the product with the values


def eager_to_sdpa(gm: fx.GraphModule) -> list[str]:
    """Replaces each written-out attention of `gm` by scaled_dot_product_attention; returns the
    names of the products replaced (the P V matmuls)."""
    replaced = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _SOFTMAX:
            found = _match(node)
            if found is not None:
                replaced.append(_replace(gm.graph, found))
    if replaced:
        gm.recompile()
    return replaced


def _users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.target not in CHECKS]


def _only_user(node: fx.Node) -> fx.Node | None:
    users = _users(node)
    return users[0] if len(users) == 1 else None


def _match(softmax: fx.Node) -> _Attention | None:
    """The attention around `softmax`, or None where it is not exactly the eager form."""
    scores = val(softmax.args[0])
    if scores is None or scores.dim() != 4 or softmax.args[1] not in (-1, 3):
        return None
    chain = [softmax]
    # Down: casts, dropout, then the product with the values.
    node, dropout_p = _only_user(softmax), 0.0
    while node is not None and node.target in _CASTS + (aten.dropout.default,):
        if node.target is aten.dropout.default:
            if dropout_p or len(node.args) < 3:
                return None
            dropout_p = float(node.args[1]) if node.args[2] else 0.0
        elif node.target is aten._to_copy.default and set(node.kwargs) - {"dtype"}:
            return None
        chain.append(node)
        node = _only_user(node)
    if node is None or node.target is not aten.matmul.default or node.args[0] is not chain[-1]:
        return None
    out, v = node, node.args[1]
    # Up: casts, the mask, casts, the scale, then the product of the queries with the keys.
    node, mask, negate, scale = softmax.args[0], None, False, 1.0
    while isinstance(node, fx.Node) and node.target is not aten.matmul.default:
        if len(_users(node)) != 1:  # each step read by the next alone
            return None
        if node.target is aten._to_copy.default and set(node.kwargs) - {"dtype"}:
            return None
        if node.target is aten.add.Tensor and mask is None and scale == 1.0 and len(node.args) == 2:
            mask = node.args[1]  # (added below the scale: a mask scaled too is not this form)
            m = val(mask) if isinstance(mask, fx.Node) else None
            if m is None or m.dtype != val(out).dtype or not 2 <= m.dim() <= 4:
                return None
        elif node.target is aten.masked_fill.Scalar and mask is None and scale == 1.0:
            mask, negate = node.args[1], True
            if not _fills_minus_inf(node):
                return None
        elif node.target in _SCALES and isinstance(node.args[1], (int, float)) and not node.kwargs:
            scale = _SCALES[node.target](scale, float(node.args[1]))
        elif node.target not in _CASTS:
            return None
        chain.insert(0, node)
        node = node.args[0]
    if not isinstance(node, fx.Node) or len(_users(node)) != 1:
        return None
    chain.insert(0, node)
    q, k = node.args[0], _untransposed(node.args[1])
    if k is None or not _shapes_agree(q, k, v, out):
        return None
    return _Attention(q, k, v, mask, negate, scale, dropout_p, chain, out)


def _fills_minus_inf(fill: fx.Node) -> bool:
    """scores.masked_fill(m, -inf) with a bool m: -inf exactly (a finite fill attends uniformly
    where a row has nothing left)."""
    m = val(fill.args[1])
    if len(fill.args) != 3 or fill.args[2] != float("-inf") or m is None or m.dtype != torch.bool:
        return False
    return 2 <= m.dim() <= 4


def _untransposed(kt) -> fx.Node | None:
    """k of k.transpose(-1, -2) (or the permute swapping the last two dims of a 4-D k)."""
    if not isinstance(kt, fx.Node) or val(kt) is None or val(kt).dim() != 4:
        return None
    if kt.target is aten.transpose.int and {d % 4 for d in kt.args[1:3]} == {2, 3}:
        return kt.args[0]
    if kt.target is aten.permute.default and [d % 4 for d in kt.args[1]] == [0, 1, 3, 2]:
        return kt.args[0]
    return None


def _shapes_agree(q, k, v, out) -> bool:
    tq, tk, tv, to = (val(x) for x in (q, k, v, out))
    if any(t is None or t.dim() != 4 for t in (tq, tk, tv, to)):
        return False
    same_dtype = tq.dtype == tk.dtype == tv.dtype == to.dtype and tq.dtype.is_floating_point
    return (
        same_dtype
        and tq.shape[:2] == tk.shape[:2] == tv.shape[:2]
        and tq.shape[-1] == tk.shape[-1]
        and tk.shape[-2] == tv.shape[-2]
    )


def _replace(graph: fx.Graph, a: _Attention) -> str:
    out, chain, mask = a.out, a.chain, a.mask
    with graph.inserting_before(out):
        if a.negate:  # a masked_fill's: the positions attended are the others
            mask = graph.call_function(aten.logical_not.default, (a.mask,))
            mask.meta = {**a.mask.meta, "val": torch.logical_not(val(a.mask))}
        sdpa = graph.call_function(
            aten.scaled_dot_product_attention.default,
            (a.q, a.k, a.v, mask),
            {"dropout_p": a.dropout_p, "scale": a.scale},
        )
    sdpa.meta = dict(out.meta)
    out.replace_all_uses_with(sdpa)
    transposed = chain[0].args[1]
    for node in [out, *reversed(chain), transposed]:
        if _users(node):
            continue  # (k's transpose read elsewhere too)
        for check in list(node.users):
            graph.erase_node(check)
        graph.erase_node(node)
    return out.name
