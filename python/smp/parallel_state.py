"""The process's parallel state: smp.init, the groups it builds, and SMP v1's rank and group helpers.

`parallel_groups()` hands the groups to the engine as one explicit value; the rank
helpers (`smp.pp_rank()`, ...) are the public API over the same state.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from smp import config as config_lib
from smp import devices, faults
from smp._backend import BACKEND_NAME
from smp.config_options import check_timeout
from smp.groups import ParallelGroups
from smp.services import microbatch, timeline
from smp.state import rank_state
from smp.topology import CommGroup, Topology


@dataclasses.dataclass
class _State:
    config: config_lib.Config
    topology: Topology
    rank: int
    local_rank: int
    local_size: int
    process_groups: dict[CommGroup, dist.ProcessGroup]
    # A world group of its own for object messaging, so it never interleaves with
    # the user's point-to-point traffic on the default group.
    messaging_group: dist.ProcessGroup
    # A world group for checkpoints written by a background thread (created at the first).
    checkpoint_group: dist.ProcessGroup | None = None
    # The script's smp.DistributedModel (SMP v1 allows one per process): how @smp.step and
    # smp.DistributedOptimizer, whose SMP signatures name no model, find it. Typed Any: the
    # model sits above this module, which must not import it.
    model: Any = None


_state: _State | None = None


# The default group timeout. torch's is 30 minutes for Gloo (10 for NCCL): a rank whose peer
# died waits that long before failing, with the whole job's machines idle. Every wait smp adds
# is short when the job is healthy: a stage waits for one microbatch of its neighbour, a replica
# for a gradient bucket, the optimizer for its peers' chunks, all seconds. The long legitimate
# waits are one-off work a rank does alone while the others sit in the next collective: the
# first step's partitioning (every rank traces the model, at different speeds) and a checkpoint
# written by one rank. Five minutes covers those on CPU with room to spare and fails a dead job
# six times sooner than torch's default. With CUDA the groups also carry NCCL, whose first
# collectives build communicators and whose models are larger: there smp keeps torch's NCCL
# default, 10 minutes. Either is a default: set `"timeout"` (seconds) or smp.init(timeout=...).
CPU_DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
CUDA_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def default_timeout() -> datetime.timedelta:
    return CUDA_DEFAULT_TIMEOUT if torch.cuda.is_available() else CPU_DEFAULT_TIMEOUT


def init(config: Mapping[str, Any] | None = None, timeout: datetime.timedelta | None = None) -> None:
    """Validates the config, initializes torch.distributed (backend "smp") if needed, builds the groups.

    Under torchrun the process group comes from env://. Started as a plain single
    process (no RANK in the environment), smp runs as a world of one.

    `timeout` (or the config key "timeout", in seconds) bounds every wait on a peer in the
    groups smp creates, the default group included when smp initializes it: a rank whose peer
    died raises within it instead of hanging. Default: 5 minutes on CPU, 10 with CUDA (see
    CPU_DEFAULT_TIMEOUT for why). A default group the script initialized keeps its own timeout.
    """
    global _state
    cfg = _with_timeout(config_lib.parse(config), timeout)
    if _state is not None:
        if cfg != _state.config:
            raise RuntimeError(
                "smp.init() was already called with a different config; call it once per process"
            )
        return
    group_timeout = group_timeout_of(cfg)
    _init_process_group(group_timeout)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    cfg.check_world(world_size, local_size)
    # The GPU, and NCCL's settings when processes share one, before any NCCL communicator exists.
    devices.place(local_rank, local_size)
    topology = Topology(
        world_size,
        cfg.pipeline_parallel_degree,
        cfg.tensor_parallel_degree,
        cfg.placement_order,
        cfg.sharded_data_parallel_degree,
        ep=cfg.expert_parallel_degree,
        cp=cfg.context_parallel_degree,
    )
    kept = _kept.pop((topology, group_timeout), None)
    groups, messaging = kept if kept is not None else _create_groups(topology, rank, group_timeout)
    _state = _State(cfg, topology, rank, local_rank, local_size, groups, messaging)
    faults.install(rank, group_timeout.total_seconds())
    timeline.start(cfg.timeline, _identity(topology, rank, cfg), messaging)


def _identity(topology: Topology, rank: int, cfg: config_lib.Config) -> dict[str, Any]:
    """How the timeline names this rank: its place in each parallelism (its pipeline stages: one,
    or two under "zero_bubble_v")."""
    pp_rank = topology.group_rank(CommGroup.PP_GROUP, rank)
    return {
        "rank": rank,
        "stages": cfg.schedule().rank_stages(pp_rank),
        "tp": topology.group_rank(CommGroup.TP_GROUP, rank),
        "rdp": topology.group_rank(CommGroup.RDP_GROUP, rank),
        "cp": topology.group_rank(CommGroup.CP_GROUP, rank),
    }


def _create_groups(topology: Topology, rank: int, timeout: datetime.timedelta):
    groups = {CommGroup.WORLD: dist.group.WORLD}
    made: dict[str, CommGroup] = {}  # a kind whose groups equal an earlier kind's shares them
    for kind in CommGroup:
        if kind is CommGroup.WORLD:
            continue
        same = made.setdefault(repr(topology.all_groups(kind)), kind)
        groups[kind] = groups[same] if same is not kind else _new_groups(topology, kind, rank, timeout)
    messaging = dist.new_group(list(range(topology.world_size)), backend=BACKEND_NAME, timeout=timeout)
    return groups, messaging


def _with_timeout(cfg: config_lib.Config, timeout: Any) -> config_lib.Config:
    """The config with smp.init's `timeout` argument in it (the two must agree if both are given)."""
    if timeout is None:
        return cfg
    if not isinstance(timeout, datetime.timedelta):
        raise ValueError(
            f"smp.init: timeout must be a datetime.timedelta, got {timeout!r} ({type(timeout).__name__}); "
            "e.g. smp.init(config, timeout=datetime.timedelta(minutes=5))"
        )
    seconds = check_timeout(timeout.total_seconds(), "smp.init's timeout")
    if cfg.timeout is not None and cfg.timeout != seconds:
        raise ValueError(
            f"smp.init: timeout={timeout} disagrees with the config's 'timeout' ({cfg.timeout} s); "
            "set only one of them"
        )
    return dataclasses.replace(cfg, timeout=seconds)


def group_timeout_of(cfg: config_lib.Config) -> datetime.timedelta:
    if cfg.timeout is None:
        return default_timeout()
    return datetime.timedelta(seconds=cfg.timeout)


def _init_process_group(timeout: datetime.timedelta) -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        # Plain `python script.py`: a world of one over a free local port.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    dist.init_process_group(backend=BACKEND_NAME, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _new_groups(
    topology: Topology, kind: CommGroup, rank: int, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    """Creates every group of this kind (a collective call: every rank creates all) and returns ours."""
    mine = None
    for ranks in topology.all_groups(kind):
        group = dist.new_group(ranks, backend=BACKEND_NAME, timeout=timeout)
        if rank in ranks:
            mine = group
    assert mine is not None
    return mine


def is_initialized() -> bool:
    return _state is not None


def state() -> _State:
    if _state is None:
        raise RuntimeError("smp is not initialized: call smp.init(config) first")
    return _state


def parallel_groups() -> ParallelGroups:
    """The engine's groups. Its replicas are the ranks holding the same parameters: the data
    replicas and, with context parallelism, their cp ranks too (RDP_CP_GROUP, DP_CP_GROUP), over
    which gradients are averaged and parameters or optimizer state sharded."""
    s = state()
    ranks = {kind: tuple(s.topology.group_ranks(kind, s.rank)) for kind in CommGroup}
    return ParallelGroups(
        rank=s.rank,
        topology=s.topology,
        pp_rank=s.topology.group_rank(CommGroup.PP_GROUP, s.rank),
        tp_rank=s.topology.group_rank(CommGroup.TP_GROUP, s.rank),
        rdp_rank=s.topology.group_rank(CommGroup.RDP_CP_GROUP, s.rank),
        pp=s.process_groups[CommGroup.PP_GROUP],
        tp=s.process_groups[CommGroup.TP_GROUP],
        dp=s.process_groups[CommGroup.DP_CP_GROUP],
        rdp=s.process_groups[CommGroup.RDP_CP_GROUP],
        pp_ranks=ranks[CommGroup.PP_GROUP],
        tp_ranks=ranks[CommGroup.TP_GROUP],
        dp_ranks=ranks[CommGroup.DP_CP_GROUP],
        rdp_ranks=ranks[CommGroup.RDP_CP_GROUP],
        sdp=s.process_groups[CommGroup.SDP_GROUP],
        sdp_replica=s.process_groups[CommGroup.SDP_REPLICA_GROUP],
        sdp_ranks=ranks[CommGroup.SDP_GROUP],
        sdp_replica_ranks=ranks[CommGroup.SDP_REPLICA_GROUP],
        ep=s.process_groups[CommGroup.EP_GROUP],
        ep_replica=s.process_groups[CommGroup.EP_REPLICA_GROUP],
        ep_ranks=ranks[CommGroup.EP_GROUP],
        ep_replica_ranks=ranks[CommGroup.EP_REPLICA_GROUP],
        ep_holders=s.process_groups[CommGroup.EP_HOLDERS_GROUP],
        ep_holders_ranks=ranks[CommGroup.EP_HOLDERS_GROUP],
        cp=s.process_groups[CommGroup.CP_GROUP],
        cp_ranks=ranks[CommGroup.CP_GROUP],
        cp_rank=s.topology.group_rank(CommGroup.CP_GROUP, s.rank),
    )


# Groups a reset(keep_groups=True) left for the next smp.init of the same layout and timeout.
_kept: dict[tuple[Topology, datetime.timedelta], tuple[dict, dist.ProcessGroup]] = {}


def reset(keep_groups: bool = False) -> None:
    """Forgets smp's state so smp.init can run again, with another config, in this process.

    Destroys the groups smp created (a collective: call it on every rank); the default
    process group stays. With keep_groups, they are kept instead, for a later smp.init with the
    same layout and timeout (destroying and creating them dominates an init: docs/benchmarks.md,
    "Costs the code's choices rest on"; tests that initialize thousands of times keep them).
    """
    global _state
    if _state is None:
        return
    if _state.checkpoint_group is not None:
        dist.destroy_process_group(_state.checkpoint_group)
    timeline.stop()
    rank_state.forget()
    if keep_groups:
        key = (_state.topology, group_timeout_of(_state.config))
        _kept[key] = (_state.process_groups, _state.messaging_group)
        _state = None
        return
    kept = [(g, m) for g, m in _kept.values()]
    _kept.clear()
    _forget_dtensor_layouts()
    microbatch.retire_threads()  # (their thread-local DTensor caches too)
    for groups, messaging in [(_state.process_groups, _state.messaging_group), *kept]:
        mine = [g for kind, g in groups.items() if kind is not CommGroup.WORLD]
        for group in dict.fromkeys([*mine, messaging]):
            dist.destroy_process_group(group)
    _state = None


def _forget_dtensor_layouts() -> None:
    """DTensor caches each op's output layout by its inputs' meshes, which compare equal across
    groups of the same ranks; a cached layout would name a group destroyed here (sharded data
    parallelism's DTensors, in a process that initializes smp again)."""
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()


# --- ranks and groups ----------------------------------------------------------


def rank() -> int:
    return state().rank


def size() -> int:
    return state().topology.world_size


def local_rank() -> int:
    return state().local_rank


def local_size() -> int:
    return state().local_size


def num_microbatches() -> int:
    return state().config.microbatches


def checkpoint_group() -> dist.ProcessGroup:
    """A world group of its own for checkpoints written by a background thread, so that their
    collectives never interleave with the training's. Created at the first call: a collective,
    which every rank makes at its first background save."""
    current = state()
    if current.checkpoint_group is None:
        ranks = list(range(current.topology.world_size))
        timeout = group_timeout_of(current.config)
        current.checkpoint_group = dist.new_group(ranks, backend=BACKEND_NAME, timeout=timeout)
    return current.checkpoint_group


def process_group(kind: CommGroup) -> dist.ProcessGroup:
    """The torch process group of this rank's group of that kind (backend "smp")."""
    if not isinstance(kind, CommGroup):
        raise ValueError(f"expected an smp.CommGroup (e.g. smp.TP_GROUP), got {kind!r}")
    return state().process_groups[kind]


def get_world_process_group() -> dist.ProcessGroup:
    return process_group(CommGroup.WORLD)


def _helpers(kind: CommGroup, name: str):
    """SMP v1's helpers of one group kind: {name}_rank, {name}_size, get_{name}_group and
    get_{name}_process_group."""

    def group_rank() -> int:
        s = state()
        return s.topology.group_rank(kind, s.rank)

    def group_size() -> int:
        return state().topology.group_size(kind)

    def group_ranks() -> list[int]:
        s = state()
        return s.topology.group_ranks(kind, s.rank)

    def torch_group() -> dist.ProcessGroup:
        return process_group(kind)

    helpers = (group_rank, group_size, group_ranks, torch_group)
    names = (f"{name}_rank", f"{name}_size", f"get_{name}_group", f"get_{name}_process_group")
    docs = (
        f"This rank's index in its {kind.name} (position among the group's ranks, ascending).",
        f"The number of ranks in a {kind.name}.",
        f"The global ranks of this rank's {kind.name}, ascending.",
        f"The torch process group of this rank's {kind.name}.",
    )
    for fn, fn_name, doc in zip(helpers, names, docs, strict=True):
        fn.__name__ = fn.__qualname__ = fn_name
        fn.__doc__ = doc
    return helpers


pp_rank, pp_size, get_pp_group, get_pp_process_group = _helpers(CommGroup.PP_GROUP, "pp")
tp_rank, tp_size, get_tp_group, get_tp_process_group = _helpers(CommGroup.TP_GROUP, "tp")
dp_rank, dp_size, get_dp_group, get_dp_process_group = _helpers(CommGroup.DP_GROUP, "dp")
rdp_rank, rdp_size, get_rdp_group, get_rdp_process_group = _helpers(CommGroup.RDP_GROUP, "rdp")
mp_rank, mp_size, get_mp_group, get_mp_process_group = _helpers(CommGroup.MP_GROUP, "mp")
sdp_rank, sdp_size, get_sdp_group, get_sdp_process_group = _helpers(CommGroup.SDP_GROUP, "sdp")
ep_rank, ep_size, get_ep_group, get_ep_process_group = _helpers(CommGroup.EP_GROUP, "ep")
cp_rank, cp_size, get_cp_group, get_cp_process_group = _helpers(CommGroup.CP_GROUP, "cp")
