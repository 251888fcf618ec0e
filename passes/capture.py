"""Capture: an unmodified nn.Module -> a flat torch.fx graph of ATen ops (torch.export, non-strict)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree


class CaptureError(RuntimeError):
    pass


@dataclasses.dataclass
class CapturedGraph:
    """A model's forward as one flat graph.

    Placeholders are the leaves of `(args, kwargs)` flattened with `in_spec`; the
    output node returns a flat tuple of leaves that `out_spec` rebuilds into the
    forward's return value. Parameters and buffers are `get_attr` nodes on
    `graph_module`, which holds the module's own tensors (not copies).
    """

    graph_module: fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    # requires_grad of each flat input leaf at capture time (False for non-tensors).
    input_requires_grad: list[bool]
    # The non-tensor input leaves (ints, flags, None): the graph is specialized to them.
    input_constants: dict[int, Any] = dataclasses.field(default_factory=dict)
    keyword_order: list[str] = dataclasses.field(default_factory=list)
    # (positional count, keyword names) of calls of plain leaves that matched in_spec -> the keyword
    # order of their leaves: such a call flattens without pytree (every microbatch calls the model).
    _flat_calls: dict[tuple, list[str]] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def flatten_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        """The flat input leaves of a call, checked against the capture's structure and constants."""
        call = (len(args), tuple(kwargs))
        keys = self._flat_calls.get(call)
        if keys is not None and all(map(is_plain_leaf, kwargs.values())) and all(map(is_plain_leaf, args)):
            leaves = [*args, *(kwargs[k] for k in keys)]  # a call of this shape matched in_spec before
        else:
            leaves = self._flatten_checked(args, kwargs)
            if all(map(is_plain_leaf, leaves)) and len(leaves) == len(args) + len(kwargs):
                self._flat_calls[call] = [k for k in self.keyword_order if k in kwargs] + [
                    k for k in kwargs if k not in self.keyword_order
                ]
        for i, constant in self.input_constants.items():
            if not _same(leaves[i], constant):
                raise ValueError(
                    f"smp: model input {i} is {leaves[i]!r}, but the graph was captured with {constant!r}; "
                    "non-tensor arguments are fixed at capture: pass the same value on every step, or pass "
                    "it as a tensor"
                )
        return leaves

    def _flatten_checked(self, args: tuple, kwargs: dict) -> list[Any]:
        ordered = {k: kwargs[k] for k in self.keyword_order if k in kwargs} | kwargs  # keyword order is free
        leaves, spec = pytree.tree_flatten((tuple(args), ordered))
        if spec != self.in_spec:
            raise ValueError(
                f"smp: the model was captured for inputs structured as {self.in_spec}, but was called with "
                f"{spec}; call the model with the same arguments (names, nesting) on every step"
            )
        return leaves

    def output_nodes(self) -> list[Any]:
        """The flat output leaves: graph nodes, or constants the graph returns as they are."""
        (out,) = [n for n in self.graph_module.graph.nodes if n.op == "output"]
        return list(out.args[0])


_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


def is_plain_leaf(x: Any) -> bool:
    """Whether `x` is a pytree leaf of a kind no pytree registration can make a container."""
    return isinstance(x, _PLAIN_LEAVES)


def capture(module: torch.nn.Module, args: tuple = (), kwargs: dict | None = None) -> CapturedGraph:
    """Traces `module(*args, **kwargs)` with torch.export (non-strict: the Python runs on fake tensors).

    The graph is specialized to the shapes of these inputs. Errors from the tracer
    are re-raised as CaptureError with what to change.
    """
    kwargs = dict(kwargs or {})
    try:
        program = torch.export.export(module, tuple(args), kwargs, strict=False)
    except Exception as err:  # the tracer raises many types; all mean "cannot capture"
        raise CaptureError(_capture_failure_message(module, err)) from err
    try:
        gm = program.module(check_guards=False)
    except TypeError:  # torch < 2.14 has no check_guards
        gm = program.module()
    _drop_guard_calls(gm)
    leaves, in_spec = pytree.tree_flatten((tuple(args), kwargs))
    requires_grad = [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]
    constants = {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)}
    return CapturedGraph(gm, in_spec, program.call_spec.out_spec, requires_grad, constants, list(kwargs))


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # values without a usable ==: only the same object counts
        return a is b


def _drop_guard_calls(gm: fx.GraphModule) -> None:
    # export inserts a call to a `_guards_fn` submodule that re-checks input shapes;
    # stages check their inputs themselves.
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")


def _capture_failure_message(module: torch.nn.Module, err: Exception) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"smp could not capture {type(module).__name__}.forward as a graph "
        f"(torch.export, non-strict): {type(err).__name__}: {first}\n"
        "Pipeline parallelism needs one graph of the forward. Common causes and fixes:\n"
        "  - Python control flow on tensor values (`if x.sum() > 0`, `.item()`, `.tolist()`): "
        "compute the condition outside the model or use torch.cond;\n"
        "  - inputs that are not tensors, lists, tuples or dicts: pass tensors or register the "
        "type with torch.utils._pytree;\n"
        "  - calls into C extensions or numpy on activations: keep them out of forward.\n"
        "Where the stages split is separate from capture: with auto_partition=False, "
        "`with smp.partition(i):` or smp.set_partition(module, i) marks the split points, but the "
        "forward must still be capturable. With pipeline_parallel_degree=1 and tensor_parallel_degree=1 no "
        "capture is needed."
    )
