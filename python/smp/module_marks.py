"""Marks on modules, set at construction (`with` blocks) or afterwards.

`smp.partition(i)` and `smp.tensor_parallelism()` both mark the modules constructed
inside them. They share one patch of nn.Module.__init__, active while any block is
open, so the two nest in any order.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

_open = threading.local()
_original_init = torch.nn.Module.__init__


def _blocks() -> list[tuple[str, Any]]:
    if not hasattr(_open, "blocks"):
        _open.blocks = []
    return _open.blocks


def _init_with_marks(self, *args, **kwargs):
    marks = dict(_blocks())  # the innermost block of each kind wins
    _original_init(self, *args, **kwargs)
    for attr, value in marks.items():
        object.__setattr__(self, attr, value)


@contextlib.contextmanager
def marking(attr: str, value: Any):
    """Modules constructed inside the block get `attr = value`."""
    blocks = _blocks()
    if not blocks:
        torch.nn.Module.__init__ = _init_with_marks
    blocks.append((attr, value))
    try:
        yield
    finally:
        blocks.pop()
        if not blocks:
            torch.nn.Module.__init__ = _original_init


def mark(module: torch.nn.Module, attr: str, value: Any, recurse: bool, overwrite: bool) -> None:
    """Marks `module` and, with recurse, its submodules (all, or only unmarked ones)."""
    object.__setattr__(module, attr, value)
    if recurse:
        for sub in module.modules():
            if overwrite or getattr(sub, attr, None) is None:
                object.__setattr__(sub, attr, value)


def marked(root: torch.nn.Module, attr: str) -> dict[str, Any]:
    """Module path -> value for every module of `root` that carries the mark."""
    return {
        path: getattr(m, attr)
        for path, m in root.named_modules(remove_duplicate=False)
        if getattr(m, attr, None) is not None
    }
