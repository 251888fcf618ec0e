"""Outline: moves a set of a graph's nodes into a submodule that one call_module node runs.

Activation checkpointing uses it to make each checkpointed region of a stage one call
(the submodule recomputes its body in backward). The pass is generic: it takes the
nodes to move, keeps the graph's meaning, and never reorders dependent computation.

A set is outlined in convex pieces: a piece never contains two nodes with an outside
node between them on a dependency path (that would need the call to both precede and
follow the outside node). Parameters, buffers and placeholders the piece reads become
the submodule's inputs, so the parent keeps owning every tensor.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

from smp.passes.fx_utils import COMPUTE_OPS
from torch import fx, nn


@dataclasses.dataclass(frozen=True)
class Outlined:
    """One outlined piece: the call's submodule name and the original nodes it replaced."""

    name: str
    node_names: tuple[str, ...]


def convex_pieces(graph: fx.Graph, members: set[fx.Node]) -> list[list[fx.Node]]:
    """`members` (compute nodes of `graph`) cut into convex runs, each in graph order."""
    pieces: list[list[fx.Node]] = []
    piece: list[fx.Node] = []
    inside: set[fx.Node] = set()
    tainted: set[fx.Node] = set()  # outside nodes that depend on the current piece
    for node in graph.nodes:
        depends = any(a in inside or a in tainted for a in node.all_input_nodes)
        if node in members:
            if any(a in tainted for a in node.all_input_nodes):  # would close a cycle: new piece
                pieces.append(piece)
                piece, inside, tainted = [], set(), set()
            piece.append(node)
            inside.add(node)
        elif depends:
            tainted.add(node)
    if piece:
        pieces.append(piece)
    return [p for p in pieces if p]


def outline(
    gm: fx.GraphModule, nodes: list[fx.Node], name: str, wrap: Callable[[fx.GraphModule], nn.Module]
) -> Outlined | None:
    """Replaces the convex piece `nodes` (graph order) of `gm` by a call of `wrap(body)`, added to
    `gm` as submodule `name`. Returns None when the piece computes nothing used outside it."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for node in nodes:
        for a in node.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    if not outputs:
        return None
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for node in nodes:
        env[node] = body.node_copy(node, lambda a: env[a])
    body.output(tuple(env[o] for o in outputs))
    gm.add_submodule(name, wrap(fx.GraphModule(gm, body)))

    last = nodes[-1]
    tainted = _dependents_before(gm.graph, nodes[0], last, inside)
    with gm.graph.inserting_after(last):
        call = gm.graph.call_module(name, tuple(inputs))
    anchor = call
    results = {}
    for i, out in enumerate(outputs):
        with gm.graph.inserting_after(anchor):
            anchor = gm.graph.call_function(operator.getitem, (call, i))
        anchor.meta = {k: v for k, v in out.meta.items() if k in ("val", "tensor_meta")}
        results[out] = anchor
    for out, result in results.items():
        for user in list(out.users):
            if user not in inside:
                user.replace_input_with(out, result)
    for node in tainted:  # outside users placed before the call now follow it, in their order
        anchor.append(node)
        anchor = node
    for node in reversed(nodes):
        gm.graph.erase_node(node)
    return Outlined(name, tuple(n.name for n in nodes))


def _dependents_before(graph: fx.Graph, first: fx.Node, last: fx.Node, inside: set[fx.Node]) -> list[fx.Node]:
    """Outside nodes between `first` and `last` that depend on the piece, in graph order."""
    found: list[fx.Node] = []
    seen: set[fx.Node] = set()
    node = first
    while node is not last:
        node = node.next
        if node not in inside and any(a in inside or a in seen for a in node.all_input_nodes):
            seen.add(node)
            found.append(node)
    return found


def compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op in COMPUTE_OPS]
