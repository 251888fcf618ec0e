"""scaled_dot_product_attention over a cut sequence, by the config's cp_comm_type:

- "p2p" / "all_gather": smp.cp_attention (ring attention, or keys and values gathered inside the
  op), on this rank's query rows; the mask read as this rank's rows against all columns;
- "a2a" (Ulysses): cp_to_heads on q, k and v, the model's own attention on 1/C of the heads over
  the whole sequence (with the whole mask), cp_to_seq back; the heads (after tensor
  parallelism) must divide by C, key/value heads are repeated where they do not;
- attention dropout (p > 0, which cp_attention does not draw): keys and values gathered, the
  model's attention on this rank's rows, a causal mask made from the rows' positions.
"""

from __future__ import annotations

import warnings

import torch

from ..errors import ContextParallelError, where
from ..layout import Cut
from ..registry import Plan, rule
from .common import val

aten = torch.ops.aten
SEQ = Cut(2)


def _args(node) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    bound = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    bound.update(zip(names, node.args, strict=False))
    bound.update(node.kwargs)
    return bound


def _mask_rows(rw, mask):
    """The mask as this rank's rows against all columns (whole where it broadcasts over rows)."""
    if mask is None:
        return None
    shape = val(mask).shape
    rows = len(shape) >= 2 and shape[-2] == rw.seq.length
    return rw.read(mask, Cut(len(shape) - 2) if rows else None)


@rule(aten.scaled_dot_product_attention.default)
def sdpa(rw, node) -> Plan | None:
    a = _args(node)
    q, k, v = a["query"], a["key"], a["value"]
    if val(q).dim() != 4 or any(rw.layout(x) != SEQ for x in (q, k, v)):
        return None
    scale = a["scale"] if a["scale"] is not None else val(q).shape[-1] ** -0.5
    if rw.comm == "a2a":
        emit = _ulysses(rw, node, a, scale)
    elif a["dropout_p"] > 0:
        emit = _gathered(rw, node, a, scale)
    else:
        emit = _fused(rw, node, a, scale)
    return Plan(SEQ, {q.name: SEQ, k.name: SEQ, v.name: SEQ}, emit=emit)


def _fused(rw, node, a, scale):
    def emit(r):
        q, k, v = (r.cut_to(a[n], SEQ) for n in ("query", "key", "value"))
        mask = _mask_rows(r, a["attn_mask"])
        r.attention.append(f"{node.name}: cp_attention ({r.comm})")
        args = (q, k, v, mask, bool(a["is_causal"]), float(scale), r.comm, r.group)
        return r.emit(torch.ops.smp.cp_attention.default, args, origin=node)

    return emit


def _ulysses(rw, node, a, scale):
    heads, kv_heads, size = val(a["query"]).shape[1], val(a["key"]).shape[1], rw.seq.size
    if heads % size:
        raise ContextParallelError(
            f"smp context parallelism: cp_comm_type 'a2a' splits the attention's heads over the "
            f"{size} ranks, but node '{node.name}'{where(node)} has {heads} query heads (after tensor "
            f"parallelism), which do not divide by {size}; use cp_comm_type 'p2p' or 'all_gather' "
            f"(any head count), or a context_parallel_degree that divides {heads}"
        )
    repeat = heads // kv_heads if kv_heads % size else 1
    if repeat > 1:
        warnings.warn(
            f"smp context parallelism: node '{node.name}'{where(node)} has {kv_heads} key/value heads, "
            f"which do not divide by cp degree {size}: cp_comm_type 'a2a' repeats them {repeat} times "
            f"(to the {heads} query heads) before the all-to-all",
            stacklevel=2,
        )

    def emit(r):
        parts = []
        for name in ("query", "key", "value"):
            x = r.cut_to(a[name], SEQ)
            if repeat > 1 and name != "query":
                x = r.emit(aten.repeat_interleave.self_int, (x, repeat, 1), origin=node)
            parts.append(r.emit(torch.ops.smp.cp_to_heads.default, (x, 2, 1, r.group), origin=node))
        mask = r.read(a["attn_mask"], None)
        if mask is not None and val(a["attn_mask"]).dim() == 4 and val(a["attn_mask"]).shape[1] == heads:
            per = heads // size
            mask = r.emit(aten.slice.Tensor, (mask, 1, r.seq.rank * per, (r.seq.rank + 1) * per), origin=node)
        if a["dropout_p"] > 0:
            kwargs = {"dropout_p": a["dropout_p"], "is_causal": a["is_causal"]} | _scale_kw(a)
            out = r.emit(aten.scaled_dot_product_attention.default, (*parts, mask), kwargs, origin=node)
        else:
            # The whole sequence on this rank's heads through cp_attention alone ("local"): a
            # traced model's materialized causal mask then runs as is_causal on the fused kernel;
            # handed to sdpa it became a float [B, 1, S, S] mask kept for backward (a2a's
            # activations were 0.96x one process's at cp=2: docs/benchmarks.md).
            args = (*parts, mask, bool(a["is_causal"]), float(scale), "local", r.group)
            out = r.emit(torch.ops.smp.cp_attention.default, args, origin=node)
        r.attention.append(f"{node.name}: all-to-all (a2a), {heads // size} heads per rank")
        return r.emit(torch.ops.smp.cp_to_seq.default, (out, 2, 1, r.group), origin=node)

    return emit


def _scale_kw(a) -> dict:
    extra = {}
    if a["scale"] is not None:
        extra["scale"] = a["scale"]
    if a["enable_gqa"]:
        extra["enable_gqa"] = True
    return extra


def _gathered(rw, node, a, scale):
    def emit(r):
        q = r.cut_to(a["query"], SEQ)
        k, v = (r.whole(a[n]) for n in ("key", "value"))
        mask = _mask_rows(r, a["attn_mask"])
        if a["is_causal"]:  # this rank's rows against every column, by position
            rows = r.emit(aten.unsqueeze.default, (r.positions(val(a["query"]).device), 1), origin=node)
            cols = r.emit(
                aten.arange.default, (r.seq.length,), {"device": val(a["query"]).device}, origin=node
            )
            mask = r.emit(aten.le.Tensor, (cols, rows), origin=node)
        r.attention.append(f"{node.name}: keys and values gathered (attention dropout)")
        kwargs = {"dropout_p": a["dropout_p"], "is_causal": False, "scale": scale}
        if a["enable_gqa"]:
            kwargs["enable_gqa"] = True
        return r.emit(aten.scaled_dot_product_attention.default, (q, k, v, mask), kwargs, origin=node)

    return emit
