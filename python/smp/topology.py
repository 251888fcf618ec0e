"""Rank layout: which global rank holds which pipeline stage, tensor shard and data replica.

Pure arithmetic, no processes, so every layout can be checked exhaustively.

Four axes: P (pipeline stage, size pp), T (tensor-parallel shard, size tp), C (context-parallel
rank, size cp: a slice of every sequence) and D (reduced-data-parallel replica, size
rdp = world / (pp * tp * cp)). The placement order is a permutation of "DPT"; the rightmost
letter varies fastest over consecutive ranks, so "DPT" (SMP's "cluster") puts the ranks of one TP
group next to each other, inside a node. C always sits right after D (the ranks of one replica's
cp group are consecutive replicas of D x C): with cp = 1 every layout is SMP v1's.

Derived groups, as in SMP v1 (the TP group belongs to both the model-parallel and the
data-parallel group):
- PP_GROUP: same (D, T), all stages;        TP_GROUP: same (D, P), all shards;
- RDP_GROUP: same (P, T), all replicas;      DP_GROUP: same P: all (D, T), size tp * rdp;
- MP_GROUP: same (D, C): all (P, T), size pp * tp;  WORLD: everyone;
- CP_GROUP: same (D, P, T), all C: the ranks that cut one batch's sequences between them.
RDP_GROUP and DP_GROUP keep their SMP v1 meaning, the data replicas: cp ranks share their index
(they read the same batch). A cp group's ranks hold the same parameters, so the groups that
average gradients and shard parameters or optimizer state span C too: RDP_CP_GROUP (same (P, T):
all (D, C), size rdp * cp) and DP_CP_GROUP (same P: all (D, C, T)); with cp = 1 they are RDP_GROUP
and DP_GROUP.
Sharded data parallelism (sdp, dividing rdp) cuts each RDP_CP_GROUP into blocks of sdp consecutive
replicas with all their cp ranks (FSDP2 over the data x context mesh, as torchtitan does):
SDP_GROUP is one block (the sdp * cp ranks a parameter is sharded over; one rank without sdp),
SDP_REPLICA_GROUP the ranks holding the same shard in every block (the hybrid-sharding replicas).
With R = D * cp + C, R = block * sdp * cp + i.
Expert parallelism (ep, dividing rdp) cuts each RDP_GROUP into blocks of ep consecutive replicas:
EP_GROUP is one block (the ranks holding disjoint sets of experts, between which tokens travel),
EP_REPLICA_GROUP the ranks at the same place in every block (they hold the same experts), and
EP_HOLDERS_GROUP those with their tp ranks (under tp each expert is whole on every rank of a tp
group, each rank running it on its part of the group's tokens).
Within a group, a rank's index is its position among the group's ranks in ascending order.
"""

from __future__ import annotations

import dataclasses
import enum
import functools


class CommGroup(enum.Enum):
    WORLD = "world"
    PP_GROUP = "pp"
    TP_GROUP = "tp"
    DP_GROUP = "dp"
    RDP_GROUP = "rdp"
    MP_GROUP = "mp"
    SDP_GROUP = "sdp"
    SDP_REPLICA_GROUP = "sdp_replica"
    EP_GROUP = "ep"
    EP_REPLICA_GROUP = "ep_replica"
    EP_HOLDERS_GROUP = "ep_holders"
    CP_GROUP = "cp"
    RDP_CP_GROUP = "rdp_cp"
    DP_CP_GROUP = "dp_cp"


class RankType(enum.Enum):
    """The rank space a peer is named in (SMP v1 had all six; its docs list three)."""

    WORLD_RANK = CommGroup.WORLD
    MP_RANK = CommGroup.MP_GROUP
    DP_RANK = CommGroup.DP_GROUP
    PP_RANK = CommGroup.PP_GROUP
    TP_RANK = CommGroup.TP_GROUP
    RDP_RANK = CommGroup.RDP_GROUP
    SDP_RANK = CommGroup.SDP_GROUP
    CP_RANK = CommGroup.CP_GROUP


# The axes each group varies over; a group is all ranks agreeing on the other axes.
_VARYING = {
    CommGroup.WORLD: "DCPT",
    CommGroup.PP_GROUP: "P",
    CommGroup.TP_GROUP: "T",
    CommGroup.RDP_GROUP: "D",
    CommGroup.DP_GROUP: "DT",
    CommGroup.MP_GROUP: "PT",
    CommGroup.SDP_GROUP: "DC",  # part of D x C: R % (sdp * cp) varies (see _key)
    CommGroup.SDP_REPLICA_GROUP: "DC",  # part of D x C: R // (sdp * cp) varies
    CommGroup.CP_GROUP: "C",
    CommGroup.RDP_CP_GROUP: "DC",
    CommGroup.DP_CP_GROUP: "DCT",
    CommGroup.EP_GROUP: "D",  # part of D: D // ep agrees (see _key)
    CommGroup.EP_REPLICA_GROUP: "D",  # part of D: D % ep agrees
    CommGroup.EP_HOLDERS_GROUP: "DT",  # part of D (D % ep agrees), all T
}


def _key(kind: CommGroup, c: dict[str, int], t: Topology) -> tuple[int, ...]:
    """What the ranks of one group of this kind agree on."""
    if kind in (CommGroup.SDP_GROUP, CommGroup.SDP_REPLICA_GROUP):
        replica = c["D"] * t.cp + c["C"]  # sdp blocks take their replicas' cp ranks with them
        part = replica // t.sdp_block if kind is CommGroup.SDP_GROUP else replica % t.sdp_block
        return (c["P"], c["T"], part)
    if kind in (CommGroup.EP_GROUP, CommGroup.EP_REPLICA_GROUP):
        part = c["D"] // t.ep if kind is CommGroup.EP_GROUP else c["D"] % t.ep
        return (c["C"], c["P"], c["T"], part)
    if kind is CommGroup.EP_HOLDERS_GROUP:
        return (c["C"], c["P"], c["D"] % t.ep)
    return tuple(c[a] for a in "DCPT" if a not in _VARYING[kind])


@dataclasses.dataclass(frozen=True)
class Topology:
    world_size: int
    pp: int
    tp: int
    order: str = "DPT"
    sdp: int = 1  # sharded data parallelism: replicas a parameter is sharded over (divides rdp)
    cp: int = 1  # context parallelism: ranks each holding a slice of every sequence
    ep: int = 1  # expert parallelism: replicas the experts are divided among (divides rdp)

    def __post_init__(self) -> None:
        model = self.pp * self.tp * self.cp
        if min(self.pp, self.tp, self.cp) < 1 or self.world_size % model:
            raise ValueError(
                f"world size {self.world_size} is not divisible by pp ({self.pp}) x tp ({self.tp}) "
                f"x cp ({self.cp})"
            )
        if self.sdp < 1 or self.rdp % self.sdp:
            raise ValueError(
                f"sharded data parallel degree {self.sdp} does not divide the reduced data parallel "
                f"degree {self.rdp} (world {self.world_size} / (pp {self.pp} x tp {self.tp} x cp {self.cp}))"
            )
        if self.ep < 1 or self.rdp % self.ep:
            raise ValueError(
                f"expert parallel degree {self.ep} does not divide the reduced data parallel "
                f"degree {self.rdp} (world {self.world_size} / (pp {self.pp} x tp {self.tp} x cp {self.cp}))"
            )
        if sorted(self.order) != ["D", "P", "T"]:
            raise ValueError(f"placement order must be a permutation of 'DPT', got {self.order!r}")

    @property
    def rdp(self) -> int:
        return self.world_size // (self.pp * self.tp * self.cp)

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        return {"D": self.rdp, "C": self.cp, "P": self.pp, "T": self.tp}

    @property
    def sdp_block(self) -> int:
        """The ranks one parameter is sharded over: sdp data replicas with their cp ranks (without
        sharded data parallelism none: 1)."""
        return self.sdp * self.cp if self.sdp > 1 else 1

    @functools.cached_property
    def axes(self) -> str:
        """The placement order with C right after D: every axis, slowest first."""
        return self.order.replace("D", "DC")

    @functools.cached_property
    def _coords(self) -> list[dict[str, int]]:
        table = []
        for rank in range(self.world_size):
            coords = {}
            for axis in reversed(self.axes):  # rightmost varies fastest
                rank, coords[axis] = divmod(rank, self.sizes[axis])
            table.append(coords)
        return table

    @functools.cached_property
    def _groups(self) -> dict[CommGroup, tuple[list[list[int]], list[int]]]:
        """Per kind: every group (ascending, ordered by first rank), and each rank's group index."""
        table = {}
        for kind in _VARYING:
            by_key: dict[tuple[int, ...], list[int]] = {}
            for rank, c in enumerate(self._coords):
                key = _key(kind, c, self)
                by_key.setdefault(key, []).append(rank)  # ranks arrive ascending
            groups = sorted(by_key.values(), key=lambda g: g[0])
            index = [0] * self.world_size
            for i, group in enumerate(groups):
                for rank in group:
                    index[rank] = i
            table[kind] = (groups, index)
        return table

    def coords(self, rank: int) -> dict[str, int]:
        """(D, C, P, T) coordinates of a global rank."""
        return dict(self._coords[self._checked(rank)])

    def rank_of(self, coords: dict[str, int]) -> int:
        """The global rank at these coordinates (C may be left out: 0)."""
        coords = {"C": 0, **coords}
        rank = 0
        for axis in self.axes:
            rank = rank * self.sizes[axis] + coords[axis]
        return rank

    def group_ranks(self, group: CommGroup, rank: int) -> list[int]:
        """The global ranks of `rank`'s group of this kind, ascending."""
        groups, index = self._groups[group]
        return list(groups[index[self._checked(rank)]])

    def all_groups(self, group: CommGroup) -> list[list[int]]:
        """Every group of this kind, each ascending, ordered by their first rank."""
        return [list(g) for g in self._groups[group][0]]

    def group_rank(self, group: CommGroup, rank: int) -> int:
        groups, index = self._groups[group]
        return groups[index[self._checked(rank)]].index(rank)

    def group_size(self, group: CommGroup) -> int:
        if group is CommGroup.SDP_GROUP:
            return self.sdp_block
        if group is CommGroup.SDP_REPLICA_GROUP:
            return self.rdp * self.cp // self.sdp_block
        if group is CommGroup.EP_GROUP:
            return self.ep
        if group is CommGroup.EP_REPLICA_GROUP:
            return self.rdp // self.ep
        if group is CommGroup.EP_HOLDERS_GROUP:
            return self.rdp // self.ep * self.tp
        size = 1
        for axis in _VARYING[group]:
            size *= self.sizes[axis]
        return size

    def _checked(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        return rank
