"""Small torch.fx helpers that several passes share: which nodes compute, which modules a node
runs in, how a get_attr target resolves, and the tensors inside a node's value."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

# Node kinds that run code (the rest are placeholders, get_attr and the output).
COMPUTE_OPS = ("call_function", "call_module", "call_method")


def module_stack(node: fx.Node) -> list[str]:
    """The paths of the modules a node runs in, outermost first, without the root."""
    return [path for path, _ in (node.meta.get("nn_module_stack") or {}).values() if path]


def parent_path(path: str) -> str:
    """The path of the module that holds `path` ("" for a child of the root)."""
    return path.rsplit(".", 1)[0] if "." in path else ""


def fetch_attr(module: nn.Module, target: str) -> Any:
    """What a get_attr node with this dotted target reads from `module`."""
    return functools.reduce(getattr, target.split("."), module)


def attr_inputs(node: fx.Node) -> list[fx.Node]:
    """The parameters, buffers and constants a node reads directly (its get_attr inputs)."""
    return [a for a in node.all_input_nodes if a.op == "get_attr"]


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in a node's value (a tensor, or a tuple/list/dict holding some)."""
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def bound_args(node: fx.Node) -> dict[str, Any]:
    """An ATen call's arguments by schema name, defaults filled in, however the graph passed them."""
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound
