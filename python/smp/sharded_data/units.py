"""The units sharded data parallelism gathers one at a time: the model's transformer layers, and
the rest of the model as the root unit.

A layer is a module whose class the model names in Hugging Face's `_no_split_modules` (the
blocks HF itself never splits across devices); a model without that list has its layers in
its largest nn.ModuleList / nn.Sequential of two or more modules. A model with neither is one
unit, gathered whole: it works, but saves memory only between steps, so smp warns.
"""

from __future__ import annotations

import warnings

from torch import nn


def layer_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of each layer, in the module's order, none inside another."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    found = [(p, m) for p, m in module.named_modules() if p and type(m).__name__ in names]
    if not found:
        found = _largest_list(module)
    units: list[tuple[str, nn.Module]] = []
    for path, m in found:
        if not any(path.startswith(outer + ".") for outer, _ in units):
            units.append((path, m))
    if not units:
        warnings.warn(
            f"smp sharded data parallelism: {type(module).__name__} has no layers smp can find (no "
            "_no_split_modules, no nn.ModuleList or nn.Sequential of layers), so its parameters are "
            "gathered whole for each forward and backward; hold the layers in an nn.ModuleList",
            stacklevel=4,
        )
    return units


def _largest_list(module: nn.Module) -> list[tuple[str, nn.Module]]:
    lists = [
        (p, m)
        for p, m in module.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1 and p != ""
    ]
    if not lists and isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 1:
        lists = [("", module)]
    if not lists:
        return []
    path, best = max(lists, key=lambda pm: sum(p.numel() for p in pm[1].parameters()))
    prefix = f"{path}." if path else ""
    return [(f"{prefix}{name}", child) for name, child in best.named_children() if _has_params(child)]


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def prefetch_depth(max_live: int, units: list[tuple[str, nn.Module]]) -> int:
    """SMP's sdp_max_live_parameters as FSDP2's explicit prefetch: 1 (the next layer is gathered
    while one runs, in forward as FSDP2 does in backward) where two layers fit the limit, else 0
    (FSDP2's own backward prefetch only). Deeper prefetch is not offered: the planner counts
    two live layers (smp.planner.memory)."""
    if not units:
        return 0
    largest = max(numel(m) for _, m in units)
    return 1 if max_live >= 2 * largest else 0
