"""Manual partitioning: `with smp.partition(i):` and `smp.set_partition(module, i)`.

Used when the config sets auto_partition=False; modules without a partition go to
`default_partition`. The innermost assigned module of an operation decides its stage.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_ATTR = "_smp_partition"
_stack = threading.local()


def _current() -> list[int]:
    if not hasattr(_stack, "partitions"):
        _stack.partitions = []
    return _stack.partitions


_original_init = torch.nn.Module.__init__


def _init_with_partition(self, *args, **kwargs):
    partitions = _current()
    index = partitions[-1] if partitions else None
    _original_init(self, *args, **kwargs)
    if index is not None:
        object.__setattr__(self, _ATTR, index)


@contextlib.contextmanager
def partition(index: int):
    """Modules constructed inside this block go to pipeline partition `index` (innermost block wins)."""
    _check_index(index)
    partitions = _current()
    if not partitions:
        torch.nn.Module.__init__ = _init_with_partition
    partitions.append(index)
    try:
        yield
    finally:
        partitions.pop()
        if not partitions:
            torch.nn.Module.__init__ = _original_init


def set_partition(module: torch.nn.Module, index: int, recurse: bool = True) -> None:
    """Puts `module` (and, with recurse, the submodules that have no partition yet) on partition `index`."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"smp.set_partition expects an nn.Module, got {type(module).__name__}")
    _check_index(index)
    object.__setattr__(module, _ATTR, index)
    if recurse:
        for sub in module.modules():
            if getattr(sub, _ATTR, None) is None:
                object.__setattr__(sub, _ATTR, index)


def module_partitions(root: torch.nn.Module) -> dict[str, int]:
    """Module path -> partition for every module of `root` that has one."""
    return {
        path: getattr(m, _ATTR)
        for path, m in root.named_modules(remove_duplicate=False)
        if getattr(m, _ATTR, None) is not None
    }


def _check_index(index) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"smp: a partition index must be an int >= 0, got {index!r}")
