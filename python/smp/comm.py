"""SMP v1's object messaging and barriers.

Objects are pickled and travel as CPU byte tensors over smp's own world group (so
they never interleave with the user's point-to-point traffic); every call is
synchronous, as in SMP v1.
- broadcast(obj, group): send obj to every other member of `group`; each of them
  receives it with recv_from(sender, rank_type).
- send(obj, dest_rank, rank_type) / recv_from(src_rank, rank_type): one object,
  with the peer named in the rank space of `rank_type` (a rank of my MP, DP, PP, TP or
  RDP group, or a global rank).
- allgather(obj, group): every member's object, in group-rank order.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from smp import faults, parallel_state
from smp.topology import CommGroup, RankType


def _check_group(group: Any) -> CommGroup:
    if not isinstance(group, CommGroup):
        raise ValueError(
            f"expected an smp.CommGroup such as smp.WORLD, smp.TP_GROUP or smp.DP_GROUP, got {group!r}"
        )
    return group


def _global_rank(peer: int, rank_type: Any, role: str) -> int:
    if not isinstance(rank_type, RankType):
        raise ValueError(
            f"expected an smp.RankType ({', '.join(t.name for t in RankType)}) for the {role}, "
            f"got {rank_type!r}"
        )
    ranks = parallel_state.state().topology.group_ranks(rank_type.value, parallel_state.rank())
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < len(ranks):
        raise ValueError(
            f"{role} {peer!r} is not a valid {rank_type.name}: this rank's {rank_type.value.name} "
            f"has ranks 0..{len(ranks) - 1}"
        )
    if ranks[peer] == parallel_state.rank():
        raise ValueError(
            f"{role} {peer} ({rank_type.name}) is this rank itself; an object cannot go to itself"
        )
    return ranks[peer]


def _send_bytes(payload: bytes, dst: int) -> None:
    group = parallel_state.state().messaging_group
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    with faults.waiting("smp.send of an object", faults.group_of("messaging", group), dst):
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst, group=group)
        dist.send(data, dst=dst, group=group)


def _recv_bytes(src: int) -> bytes:
    group = parallel_state.state().messaging_group
    length = torch.empty(1, dtype=torch.int64)
    with faults.waiting("smp.recv_from of an object", faults.group_of("messaging", group), src):
        dist.recv(length, src=src, group=group)
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(data, src=src, group=group)
    return data.numpy().tobytes()


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    _send_bytes(pickle.dumps(obj), _global_rank(dest_rank, rank_type, "dest_rank"))


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    return pickle.loads(_recv_bytes(_global_rank(src_rank, rank_type, "src_rank")))


def broadcast(obj: Any, group: CommGroup) -> None:
    payload = pickle.dumps(obj)
    for dst in parallel_state.state().topology.group_ranks(_check_group(group), parallel_state.rank()):
        if dst != parallel_state.rank():
            _send_bytes(payload, dst)


def allgather(obj: Any, group: CommGroup) -> list[Any]:
    pg = parallel_state.process_group(group)
    out: list[Any] = [None] * dist.get_world_size(pg)
    with faults.waiting("smp.allgather", faults.group_of(group.name, pg)):
        dist.all_gather_object(out, obj, group=pg)
    return out


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    pg = parallel_state.process_group(group)
    with faults.waiting("smp.barrier", faults.group_of(_check_group(group).name, pg)):
        dist.barrier(group=pg)


def dp_barrier() -> None:
    barrier(CommGroup.DP_GROUP)


def mp_barrier() -> None:
    barrier(CommGroup.MP_GROUP)


def pp_barrier() -> None:
    barrier(CommGroup.PP_GROUP)


def tp_barrier() -> None:
    barrier(CommGroup.TP_GROUP)


def rdp_barrier() -> None:
    barrier(CommGroup.RDP_GROUP)
