"""Rank layout: which global rank holds which pipeline stage, tensor shard and data replica.

Pure arithmetic, no processes, so every layout can be checked exhaustively.

Three axes: P (pipeline stage, size pp), T (tensor-parallel shard, size tp) and D
(reduced-data-parallel replica, size rdp = world / (pp * tp)). The placement order is
a permutation of "DPT"; the rightmost letter varies fastest over consecutive ranks, so
"DPT" (SMP's "cluster") puts the ranks of one TP group next to each other, inside a node.

Derived groups, as in SMP v1 (the TP group belongs to both the model-parallel and the
data-parallel group):
- PP_GROUP: same (D, T), all stages;        TP_GROUP: same (D, P), all shards;
- RDP_GROUP: same (P, T), all replicas;      DP_GROUP: same P: all (D, T), size tp * rdp;
- MP_GROUP: same D: all (P, T), size pp * tp;  WORLD: everyone.
Sharded data parallelism (sdp, dividing rdp) cuts each RDP_GROUP into blocks of sdp consecutive
replicas: SDP_GROUP is one block (the ranks a parameter is sharded over), SDP_REPLICA_GROUP the
ranks holding the same shard in every block (the hybrid-sharding replicas). D = block * sdp + i.
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


class RankType(enum.Enum):
    """The rank space a peer is named in (SMP v1 had all six; its docs list three)."""

    WORLD_RANK = CommGroup.WORLD
    MP_RANK = CommGroup.MP_GROUP
    DP_RANK = CommGroup.DP_GROUP
    PP_RANK = CommGroup.PP_GROUP
    TP_RANK = CommGroup.TP_GROUP
    RDP_RANK = CommGroup.RDP_GROUP
    SDP_RANK = CommGroup.SDP_GROUP


# The axes each group varies over; a group is all ranks agreeing on the other axes.
_VARYING = {
    CommGroup.WORLD: "DPT",
    CommGroup.PP_GROUP: "P",
    CommGroup.TP_GROUP: "T",
    CommGroup.RDP_GROUP: "D",
    CommGroup.DP_GROUP: "DT",
    CommGroup.MP_GROUP: "PT",
    CommGroup.SDP_GROUP: "D",  # part of D: D % sdp varies (see _key)
    CommGroup.SDP_REPLICA_GROUP: "D",  # part of D: D // sdp varies
    CommGroup.EP_GROUP: "D",  # part of D: D % ep varies
    CommGroup.EP_REPLICA_GROUP: "D",  # part of D: D // ep varies
}

# Kinds that cut D into blocks of a degree: kind -> (the degree's field, whether the group is one
# block (D // degree agrees) or the same index in every block (D % degree agrees)).
_BLOCKS = {
    CommGroup.SDP_GROUP: ("sdp", True),
    CommGroup.SDP_REPLICA_GROUP: ("sdp", False),
    CommGroup.EP_GROUP: ("ep", True),
    CommGroup.EP_REPLICA_GROUP: ("ep", False),
}


def _key(kind: CommGroup, c: dict[str, int], degrees: dict[str, int]) -> tuple[int, ...]:
    """What the ranks of one group of this kind agree on."""
    if kind in _BLOCKS:
        field, one_block = _BLOCKS[kind]
        degree = degrees[field]
        return (c["P"], c["T"], c["D"] // degree if one_block else c["D"] % degree)
    return tuple(c[a] for a in "DPT" if a not in _VARYING[kind])


@dataclasses.dataclass(frozen=True)
class Topology:
    world_size: int
    pp: int
    tp: int
    order: str = "DPT"
    sdp: int = 1  # sharded data parallelism: replicas a parameter is sharded over (divides rdp)
    ep: int = 1  # expert parallelism: replicas the experts are divided among (divides rdp)

    def __post_init__(self) -> None:
        if self.pp < 1 or self.tp < 1 or self.world_size % (self.pp * self.tp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by pp ({self.pp}) x tp ({self.tp})"
            )
        if self.sdp < 1 or self.rdp % self.sdp:
            raise ValueError(
                f"sharded data parallel degree {self.sdp} does not divide the reduced data parallel "
                f"degree {self.rdp} (world {self.world_size} / (pp {self.pp} x tp {self.tp}))"
            )
        if self.ep < 1 or self.rdp % self.ep:
            raise ValueError(
                f"expert parallel degree {self.ep} does not divide the reduced data parallel "
                f"degree {self.rdp} (world {self.world_size} / (pp {self.pp} x tp {self.tp}))"
            )
        if sorted(self.order) != ["D", "P", "T"]:
            raise ValueError(f"placement order must be a permutation of 'DPT', got {self.order!r}")

    @property
    def rdp(self) -> int:
        return self.world_size // (self.pp * self.tp)

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        return {"D": self.rdp, "P": self.pp, "T": self.tp}

    @functools.cached_property
    def _coords(self) -> list[dict[str, int]]:
        table = []
        for rank in range(self.world_size):
            coords = {}
            for axis in reversed(self.order):  # rightmost varies fastest
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
                key = _key(kind, c, {"sdp": self.sdp, "ep": self.ep})
                by_key.setdefault(key, []).append(rank)  # ranks arrive ascending
            groups = sorted(by_key.values(), key=lambda g: g[0])
            index = [0] * self.world_size
            for i, group in enumerate(groups):
                for rank in group:
                    index[rank] = i
            table[kind] = (groups, index)
        return table

    def coords(self, rank: int) -> dict[str, int]:
        """(D, P, T) coordinates of a global rank."""
        return dict(self._coords[self._checked(rank)])

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for axis in self.order:
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
        if group in _BLOCKS:
            field, one_block = _BLOCKS[group]
            degree = getattr(self, field)
            return degree if one_block else self.rdp // degree
        size = 1
        for axis in _VARYING[group]:
            size *= self.sizes[axis]
        return size

    def _checked(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        return rank
