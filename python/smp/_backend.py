"""The "smp" c10d backend: registration with torch.distributed and statistics.

The C++ SmpBackend (backend/) routes each call by tensor device: CPU tensors to
torch's Gloo backend, CUDA tensors to torch's NCCL backend. This module builds
those two inner backends over the group's store and hands them to it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

import smp._C as _C
from smp import attempt

BACKEND_NAME = "smp"

__all__ = ["BACKEND_NAME", "backend_stats", "register"]


def _timeout_seconds(timeout: datetime.timedelta | float) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _create_gloo(store, rank: int, size: int, timeout, opts):
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
    gloo.options.global_ranks_in_group = opts.global_ranks_in_group
    gloo.options.group_name = opts.group_id
    return gloo


def _create_nccl(store, rank: int, size: int, timeout, opts):
    nccl_opts = dist.ProcessGroupNCCL.Options()
    nccl_opts.is_high_priority_stream = False
    nccl_opts._timeout = timeout
    nccl_opts.global_ranks_in_group = opts.global_ranks_in_group
    nccl_opts.group_name = opts.group_id
    return dist.ProcessGroupNCCL(store, rank, size, nccl_opts)


def _cuda_usable() -> bool:
    return torch.cuda.is_available() and dist.is_nccl_available()


def _create_backend(opts, backend_options) -> _C.SmpBackend:
    """Extended-API creator: one SmpBackend serves the group's CPU and CUDA tensors."""
    if backend_options is not None:
        raise ValueError(
            f"the smp backend takes no backend options (got {backend_options!r}); "
            "configure it through SMP_NCCL_THROTTLE_LIMIT and SMP_GLOO_THROTTLE_LIMIT"
        )
    rank, size, timeout = opts.group_rank, opts.group_size, opts.timeout
    # Separate key spaces: Gloo and NCCL both rendezvous over this store, under this attempt's
    # prefix (a store torchrun keeps across restarts still holds the dead attempt's addresses).
    base = attempt.prefix()
    gloo = _create_gloo(dist.PrefixStore(f"{base}gloo/", opts.store), rank, size, timeout, opts)
    nccl = None
    if _cuda_usable():
        nccl = _create_nccl(dist.PrefixStore(f"{base}nccl/", opts.store), rank, size, timeout, opts)
    return _C.SmpBackend(
        rank=rank,
        size=size,
        cpu=gloo,
        cuda=nccl,
        group_name=str(opts.group_id),
        timeout_seconds=_timeout_seconds(timeout),
    )


def register() -> None:
    """Registers "smp" so init_process_group/new_group(backend="smp") work."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])


def _smp_backend_of(group) -> _C.SmpBackend:
    if not dist.is_initialized():
        raise RuntimeError(
            "smp.backend_stats() needs torch.distributed to be initialized: call "
            "smp.init() or torch.distributed.init_process_group(backend='smp') first"
        )
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.SmpBackend):
        name = dist.get_backend(pg)
        raise ValueError(
            f"process group {pg.group_name!r} uses backend {name!r}, not 'smp'; create it "
            "with init_process_group(backend='smp') or new_group(ranks, backend='smp')"
        )
    return backend


def backend_stats(group=None) -> dict[str, dict[str, float]]:
    """Per-device throttle statistics of a process group of the smp backend.

    Returns {"cpu": {...}, "cuda": {...}} ("cuda" only where the group has an
    NCCL backend), each with: limit (-1 = off), launched, outstanding,
    peak_outstanding, throttle_waits, seconds_blocked.
    """
    backend = _smp_backend_of(group)
    stats = {"cpu": backend.stats("cpu")}
    if backend.has_cuda:
        stats["cuda"] = backend.stats("cuda")
    return stats
