"""The full model's state_dict from this rank's part, and a full state_dict into it.

With pipeline stages each rank holds its stage's tensors, and with tensor parallelism its
shards of the distributed ones; the full state gathers the shards over the tensor-parallel
group and the stages over the pipeline group, under the module's own keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

import smp.passes as passes
from smp.groups import ParallelGroups
from smp.sharded_data import tensors
from smp.state.sliced import Placement, Slices

if TYPE_CHECKING:  # (only the type: the placement is the engine's, handed in)
    from smp.expert_parallel import ExpertPlacement

EXPERT_BLOCKS = passes.ShardSpec(dim=0)  # an expert bank's experts, a block per rank of the ep group


def local_part(
    param: torch.Tensor, full: torch.Tensor, specs: Mapping[int, passes.ShardSpec], groups: ParallelGroups
) -> torch.Tensor:
    """This rank's part of `full`, the whole value of `param`."""
    spec = specs.get(id(param))
    return full if spec is None else spec.local(full, groups.tp_rank, groups.tp_size)


def full_state_dict(
    module: nn.Module,
    keys: list[str],
    specs: Mapping[int, passes.ShardSpec],
    groups: ParallelGroups,
    experts: ExpertPlacement | None = None,
) -> dict[str, torch.Tensor]:
    """The whole model's state under `keys` (a collective over the pipeline and tensor-parallel
    groups, and with `experts` the ep group, whose blocks of each of this stage's banks are
    gathered in rank order)."""
    local = _unsharded_local_state(module, specs, groups)
    if experts is not None:
        local = experts.gather_full(local)
    if groups.pp_size == 1:
        return {k: local[k] for k in keys}
    parts: list[Any] = [None] * groups.pp_size
    dist.all_gather_object(parts, local, group=groups.pp)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            merged.setdefault(k, v)
    missing = [k for k in keys if k not in merged]
    if missing:
        raise RuntimeError(f"smp: state_dict is missing {missing[:5]} after gathering the stages")
    return {k: merged[k] for k in keys}


def load_full_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    keys: list[str],
    specs: Mapping[int, passes.ShardSpec],
    groups: ParallelGroups,
    strict: bool,
) -> None:
    """Each rank takes the entries of its stage, cut to its tensor-parallel shard."""
    check_keys(state_dict, keys, strict)
    with torch.no_grad():
        for key, t in module.named_parameters(remove_duplicate=False):
            if key in state_dict:
                tensors.copy_whole_into(t, local_part(t, state_dict[key], specs, groups))
        for key, t in module.named_buffers(remove_duplicate=False):
            if key in state_dict:
                t.copy_(state_dict[key])


def check_keys(state_dict: Mapping[str, torch.Tensor], keys: list[str], strict: bool) -> None:
    """With `strict`, a full state_dict must have exactly the model's keys."""
    unknown = [k for k in state_dict if k not in keys]
    missing = [k for k in keys if k not in state_dict]
    if strict and (unknown or missing):
        raise RuntimeError(
            f"smp: load_state_dict: unexpected keys {unknown[:5]}, missing keys {missing[:5]} "
            "(pass strict=False to load a subset)"
        )


def _unsharded_local_state(
    module: nn.Module, specs: Mapping[int, passes.ShardSpec], groups: ParallelGroups
) -> dict[str, torch.Tensor]:
    """This stage's state on CPU, each tensor-parallel shard gathered into the full tensor."""
    state = {}
    for key, t in module.state_dict(keep_vars=True).items():
        spec = specs.get(id(t))  # keep_vars: the Parameter objects themselves
        t = tensors.whole(t.detach())  # (sdp shards: a collective over the sdp group)
        if spec is not None:
            parts = [torch.empty_like(t) for _ in range(groups.tp_size)]
            dist.all_gather(parts, t.contiguous(), group=groups.tp)
            t = spec.full(parts)
        state[key] = t.cpu()
    return state


# --- layout-free state (checkpoints that move between layouts) ----------------------------


@dataclasses.dataclass(frozen=True)
class StatePlaces:
    """Where this rank's tensors sit in the original model: each state_dict entry's key and
    placement, each parameter's canonical name (the first of its names in the original module's
    order, so tied weights have one name on every layout), and which entries this rank writes so
    that every element of the model is written exactly once."""

    # (key, local tensor, placement, where the local tensor starts in the flattened whole: None
    # when it is all of it, an element offset for a row range of an sdp-sharded tensor)
    entries: tuple[tuple[str, torch.Tensor, Placement, int | None], ...]
    names: Mapping[int, str]  # id(parameter) -> canonical name
    placements: Mapping[int, Placement]  # id(parameter) -> placement
    stage_writes: frozenset[str]  # keys the lowest stage holding them writes: this stage's
    tp_rank: int
    rdp_rank: int
    sdp_size: int = 1
    first_expert_replica: bool = True  # whether this rank writes its block of the experts

    def writes(
        self, key: str, placement: Placement, per_replica_chunk: bool = False, rows: bool = False
    ) -> bool:
        """Whether this rank writes `key`: its lowest stage, every tensor-parallel rank of a sharded
        tensor (tp rank 0 of a replicated one), and the first replica unless each replica holds a
        chunk of its own (sharded optimizer state) or, for `rows` of an sdp-sharded tensor, every
        rank of the first sdp group; a block of experts, the first of the replicas holding it."""
        if placement.expert:  # (a chunk or sdp rows of a block: each replica holding it its own)
            return key in self.stage_writes and (per_replica_chunk or rows or self.first_expert_replica)
        first = self.rdp_rank < self.sdp_size if rows else self.rdp_rank == 0
        return (
            key in self.stage_writes
            and (placement.spec is not None or self.tp_rank == 0)
            and (per_replica_chunk or first)
        )


def state_places(
    module: nn.Module,
    keys: list[str],
    specs: Mapping[int, passes.ShardSpec],
    groups: ParallelGroups,
    experts: ExpertPlacement | None = None,
) -> StatePlaces:
    """This rank's StatePlaces (a collective over the pipeline group: which stage holds which keys).
    `experts`: expert parallelism's ExpertPlacement, whose blocks sit along dim 0 of each bank."""
    order = {k: i for i, k in enumerate(keys)}
    entries, names, placements = [], {}, {}
    for key, t in module.state_dict(keep_vars=True).items():
        if experts is not None and experts.holds(t):
            placement = Placement.of(t.shape, EXPERT_BLOCKS, experts.rank, experts.degree)
            placement = dataclasses.replace(placement, expert=True)
        else:
            placement = Placement.of(t.shape, specs.get(id(t)), groups.tp_rank, groups.tp_size)
        start = tensors.flat_start(t) if tensors.is_sharded(t) else None
        entries.append((key, tensors.local(t), placement, start))
        placements[id(t)] = placement
        if id(t) not in names or order.get(key, len(order)) < order.get(names[id(t)], len(order)):
            names[id(t)] = key
    held: list[Any] = [None] * groups.pp_size
    mine = sorted(k for k, *_ in entries)
    if groups.pp_size > 1:
        dist.all_gather_object(held, mine, group=groups.pp)
    else:
        held = [mine]
    first = {}
    for stage, stage_keys in enumerate(held):
        for k in stage_keys:
            first.setdefault(k, stage)
    writes = frozenset(k for k in mine if first[k] == groups.pp_rank)
    replicas = groups.ep_holders_ranks or (groups.rank,)  # (with their tp ranks: one writes)
    return StatePlaces(
        tuple(entries),
        names,
        placements,
        writes,
        groups.tp_rank,
        groups.rdp_rank,
        groups.sdp_size,
        first_expert_replica=groups.rank == min(replicas),
    )


def model_slices(places: StatePlaces, for_save: bool) -> dict[str, Slices]:
    """The model's entries as Slices of views of this rank's tensors: those it writes (for_save),
    or all it holds (to load into)."""
    items = {}
    for key, t, placement, start in places.entries:
        if for_save and not places.writes(key, placement, rows=start is not None):
            continue
        slices = Slices(placement.global_shape, t.dtype)
        if start is None:
            items[key] = slices.add_local(t.detach(), placement)
        else:
            items[key] = slices.add_range(t.detach().reshape(-1), start, placement)
    return items


@dataclasses.dataclass(frozen=True)
class ModelState:
    """A model's state spoken of as the original module's, whatever the layout: `module` holds this
    rank's part, cut as `specs` say, under the original's `keys`."""

    module: nn.Module
    keys: list[str]
    specs: Mapping[int, passes.ShardSpec]
    groups: ParallelGroups
    experts: ExpertPlacement | None = None  # expert parallelism's placement, if the model has one

    def full(self) -> dict[str, torch.Tensor]:
        """The whole model's state (a collective: over the pipeline and tensor-parallel groups, and
        the ep group, whose blocks of every expert bank are gathered in rank order)."""
        return full_state_dict(self.module, self.keys, self.specs, self.groups, self.experts)

    def load(self, state_dict: Mapping[str, torch.Tensor], strict: bool) -> None:
        """A whole model's state into this rank's part (each rank its block of the experts)."""
        if self.experts is not None:
            state_dict = self.experts.cut_full(state_dict)
        load_full_state_dict(self.module, state_dict, self.keys, self.specs, self.groups, strict)

    def local_part(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return local_part(param, full, self.specs, self.groups)

    def places(self) -> StatePlaces:
        """Where this rank's tensors sit in the original model (a collective over the pipeline group)."""
        return state_places(self.module, self.keys, self.specs, self.groups, self.experts)
