"""Which device each process uses, decided in smp.init for any script.

One process per GPU is the plain case: local rank i uses cuda:i. With more processes on a host
than GPUs (the README's first command, 4 processes, on a machine with one GPU), NCCL refuses two
ranks of one host on one GPU ("Duplicate GPU detected") at its first CUDA collective. smp then runs
the job with the processes sharing the GPUs, local rank i on cuda:(i % GPUs), and says so in one
line: each process tells NCCL it is a host of its own (NCCL_HOSTID) and NCCL's intra-host
transports are off (NCCL_P2P_DISABLE, NCCL_SHM_DISABLE), so NCCL between the processes goes
through its network transport. Several ranks shared one H200 that way in issue 31 (pipelines, and
the NCCL throttle under real concurrency); it is slower than one process per GPU.

Running on the CPU instead cannot be decided here: a script picks its tensors' device itself
(`torch.cuda.is_available()`), and hiding the GPUs (CUDA_VISIBLE_DEVICES) once CUDA has started
has no effect. The warning names both ways out: fewer processes, or CUDA_VISIBLE_DEVICES="" for a
job of CPU processes.

When: smp.init sets the variables before any NCCL communicator exists. torch forms a group's
communicator at its first CUDA collective (lazily; at once only for a group given a `device_id`,
which smp never passes), NCCL reads the variables then, and smp.init runs no CUDA collective.
A variable the user set stays as it is.

Which processes share a GPU: without CUDA_VISIBLE_DEVICES every process of a host sees the same
GPUs, so the counts decide. With it, the launcher chose what each process sees (often one GPU
each, different ones; or one GPU for the whole job): the processes of a host then count, through
the job's store, how many of them use each physical GPU.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist

# What NCCL needs to run several ranks of one host on one GPU, besides a NCCL_HOSTID per process.
_SHARING_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}

_rounds = 0  # place() calls in this process: every rank calls smp.init alike, so they agree


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where this process runs: cuda_index None means the CPU (no GPU visible); shared: other
    processes of this host use the same GPU. env: the variables to set before NCCL starts (those
    the user did not set); warning: one line for the user (from local rank 0 only), or None."""

    cuda_index: int | None
    shared: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    warning: str | None = None


def must_count_peers(local_size: int, device_count: int, env: Mapping[str, str]) -> bool:
    """Whether the processes must compare their GPUs to know if they share one: only when
    CUDA_VISIBLE_DEVICES makes what each sees its own, and there are fewer GPUs than processes."""
    return 0 < device_count < local_size and bool(env.get("CUDA_VISIBLE_DEVICES", "").strip())


def decide(
    local_rank: int,
    local_size: int,
    device_count: int,
    env: Mapping[str, str],
    host: str = "",
    gpu_peers: int | None = None,
) -> Placement:
    """The placement of local rank `local_rank` of `local_size` processes on `host`, where this
    process sees `device_count` GPUs. gpu_peers: how many of the host's processes use this one's
    GPU, this one included (counted when must_count_peers(); else None and inferred from the
    counts). Plain values, no side effects: place() applies the result."""
    if device_count <= 0:
        return Placement(None)
    index = local_rank % device_count
    if gpu_peers is None and not must_count_peers(local_size, device_count, env):
        # Every process of the host sees the same GPUs: local ranks index, index + count, ... use it.
        gpu_peers = len(range(index, local_size, device_count))
    if gpu_peers is None or gpu_peers <= 1:
        return Placement(index)
    wanted = {"NCCL_HOSTID": f"{host or 'host'}-smp-local-rank-{local_rank}", **_SHARING_ENV}
    warning = None
    if local_rank == 0:  # one line per host, not one per process
        warning = (
            f"smp: {local_size} processes run on this host's GPUs, {gpu_peers} of them on local rank "
            f"0's (cuda:{index}); NCCL between them goes through its network transport (NCCL_HOSTID "
            "per process, NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1), slower than one process per GPU: "
            "launch one process per GPU (torchrun --nproc_per_node=<GPUs per host>) for that, or set "
            'CUDA_VISIBLE_DEVICES="" to run on CPU processes'
        )
    return Placement(index, True, {k: v for k, v in wanted.items() if k not in env}, warning)


def count_gpu_peers(store: dist.Store, key: str, local_size: int, gpu: str) -> int:
    """How many of a host's `local_size` processes use GPU `gpu` (an id of the physical device),
    this one included. Every process of the host calls it, with the same `key`."""
    store.add(f"{key}/gpu/{gpu}", 1)
    if store.add(f"{key}/arrived", 1) == local_size:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"])
    return store.add(f"{key}/gpu/{gpu}", 0)


def place(local_rank: int, local_size: int) -> Placement:
    """Decides this process's placement and applies it: the NCCL variables, the current CUDA
    device, the warning. smp.init calls it after creating the default group (whose store counts
    GPU peers when needed) and before any NCCL communicator exists."""
    global _rounds
    _rounds += 1
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    host = socket.gethostname()
    peers = None
    if must_count_peers(local_size, count, os.environ):
        gpu = str(torch.cuda.get_device_properties(local_rank % count).uuid)  # the physical device
        store = dist.distributed_c10d._get_default_store()
        peers = count_gpu_peers(store, f"smp/devices/{_rounds}/{host}", local_size, gpu)
    placement = decide(local_rank, local_size, count, os.environ, host, peers)
    os.environ.update(placement.env)
    if placement.cuda_index is not None:
        torch.cuda.set_device(placement.cuda_index)
    if placement.warning:
        warnings.warn(placement.warning, stacklevel=3)
    return placement
