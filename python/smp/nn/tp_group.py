"""The tensor-parallel group the smp.nn modules shard over, and the divisibility checks.

Before `smp.init` (or with tensor_parallel_degree 1) there is no group: the modules then hold
whole weights and run the dense torch functions, so at tp=1 each equals its dense counterpart.
"""

from __future__ import annotations

import torch.distributed as dist

from smp import parallel_state


def tp_group() -> dist.ProcessGroup | None:
    """smp's tensor-parallel process group, or None when there is nothing to shard over."""
    if not parallel_state.is_initialized() or parallel_state.tp_size() == 1:
        return None
    return parallel_state.get_tp_process_group()


def tp_rank() -> int:
    return parallel_state.tp_rank() if tp_group() is not None else 0


def tp_size() -> int:
    return parallel_state.tp_size() if tp_group() is not None else 1


def divide(module: str, name: str, value: int, size: int | None = None) -> int:
    """value // size, or a ValueError naming the argument when it does not divide."""
    size = tp_size() if size is None else size
    if value % size:
        raise ValueError(
            f"smp.nn.{module}: {name}={value} does not divide by the tensor-parallel degree {size}; "
            f"choose a {name} that is a multiple of {size}, or a tensor_parallel_degree that divides {value}"
        )
    return value // size
