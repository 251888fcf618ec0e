"""Expert parallelism (issue 47): a mixture of experts' experts divided among the ranks of the ep
group, tokens exchanged to them and back (smp::moe_dispatch / smp::moe_combine).

`distribute(module, groups)` finds the experts modules (`find.py`) and keeps this rank's block of
each (`bank.py`); `global_router_losses` makes the router's auxiliary loss cover the global batch
(`aux_loss.py`). In a captured model (pipeline stages) each experts module's nodes first become one
call (`graph.py`), which runs the exchange once `distribute` cut the module. `distribute` returns
an `ExpertPlacement`: which parameters are experts, whose gradients are combined over the replicas
holding the same experts (the ep replica group) and not over all of data parallelism.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from smp import params as param_facts
from smp.expert_parallel.aux_loss import global_router_losses
from smp.expert_parallel.bank import (
    ExpertSlice,
    expert_slice,
    grouped_matmul,
    keep_local_experts,
    scale_gradients,
    split_tokens,
)
from smp.expert_parallel.find import ExpertBank, ExpertLayoutError, check_divides, expert_banks
from smp.groups import ParallelGroups

__all__ = [
    "ExpertBank",
    "ExpertLayoutError",
    "ExpertPlacement",
    "ExpertSlice",
    "distribute",
    "global_router_losses",
    "expert_banks",
    "expert_slice",
    "grouped_matmul",
    "scale_gradients",
]


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """What expert parallelism decided for this rank."""

    degree: int
    banks: tuple[ExpertBank, ...]
    params: tuple[nn.Parameter, ...]  # this rank's expert parameters
    # Expert gradients are summed over the ranks holding the same experts (the ep replicas, with
    # their tp ranks under tp), then divided by the whole data-parallel degree: one process's
    # gradient on the global batch.
    replica_group: dist.ProcessGroup | None
    group: dist.ProcessGroup | None = None  # the ep group (its ranks hold the other blocks)
    rank: int = 0  # this rank's place in it: its block of every bank

    def holds(self, param: torch.Tensor) -> bool:
        return any(param is p for p in self.params)

    def _keys(self, prefix: str = "") -> list[str]:
        return [f"{prefix}{b.path}.{name}" for b in self.banks for name in b.banks]

    def gather_full(self, state: dict) -> dict:
        """A state_dict of the module with every expert bank whole (its blocks gathered over the ep
        group, in rank order): what one process's model holds. A collective over the ep group."""
        out = dict(state)
        for key in self._keys():
            if key in out:
                block = out[key].detach().contiguous()
                blocks = [torch.empty_like(block) for _ in range(self.degree)]
                dist.all_gather(blocks, block, group=self.group)
                out[key] = torch.cat(blocks)
        return out

    def cut_full(self, state: dict) -> dict:
        """A full state_dict (one process's model) with each expert bank cut to this rank's block."""
        out = dict(state)
        for key in self._keys():
            if key in out:
                local = out[key].shape[0] // self.degree
                out[key] = out[key][self.rank * local : (self.rank + 1) * local]
        return out


def distribute(
    module: nn.Module, groups: ParallelGroups, banks: list[ExpertBank] | None = None
) -> ExpertPlacement:
    """Keeps this rank's experts of every experts module (the replicas must agree on the whole model
    before: each keeps its block of the same banks); `banks`: those of a pipeline stage, already
    checked against the whole model (default: every one the module has, checked here)."""
    degree = groups.ep_size
    if banks is None:
        banks = expert_banks(module)
        check_divides(banks, degree, module)
    rank = groups.ep_ranks.index(groups.rank)
    kept = []
    for bank in banks:
        local = bank.num_experts // degree
        piece = ExpertSlice(bank.num_experts, rank * local, local, groups.ep.group_name)
        for full, mine in keep_local_experts(bank.module, bank.banks, piece).items():
            param_facts.mark_moved(full, mine)
            param_facts.mark_expert(mine)
            kept.append(mine)
        if groups.tp_size > 1:  # each rank of a tp group sends its part of the group's tokens
            split_tokens(bank.module, groups.tp.group_name, groups.tp_size, groups.tp_rank)
    # Summed over every rank holding the same experts: the ep replicas and, under tp, their tp
    # ranks (each ran its part of the tokens); without tp the two groups are one.
    replicas = groups.ep_holders if len(groups.ep_holders_ranks) > 1 else None
    return ExpertPlacement(degree, tuple(banks), tuple(kept), replicas, groups.ep, rank)
