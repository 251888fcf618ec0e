"""Manual partitioning: `with smp.partition(i):` and `smp.set_partition(module, i)`.

Used when the config sets auto_partition=False; modules without a partition go to
`default_partition`. The innermost assigned module of an operation decides its stage.
"""

from __future__ import annotations

import contextlib

import torch

from smp import module_marks

_ATTR = "_smp_partition"


@contextlib.contextmanager
def partition(index: int):
    """Modules constructed inside this block go to pipeline partition `index` (innermost block wins)."""
    _check_index(index)
    with module_marks.marking(_ATTR, index):
        yield


def set_partition(module: torch.nn.Module, index: int, recurse: bool = True) -> None:
    """Puts `module` (and, with recurse, the submodules that have no partition yet) on partition `index`."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"smp.set_partition expects an nn.Module, got {type(module).__name__}")
    _check_index(index)
    module_marks.mark(module, _ATTR, index, recurse, overwrite=False)


def module_partitions(root: torch.nn.Module) -> dict[str, int]:
    """Module path -> partition for every module of `root` that has one."""
    return module_marks.marked(root, _ATTR)


def _check_index(index) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"smp: a partition index must be an int >= 0, got {index!r}")
