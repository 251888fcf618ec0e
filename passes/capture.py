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

    def flatten_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
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
    gm = program.module()
    _drop_guard_calls(gm)
    # Replace the pytree calling convention with a flat one: stages are built
    # from this graph and exchange flat values.
    gm.graph._codegen = fx.graph.CodeGen()
    gm.recompile()
    in_spec = program.call_spec.in_spec
    leaves, _ = pytree.tree_flatten((tuple(args), kwargs))
    requires_grad = [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]
    return CapturedGraph(gm, in_spec, program.call_spec.out_spec, requires_grad)


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
        "forward must still be capturable. With pipeline_parallel_degree=1 no capture is needed."
    )
