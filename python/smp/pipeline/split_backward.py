"""A stage's backward in two parts, for the zero-bubble schedule: B computes the gradients of the
stage's inputs (sent upstream at once), W later computes the weights' gradients.

B runs autograd from the roots to the inputs only, keeping the graph, and notes the gradient that
arrives at each "boundary" node: a node on the way to the inputs from which a weight's gradient
branches off (a linear layer's matmul). W then restarts autograd at those nodes with the noted
gradients, asking only for the weights. This is torch.distributed.pipelining's
stage_backward_input / stage_backward_weight, with two differences: W accumulates through
autograd (`backward(inputs=weights)`), so a parameter's post-accumulate-grad hooks fire as in a
plain backward (data-parallel buckets launch after their W; fp32 accumulation and flat gradient
buffers work unchanged); and every boundary node belongs to one group, each clamped to its noted
gradient, so a gradient reaching a boundary node by two ways is not counted twice.

When the split cannot cover a weight (its gradient reaches a root without passing the inputs'
part of the graph) the backward runs whole at B: correct, only not split. A stage whose inputs
need no gradient (the first) has nothing to send at B and runs its whole backward at W.
"""

from __future__ import annotations

import collections
import functools

import torch
from torch.autograd.graph import GradientEdge, Node


class Deferred:
    """What B leaves for W: run() accumulates the weights' gradients (once)."""

    def __init__(self, roots, grads, weights: list[torch.Tensor]):
        # Either whole-backward roots (tensors) or boundary edges with their noted gradients.
        self._roots, self._grads, self._weights = roots, grads, weights

    def run(self) -> None:
        roots, grads, self._roots, self._grads = self._roots, self._grads, None, None
        if roots:
            torch.autograd.backward(roots, grads, inputs=self._weights or None)


def backward_inputs(
    roots: list[torch.Tensor],
    grads: list[torch.Tensor],
    inputs: list[torch.Tensor],
    weights: list[torch.Tensor],
    losses: list[torch.Tensor] = (),
) -> tuple[list[torch.Tensor | None], Deferred | None]:
    """B: the gradients of `inputs` (None where unused), and what W needs (None if nothing is
    left: the backward ran whole). `losses` are the roots the user passed (not the stage's
    outputs): they are detached after B, so that the graph above the boundary is freed then, not
    when the user's step function lets go of its loss (a stage output is not: the stage's own
    graph may have saved it, e.g. as the input of its next layer)."""
    wanted = [x for x in inputs if x.requires_grad]
    if not roots:
        return [None] * len(inputs), None
    if not wanted:  # the first stage: everything is weight gradients
        return [None] * len(inputs), Deferred(roots, grads, [])
    root_nodes = [_node(t) for t in roots]
    reverse = _reverse_graph(root_nodes)
    boundary, used = _boundary(root_nodes, [_node(x) for x in wanted], weights, reverse)
    if boundary is None:
        torch.autograd.backward(roots, grads)
        return [x.grad if x.requires_grad else None for x in inputs], None
    noted: dict[Node, tuple] = {}
    handles = [node.register_prehook(functools.partial(_note, noted, node)) for node in boundary]
    try:
        got = torch.autograd.grad(roots, wanted, grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for t in losses:  # the graph above the boundary is needed no more: free it now, not at W
        _release(t)
    by_input = dict(zip(map(id, wanted), got, strict=True))
    edges, seeds = [], []
    for node, gs in noted.items():
        for i, g in enumerate(gs):
            if g is not None:
                edges.append(GradientEdge(node, i))
                seeds.append(g)
    deferred = _Clamped(edges, seeds, used, noted) if edges and used else None
    return [by_input.get(id(x)) for x in inputs], deferred


class _Clamped(Deferred):
    """W from boundary nodes: each gets exactly its noted gradient, however many ways reach it."""

    def __init__(self, edges, seeds, weights, noted: dict[Node, tuple]):
        super().__init__(edges, seeds, weights)
        self._noted = noted

    def run(self) -> None:
        noted, self._noted = self._noted, None
        handles = [node.register_prehook(lambda _, g=g: g) for node, g in noted.items()]
        try:
            super().run()
        finally:
            for handle in handles:
                handle.remove()


def _note(noted: dict, node: Node, grad_outputs: tuple) -> None:
    noted[node] = tuple(grad_outputs)


def _release(t: torch.Tensor) -> None:
    try:
        t.detach_()
    except RuntimeError:  # a view cannot be detached in place; its graph then lives until W
        pass


def _node(t: torch.Tensor) -> Node:
    """The tensor's grad_fn, or for a leaf its AccumulateGrad node."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _reverse_graph(roots: list[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes that feed it gradients (its consumers in the forward)."""
    reverse: dict[Node, list[Node]] = collections.defaultdict(list)
    seen = set(roots)
    queue = collections.deque(roots)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            reverse[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return reverse


def _towards_roots(starts: list[Node], stop: set[Node], reverse) -> tuple[set[Node], set[Node]]:
    """Nodes reached from `starts` going towards the roots, not past `stop`; and the `stop` nodes hit."""
    closure, hit = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for parent in reverse.get(queue.popleft(), ()):
            if parent in stop:
                hit.add(parent)
            elif parent not in closure:
                closure.add(parent)
                queue.append(parent)
    return closure, hit


def _boundary(root_nodes, input_nodes, weights, reverse):
    """The boundary nodes and the weights this backward reaches; (None, weights) if some weight's
    gradient reaches a root without passing the inputs' part of the graph."""
    to_inputs, _ = _towards_roots(input_nodes, set(), reverse)
    roots = set(root_nodes)
    boundary: set[Node] = set()
    used = []
    for w in weights:
        if not w.requires_grad:
            continue
        node = _node(w)
        if node not in reverse:
            continue  # this microbatch's graph does not use it
        used.append(w)
        closure, hit = _towards_roots([node], to_inputs, reverse)
        if not hit or closure & roots:
            return None, used
        boundary |= hit
    return boundary, used
