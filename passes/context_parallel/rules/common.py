"""What the rules share: fake values and tensor inputs of a node."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

# Ops that only check a value's metadata: neither users of it nor work to rewrite.
CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)


def val(node: Any) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if val(n) is not None]


def dim_of(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim
