"""The optimizer's state under the model's parameter names and in global coordinates, so that
a checkpoint written on one layout resumes on any other.

Each per-element state tensor (Adam's moments, momentum buffers, and the fp32 master weights
of bf16/fp16 training) is stored as `optimizer/<parameter name>/<key>` with the parameter's
global shape: a rank contributes its tensor-parallel shard, or under sharded optimizer state
the part of its chunk that covers the parameter (`Slices`). Other tensors (Adam's `step`) are
stored once per parameter; plain values and the param groups' hyperparameters travel in the
checkpoint's metadata. Loading builds the same description for this rank's layout and lets the
storage layer fill it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from smp.optim.flat_state import FlatState
from smp.sharded_data import tensors
from smp.state.model_state import StatePlaces
from smp.state.sliced import Slices

MASTER = "master"  # the fp32 master weights of bf16/fp16 training


PREFIX = "optimizer/"


def key(name: str, state_key: str) -> str:
    return f"{PREFIX}{name}/{state_key}"


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def export(
    optimizer: torch.optim.Optimizer, flat: FlatState | None, places: StatePlaces, sharded: bool
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(tensors this rank writes, keyed for the checkpoint; plain values by parameter name)."""
    items: dict[str, Any] = {}
    values: dict[str, dict[str, Any]] = {}

    def whole(p: nn.Parameter, state_key: str, value: Any) -> None:
        name, placement = places.names[id(p)], places.placements[id(p)]
        if not places.writes(name, placement):
            return
        if isinstance(value, torch.Tensor):
            items[key(name, state_key)] = value.detach()
        else:
            values.setdefault(name, {})[state_key] = value

    if flat is None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                for k, v in optimizer.state.get(p, {}).items():
                    if _per_element(v, p.shape):
                        name, placement = places.names[id(p)], places.placements[id(p)]
                        rows = tensors.is_sharded(v)  # sdp: this rank's rows of the state
                        if places.writes(name, placement, rows=rows):
                            slices = Slices(placement.global_shape, v.dtype)
                            if rows:
                                slices.add_range(
                                    tensors.local(v).detach().reshape(-1), tensors.flat_start(v), placement
                                )
                            else:
                                slices.add_local(v.detach(), placement)
                            items[key(name, k)] = slices
                    else:
                        whole(p, k, v)
        return items, values
    for fg in flat.groups:
        chunk_state = dict(optimizer.state.get(fg.master, {}))
        if fg.master_is_copy:  # the precise values
            chunk_state[MASTER] = fg.master.detach()
        for k, v in chunk_state.items():
            if _per_element(v, fg.master.shape):
                for p, p_start, c_start, n in fg.overlaps():
                    name, placement = places.names[id(p)], places.placements[id(p)]
                    if places.writes(name, placement, per_replica_chunk=sharded):
                        slices = items.setdefault(key(name, k), Slices(placement.global_shape, v.dtype))
                        slices.add_range(v.detach()[c_start : c_start + n], p_start, placement)
            else:
                for p in fg.params:
                    whole(p, k, v)
    return items, values


def destinations(
    optimizer: torch.optim.Optimizer,
    flat: FlatState | None,
    places: StatePlaces,
    stored: Mapping[str, tuple[torch.Size, torch.dtype]],
) -> tuple[dict[str, Any], Callable[[Mapping[str, Mapping[str, Any]]], None]]:
    """(what this rank reads, as Slices or whole tensors to fill; a function that installs what
    was read, with the plain values, into the optimizer)."""
    items: dict[str, Any] = {}

    by_name: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}
    for stored_key, value in stored.items():  # "optimizer/<name>/<state key>", names have no "/"
        name, _, state_key = stored_key[len(PREFIX) :].rpartition("/")
        by_name.setdefault(name, {})[state_key] = value

    def stored_keys(p: nn.Parameter) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return by_name.get(places.names[id(p)], {})

    def per_element(p: nn.Parameter, shape: torch.Size) -> bool:
        return tuple(shape) == tuple(places.placements[id(p)].global_shape) and len(shape) > 0

    def whole(p: nn.Parameter, state_key: str, shape, dtype) -> torch.Tensor:
        name = key(places.names[id(p)], state_key)
        if name not in items:
            items[name] = torch.empty(tuple(shape), dtype=dtype)
        return items[name]

    if flat is None:
        staged: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = staged.setdefault(p, {})
                for k, (shape, dtype) in stored_keys(p).items():
                    if k == MASTER:
                        continue  # this run keeps no master copy: the model's weights are loaded
                    if per_element(p, shape):
                        placement = places.placements[id(p)]
                        slices = items[key(places.names[id(p)], k)] = Slices(shape, dtype)
                        if tensors.is_sharded(p):  # sdp: this rank's rows, as a DTensor like p
                            local = torch.zeros(tensors.local(p).shape, dtype=dtype, device=p.device)
                            slices.add_range(local.view(-1), tensors.flat_start(p), placement)
                            state[k] = tensors.like(p, local)
                        else:
                            local = torch.zeros(p.shape, dtype=dtype, device=p.device)
                            slices.add_local(local, placement)
                            state[k] = local
                    else:
                        state[k] = whole(p, k, shape, dtype)

        def install(values: Mapping[str, Mapping[str, Any]]) -> None:
            for p, state in staged.items():
                state = {**state, **values.get(places.names[id(p)], {})}
                if state:
                    optimizer.state[p] = {k: _to(v, p.device) for k, v in state.items()}

        return items, install

    chunks: list[dict[str, torch.Tensor]] = []
    for fg in flat.groups:
        chunk: dict[str, torch.Tensor] = {}
        for p, p_start, c_start, n in fg.overlaps():
            name, placement = places.names[id(p)], places.placements[id(p)]
            for k, (shape, dtype) in stored_keys(p).items():
                if not per_element(p, shape) or (k == MASTER and not fg.master_is_copy):
                    continue
                if k not in chunk:
                    chunk[k] = torch.zeros(fg.chunk, dtype=dtype, device=fg.master.device)
                buffer = chunk[k]
                slices = items.setdefault(key(name, k), Slices(shape, dtype))
                slices.add_range(buffer[c_start : c_start + n], p_start, placement)
        for p in fg.params[:1]:  # per-group values (a step count): the first parameter's
            for k, (shape, dtype) in stored_keys(p).items():
                if not per_element(p, shape):
                    chunk[k] = whole(p, k, shape, dtype)
        chunks.append(chunk)

    def install_flat(values: Mapping[str, Mapping[str, Any]]) -> None:
        for fg, chunk in zip(flat.groups, chunks, strict=True):
            chunk = dict(chunk)
            if fg.params:
                chunk |= values.get(places.names[id(fg.params[0])], {})
            master = chunk.pop(MASTER, None)
            with torch.no_grad():
                if master is not None:
                    fg.master.copy_(master)
                elif fg.master_is_copy:  # saved without masters (fp32): the weights just loaded
                    fg.master.copy_(fg.values[fg.lo : fg.lo + fg.chunk])
            if chunk:
                optimizer.state[fg.master] = {k: _to(v, fg.master.device) for k, v in chunk.items()}

    return items, install_flat


def load_hyperparameters(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"smp: the checkpoint's optimizer has {len(saved)} param groups, this one "
            f"{len(optimizer.param_groups)}; build the optimizer with the same param groups"
        )
    for group, hyper in zip(optimizer.param_groups, saved, strict=True):
        group.update(hyper)


def _per_element(value: Any, shape: torch.Size) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shape


def _to(value: Any, device: torch.device) -> Any:
    # Adam keeps `step` on the CPU unless capturable/fused: leave 0-dim tensors where torch put them.
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value.to(device)
    return value
