"""The process's parallel state: smp.init, the groups it builds, and SMP v1's rank and group helpers.

`parallel_groups()` hands the groups to the engine as one explicit value; the rank
helpers (`smp.pp_rank()`, ...) are the public API over the same state.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from smp import config as config_lib
from smp._backend import BACKEND_NAME
from smp.topology import CommGroup, Topology

if TYPE_CHECKING:
    from smp.model import DistributedModel


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
    # The script's smp.DistributedModel (SMP v1 allows one per process): how @smp.step and
    # smp.DistributedOptimizer, whose SMP signatures name no model, find it.
    model: DistributedModel | None = None


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the layout and the process groups the engine works over."""

    rank: int
    topology: Topology
    pp_rank: int
    tp_rank: int
    rdp_rank: int
    pp: dist.ProcessGroup
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    rdp: dist.ProcessGroup
    pp_ranks: tuple[int, ...]
    tp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    rdp_ranks: tuple[int, ...]

    @property
    def pp_size(self) -> int:
        return len(self.pp_ranks)

    @property
    def tp_size(self) -> int:
        return len(self.tp_ranks)

    @property
    def rdp_size(self) -> int:
        return len(self.rdp_ranks)


_state: _State | None = None


def init(config: Mapping[str, Any] | None = None) -> None:
    """Validates the config, initializes torch.distributed (backend "smp") if needed, builds the groups.

    Under torchrun the process group comes from env://. Started as a plain single
    process (no RANK in the environment), smp runs as a world of one.
    """
    global _state
    cfg = config_lib.parse(config)
    if _state is not None:
        if cfg != _state.config:
            raise RuntimeError(
                "smp.init() was already called with a different config; call it once per process"
            )
        return
    _init_process_group()
    world_size, rank = dist.get_world_size(), dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    cfg.check_world(world_size, local_size)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    topology = Topology(
        world_size, cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree, cfg.placement_order
    )
    groups = {CommGroup.WORLD: dist.group.WORLD}
    for kind in CommGroup:
        if kind is not CommGroup.WORLD:
            groups[kind] = _new_groups(topology, kind, rank)
    messaging = dist.new_group(list(range(world_size)), backend=BACKEND_NAME)
    _state = _State(cfg, topology, rank, local_rank, local_size, groups, messaging)


def _init_process_group() -> None:
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
    dist.init_process_group(backend=BACKEND_NAME)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _new_groups(topology: Topology, kind: CommGroup, rank: int) -> dist.ProcessGroup:
    """Creates every group of this kind (a collective call: every rank creates all) and returns ours."""
    mine = None
    for ranks in topology.all_groups(kind):
        group = dist.new_group(ranks, backend=BACKEND_NAME)
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
    s = state()
    ranks = {kind: tuple(s.topology.group_ranks(kind, s.rank)) for kind in CommGroup}
    return ParallelGroups(
        rank=s.rank,
        topology=s.topology,
        pp_rank=s.topology.group_rank(CommGroup.PP_GROUP, s.rank),
        tp_rank=s.topology.group_rank(CommGroup.TP_GROUP, s.rank),
        rdp_rank=s.topology.group_rank(CommGroup.RDP_GROUP, s.rank),
        pp=s.process_groups[CommGroup.PP_GROUP],
        tp=s.process_groups[CommGroup.TP_GROUP],
        dp=s.process_groups[CommGroup.DP_GROUP],
        rdp=s.process_groups[CommGroup.RDP_GROUP],
        pp_ranks=ranks[CommGroup.PP_GROUP],
        tp_ranks=ranks[CommGroup.TP_GROUP],
        dp_ranks=ranks[CommGroup.DP_GROUP],
        rdp_ranks=ranks[CommGroup.RDP_GROUP],
    )


def reset() -> None:
    """Forgets smp's state so smp.init can run again, with another config, in this process.

    Destroys the groups smp created (a collective: call it on every rank); the default
    process group stays.
    """
    global _state
    if _state is None:
        return
    groups = [g for kind, g in _state.process_groups.items() if kind is not CommGroup.WORLD]
    for group in dict.fromkeys(groups + [_state.messaging_group]):
        dist.destroy_process_group(group)
    _state = None


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
