"""ParallelGroups: this rank's place in the layout and its process groups, as one value.

The engine and every parallelism take it as an explicit argument; only the SMP v1 API
(smp.parallel_state) builds it from the process-global state.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from smp.topology import Topology


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the layout and the process groups the engine works over.

    `rdp`/`dp` (and their ranks) are the replicas of this rank's parameters, over which gradients
    are averaged: the data replicas and, with context parallelism, their cp ranks too (see
    smp.topology's RDP_CP_GROUP); `cp` is the context-parallel group.
    """

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
    # Sharded data parallelism: the ranks a parameter is sharded over, and the ranks holding the
    # same shard in the other sdp groups of the reduced-data-parallel group (None: not made).
    sdp: dist.ProcessGroup | None = None
    sdp_replica: dist.ProcessGroup | None = None
    sdp_ranks: tuple[int, ...] = ()
    sdp_replica_ranks: tuple[int, ...] = ()
    # Expert parallelism: the ranks holding disjoint sets of experts (tokens travel between them),
    # and the ranks holding the same experts (their gradients are combined there).
    ep: dist.ProcessGroup | None = None
    ep_replica: dist.ProcessGroup | None = None
    ep_ranks: tuple[int, ...] = ()
    ep_replica_ranks: tuple[int, ...] = ()
    # The ep replicas with their tp ranks: every rank holding the same experts.
    ep_holders: dist.ProcessGroup | None = None
    ep_holders_ranks: tuple[int, ...] = ()
    # Context parallelism: the ranks cutting one batch's sequences (None: not made).
    cp: dist.ProcessGroup | None = None
    cp_ranks: tuple[int, ...] = ()
    cp_rank: int = 0

    @property
    def pp_size(self) -> int:
        return len(self.pp_ranks)

    @property
    def tp_size(self) -> int:
        return len(self.tp_ranks)

    @property
    def rdp_size(self) -> int:
        return len(self.rdp_ranks)

    @property
    def cp_size(self) -> int:
        return len(self.cp_ranks) or 1

    @property
    def sdp_size(self) -> int:
        return len(self.sdp_ranks) or 1

    @property
    def ep_size(self) -> int:
        return len(self.ep_ranks) or 1
