"""What a script asked to checkpoint (`smp.set_activation_checkpointing`), checked, and turned
into regions: sets of module paths whose forward is recomputed in backward as one unit."""

from __future__ import annotations

import dataclasses
import re

from torch import nn

from smp.passes.fx_utils import parent_path
from smp.passes.regions import Region

STRATEGIES = ("each", "contiguous", "group_N")
_GROUP = re.compile(r"group_(\d+)")


@dataclasses.dataclass(frozen=True)
class CheckpointRequest:
    module: nn.Module
    paths: tuple[str, ...]  # every path of `module` in the wrapped model
    preserve_rng_state: bool = True
    strategy: str = "each"

    @property
    def is_layer_list(self) -> bool:
        return isinstance(self.module, (nn.Sequential, nn.ModuleList))


def request(
    root: nn.Module, module: nn.Module, preserve_rng_state: bool, pack_args_as_tuple: bool, strategy: str
) -> CheckpointRequest:
    """A checked request; every mistake is a ValueError that names the value and the fix."""
    if not isinstance(module, nn.Module):
        raise ValueError(
            f"smp.set_activation_checkpointing: expected a module of the wrapped model, got "
            f"{type(module).__name__}; pass e.g. model.get_module().layers"
        )
    for name, flag in (
        ("preserve_rng_state", preserve_rng_state),
        ("pack_args_as_tuple", pack_args_as_tuple),
    ):
        if not isinstance(flag, bool):
            raise ValueError(f"smp.set_activation_checkpointing: {name} must be True or False, got {flag!r}")
    group_size(strategy)  # checks it
    paths = tuple(p for p, m in root.named_modules(remove_duplicate=False) if m is module)
    if not paths:
        raise ValueError(
            f"smp.set_activation_checkpointing: the {type(module).__name__} passed is not part of the "
            "model wrapped by smp.DistributedModel; pass a module reached through model.get_module() "
            "(SMP's model.module.module is the same), e.g. "
            "smp.set_activation_checkpointing(model.get_module().layers)"
        )
    return CheckpointRequest(module, paths, preserve_rng_state, strategy)


def group_size(strategy: str) -> int | None:
    """N of "group_N"; None for "each" and "contiguous"."""
    if not isinstance(strategy, str):
        raise ValueError(
            f"smp.set_activation_checkpointing: strategy must be a string ({', '.join(STRATEGIES)}), "
            f"got {strategy!r}"
        )
    if strategy in ("each", "contiguous"):
        return None
    match = _GROUP.fullmatch(strategy)
    if match is None:
        raise ValueError(
            f"smp.set_activation_checkpointing: unknown strategy {strategy!r}; use 'each' (every layer "
            "its own region), 'contiguous' (each stage's run of layers as one region) or 'group_N' "
            "(N consecutive layers per region, e.g. 'group_2')"
        )
    n = int(match.group(1))
    if n < 1:
        raise ValueError(
            f"smp.set_activation_checkpointing: strategy {strategy!r} groups {n} layers; N must be a "
            "positive integer, e.g. 'group_2'"
        )
    return n


def layer_groups(req: CheckpointRequest) -> list[list[int]]:
    """The request's layers (indices into the container) grouped into regions; [[]] for a
    single module (the module itself is the region)."""
    if not req.is_layer_list:
        return [[]]
    indices = list(range(len(req.module)))
    if req.strategy == "each":
        return [[i] for i in indices]
    if req.strategy == "contiguous":
        return [indices] if indices else []
    n = group_size(req.strategy)
    return [indices[i : i + n] for i in range(0, len(indices), n)]


def regions(requests: list[CheckpointRequest]) -> list[tuple[Region, bool]]:
    """Every request's regions with their preserve_rng_state, outermost first: a region inside
    another (a layer of a checkpointed model) adds nothing and is dropped."""
    found: list[tuple[Region, bool]] = []
    for req in requests:
        for group in layer_groups(req):
            paths = (
                frozenset(_join(p, str(i)) for p in req.paths for i in group)
                if group
                else frozenset(req.paths)
            )
            label = req.paths[0] if not group else _label(req.paths[0], group)
            found.append((Region(label, paths), req.preserve_rng_state))
    return [
        (r, rng) for r, rng in found if not any(_inside(r, other) for other, _ in found if other is not r)
    ]


def _inside(region: Region, other: Region) -> bool:
    """Whether every module of `region` lies strictly inside one of `other`'s."""
    return region.paths != other.paths and all(
        any(o == "" or p.startswith(o + ".") for o in other.paths) for p in region.paths
    )


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _label(path: str, group: list[int]) -> str:
    span = str(group[0]) if len(group) == 1 else f"{group[0]}-{group[-1]}"
    return _join(path, span)


def span_label(paths: list[str]) -> str:
    """Module paths as a short label: ["blocks.2", "blocks.3"] -> "blocks.2-3"."""
    if len(paths) == 1 or not paths:
        return paths[0] if paths else ""
    parents = {parent_path(p) for p in paths}
    tails = [p.rsplit(".", 1)[-1] for p in paths]
    if len(parents) == 1 and all(t.isdigit() for t in tails):
        indices = [int(t) for t in tails]
        if indices == list(range(indices[0], indices[-1] + 1)):
            return _label(parents.pop(), indices)
    return ", ".join(paths)
