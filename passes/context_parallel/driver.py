"""The context-parallel rewrite: one pass over the original graph that emits this rank's graph.

Every value of the new graph is whole (the same on every rank of the cp group) or cut on the
sequence (this rank's positions; layout.py). The ranks read the same batch, so inputs are whole
and cutting one is a local slice. A node runs cut when an input is only held cut (activations)
or when it reads a parameter and an input holds the sequence (the embedding of the token ids:
where the cut starts); otherwise it runs whole, and a whole value that meets a cut one is cut
where it is read, computed for this rank's positions only where its rule can pull the cut back
to its own inputs (masks and rotary tables from `arange`), else sliced. Whole versions nothing
reads are dropped at the end. An op no rule can run cut gets its inputs gathered (always
correct; reported).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from ..fx_utils import fetch_attr
from . import registry
from .errors import ContextParallelError, where
from .layout import Cut, Sequence_
from .registry import Layout, Plan
from .rules.common import CHECKS

aten = torch.ops.aten

# Ops that gather nothing: the scores of an attention, gathered, would be the whole sequence's.
_ATTENTION = (aten.softmax.int, aten._softmax.default, aten.scaled_dot_product_attention.default)


class Rewrite:
    def __init__(
        self,
        gm: fx.GraphModule,
        group_name: str,
        seq: Sequence_,
        comm: str,
        input_cuts: Mapping[str, Cut],
    ):
        self.gm, self.group, self.seq, self.comm = gm, group_name, seq, comm
        self.input_cuts = dict(input_cuts)
        self.graph = fx.Graph()
        self.full: dict[str, fx.Node] = {}  # original name -> its whole value
        self.cut: dict[str, tuple[fx.Node, Layout]] = {}  # original name -> its cut value
        self.seq_of: dict[str, Layout] = {}  # original name -> where its whole value holds the sequence
        self.reads_params = _reads_parameters(gm)
        self.gathered: list[str] = []  # report: values gathered whole, and why
        self.attention: list[str] = []  # report: each attention and how it was cut
        self._cache: dict[tuple[str, Any], fx.Node] = {}
        self.current: fx.Node | None = None
        # The capture's fake mode: new nodes without fake inputs (arange) infer their values in it.
        self.fake_mode = next(
            (v.fake_mode for n in gm.graph.nodes if isinstance(v := n.meta.get("val"), FakeTensor)), None
        )

    # --- the walk ---------------------------------------------------------------

    def run(self) -> fx.Graph:
        for node in self.gm.graph.nodes:
            self.current = node
            if node.op == "placeholder":
                self._copy_whole(node)
                self.seq_of[node.name] = self.input_cuts.get(node.name)
            elif node.op == "get_attr":
                self._copy_whole(node)
            elif node.op == "output":
                self.graph.output(fx.node.map_arg(node.args[0], self.whole))
            elif node.op == "call_function" and node.target in CHECKS:
                continue  # (dropped: they would keep whole versions alive)
            else:
                self._call(node)
        self.graph.eliminate_dead_code()
        self.graph.lint()
        return self.graph

    def _call(self, node: fx.Node) -> None:
        found = registry.lookup(node.target) if node.op == "call_function" else None
        plan = found.forward(self, node) if found is not None else None
        cut_inputs = [n for n in node.all_input_nodes if self.cut_only(n)]
        starts_cut = node.name in self.reads_params and plan is not None and plan.out is not None
        if plan is not None and (cut_inputs or starts_cut):
            new = self.emit_plan(node, plan)
            if plan.out is None:
                self.full[node.name] = new
            else:
                self.cut[node.name] = (new, plan.out)
            return
        if cut_inputs:
            self._gathers(node, cut_inputs)
        elif self._over_sequence(node):
            self._whole_attention(node)
        self._copy_whole(node)
        if plan is not None and plan.finish is None:
            self.seq_of[node.name] = plan.out

    def _copy_whole(self, node: fx.Node) -> None:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.whole)
        new = self.graph.create_node(node.op, node.target, args, kwargs, name=node.name)
        new.meta = dict(node.meta)
        new.meta["smp_tp_origin"] = node.name
        self.full[node.name] = new

    def _gathers(self, node: fx.Node, inputs: list[fx.Node]) -> None:
        """`node` has no rule for its cut inputs: they are gathered (refused for attention's
        softmax, which would hold the whole sequence's scores on every rank)."""
        if node.target in _ATTENTION and self.gathered:  # an input reaches it gathered
            self._whole_attention(node)
        if node.target in _ATTENTION:
            raise ContextParallelError(
                f"smp context parallelism cannot cut the attention at node '{node.name}' "
                f"({node.target}){where(node)}: its inputs are cut on the sequence in a way this "
                "form does not allow (the softmax must run over the keys' dimension of "
                "[..., queries, keys] scores, and scaled_dot_product_attention take [batch, heads, "
                "sequence, head_dim] inputs); write the attention as "
                "torch.nn.functional.scaled_dot_product_attention, or use context_parallel_degree=1"
            )
        names = ", ".join(n.name for n in inputs)
        self.gathered.append(f"{node.name} ({node.target}){where(node)}: gathers {names}")

    def _over_sequence(self, node: fx.Node) -> bool:
        """Whether `node` is an attention over the cut sequence (sdpa's queries, or softmax over
        [..., S, S] scores, of the sequence's length)."""
        if node.target not in _ATTENTION or not node.args:
            return False
        x = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-2] != self.seq.length:
            return False
        return node.target is aten.scaled_dot_product_attention.default or x.shape[-1] == self.seq.length

    def _whole_attention(self, node: fx.Node) -> None:
        """An attention over the sequence with inputs gathered whole would run (part of) the whole
        sequence on every rank: refused, naming what was gathered."""
        gathered = "; ".join(self.gathered) or "none recorded"
        raise ContextParallelError(
            f"smp context parallelism cannot cut the attention at node '{node.name}' ({node.target})"
            f"{where(node)}: inputs reach it whole, because ops before it have no "
            f"context-parallel rule and were gathered ({gathered}); write those steps with ops "
            "the pass follows (view/reshape/permute/transpose/split/unbind, pointwise, linear), "
            "or use context_parallel_degree=1"
        )

    # --- reading values -----------------------------------------------------------

    def cut_only(self, node: fx.Node) -> bool:
        return node.name in self.cut and node.name not in self.full

    def layout(self, node: fx.Node) -> Layout:
        """Where `node`'s value holds the sequence as the rules see it: its cut, or where its
        whole value holds it (None: nowhere known)."""
        if self.cut_only(node):
            return self.cut[node.name][1]
        return self.seq_of.get(node.name)

    def read(self, node: Any, want: Cut | None) -> Any:
        """The local value of an original node: whole (want None) or cut by `want`."""
        if not isinstance(node, fx.Node):
            return node
        return self.whole(node) if want is None else self.cut_to(node, want)

    def whole(self, node: fx.Node) -> fx.Node:
        if node.name in self.full:
            return self.full[node.name]
        local, layout = self.cut[node.name]
        return self.cached((node.name, None), lambda: self._gather(node, local, layout))

    def cut_to(self, node: fx.Node, want: Cut) -> fx.Node:
        if node.name in self.cut and self.cut[node.name][1] == want:
            return self.cut[node.name][0]
        return self.cached((node.name, want), lambda: self._pull(node, want))

    def cached(self, key: tuple[str, Any], make: Callable[[], fx.Node]) -> fx.Node:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def _pull(self, node: fx.Node, want: Cut) -> fx.Node:
        """`node`'s value cut by `want`: computed from cut inputs where its rule can, else sliced
        from the whole value."""
        found = registry.lookup(node.target) if node.op == "call_function" else None
        random = isinstance(node.target, torch._ops.OpOverload) and (
            torch.Tag.nondeterministic_seeded in node.target.tags
        )
        if found is not None and found.pull is not None and not random:
            before, self.current = self.current, node
            try:
                plan = found.pull(self, node, want)
                if plan is not None:
                    return self.emit_plan(node, plan)
            finally:
                self.current = before
        return self.slice(self.whole(node), node.meta["val"], want, node)

    # --- emitting -------------------------------------------------------------------

    def emit(self, target, args, kwargs=None, origin: fx.Node | None = None) -> fx.Node:
        """A new node serving `origin` (default: the node being rewritten); its fake value inferred."""
        origin = origin or self.current
        node = self.graph.create_node("call_function", target, tuple(args), dict(kwargs or {}))
        node.meta = {k: v for k, v in origin.meta.items() if k in ("nn_module_stack", "stack_trace")}
        node.meta["smp_tp_origin"] = origin.name
        node.meta["val"] = _infer_val(node, self.fake_mode)
        return node

    def emit_plan(self, node: fx.Node, plan: Plan) -> fx.Node:
        if plan.emit is not None:
            return plan.emit(self)
        args = node.args if plan.args is None else plan.args
        kwargs = node.kwargs if plan.kwargs is None else plan.kwargs
        args, kwargs = fx.node.map_arg((args, kwargs), lambda n: self.read(n, plan.wants.get(n.name)))
        new = self.emit(node.target, args, kwargs, origin=node)
        return plan.finish(self, new) if plan.finish is not None else new

    def slice(self, value: fx.Node, val: torch.Tensor, cut: Cut, origin: fx.Node) -> fx.Node:
        """This rank's positions of a whole value (narrow and cat: a copy of two chunks)."""
        dim, length = cut.dim, self.seq.length
        if (cut.pre, cut.post) != (1, 1):
            value = self.emit(aten.unflatten.int, (value, dim, [cut.pre, length, cut.post]), origin=origin)
            dim += 1
        chunk = self.seq.chunk
        parts = [
            self.emit(aten.slice.Tensor, (value, dim, c * chunk, (c + 1) * chunk), origin=origin)
            for c in self.seq.chunks()
        ]
        out = self.emit(aten.cat.default, (parts, dim), origin=origin)
        if (cut.pre, cut.post) != (1, 1):
            out = self.emit(aten.flatten.using_ints, (out, dim - 1, dim + 1), origin=origin)
        return out

    def _gather(self, node: fx.Node, local: fx.Node, layout: Layout) -> fx.Node:
        if isinstance(layout, list):  # a tuple: each element whole
            parts = [
                self._gather_one(self.emit(operator.getitem, (local, i), origin=node), c)
                for i, c in enumerate(layout)
            ]
            return self.emit(_tuple, (parts,), origin=node)
        self.gathered.append(f"{node.name}{where(node)}: gathered whole")
        return self._gather_one(local, layout)

    def _gather_one(self, local: fx.Node, cut: Cut | None) -> fx.Node:
        if cut is None:
            return local
        dim = cut.dim
        if (cut.pre, cut.post) != (1, 1):
            local = self.emit(aten.unflatten.int, (local, dim, [cut.pre, self.seq.local, cut.post]))
            dim += 1
        out = self.emit(torch.ops.smp.cp_gather.default, (local, dim, self.group))
        if (cut.pre, cut.post) != (1, 1):
            out = self.emit(aten.flatten.using_ints, (out, dim - 1, dim + 1))
        return out

    def positions(self, device: torch.device) -> fx.Node:
        """This rank's positions of the sequence, as an int64 tensor."""
        chunk = self.seq.chunk
        parts = [
            self.emit(aten.arange.start, (c * chunk, (c + 1) * chunk), {"device": device})
            for c in self.seq.chunks()
        ]
        return self.emit(aten.cat.default, (parts,))

    def reduce(self, value: fx.Node) -> fx.Node:
        """The sum over the cp group of every rank's partial `value` (the exact adjoint backward)."""
        return self.emit(torch.ops.smp.cp_reduce.default, (value, self.group))


def _tuple(parts: list) -> tuple:
    return tuple(parts)


def _reads_parameters(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes whose value depends on a parameter (trainable or not)."""
    found: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if isinstance(fetch_attr(gm, node.target), nn.Parameter):
                found.add(node.name)
        elif any(a.name in found for a in node.all_input_nodes):
            found.add(node.name)
    return found


def _infer_val(node: fx.Node, fake_mode):
    """The node's fake value, computed on its inputs' fake values (as the tensor-parallel
    rewrite does: inside their fake mode, below autograd; `fake_mode` where none is fake).

    A later signature's capture holds the skeleton's parameters on the meta device while the
    devices the graph names (arange's) are real ones: where the devices disagree, the value is
    inferred with every tensor and device on meta (only its shape and dtype are read)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    fakes = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, FakeTensor)]
    mode = fakes[0].fake_mode if fakes else fake_mode
    if mode is None:
        return None
    with mode, torch._C._AutoDispatchBelowAutograd():
        try:
            return node.target(*args, **kwargs)
        except Exception:
            pass
        meta = torch.device("meta")
        args, kwargs = pytree.tree_map(
            lambda v: v.to(meta) if isinstance(v, FakeTensor) else meta if isinstance(v, torch.device) else v,
            (args, kwargs),
        )
        try:
            return node.target(*args, **kwargs)
        except Exception:
            return None
