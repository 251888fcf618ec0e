"""Activation checkpointing and offloading (SMP v1's `smp.set_activation_checkpointing` and
`offload_activations`).

A script marks modules after wrapping and before the first step; the engine keeps the
requests. A model run as a captured graph (pipeline or tensor parallelism) gets each
region's nodes outlined on every stage into a `RecomputeRegion` (smp.passes.regions); a
model run whole gets its modules' forwards wrapped. Either way torch.utils.checkpoint does
the recompute, and an `ActivationOffloader` may hold the kept inputs on the host.
"""

from __future__ import annotations

from torch import fx, nn

from smp.passes.regions import Region, outline_regions
from smp.recompute import hf_flags
from smp.recompute.offload import ActivationOffloader
from smp.recompute.region import RecomputeRegion, checkpoint_chain, checkpoint_forward
from smp.recompute.requests import CheckpointRequest, layer_groups, regions, request, span_label

__all__ = [
    "ActivationOffloader",
    "CheckpointRequest",
    "apply_eager",
    "apply_to_stage",
    "hf_flags",
    "regions",
    "request",
]


def apply_to_stage(
    gm: fx.GraphModule, wanted: list[tuple[Region, bool]], offloader: ActivationOffloader | None
) -> list[str]:
    """Outlines the regions present in a stage's graph; returns the labels of those outlined."""
    rng = {region: preserve for region, preserve in wanted}

    def wrap(region: Region, paths: list[str], body: fx.GraphModule) -> nn.Module:
        return RecomputeRegion(body, span_label(paths) or region.label, rng[region], offloader)

    done = outline_regions(gm, [r for r, _ in wanted], wrap, prefix="smp_recompute")
    return [span_label(paths) or region.label for region, paths, _ in done]


def apply_eager(req: CheckpointRequest, offloader: ActivationOffloader | None) -> None:
    """Checkpoints a module of a model that runs whole (no captured graph)."""
    groups = layer_groups(req)
    if not req.is_layer_list or req.strategy == "each":
        targets = [req.module] if not req.is_layer_list else list(req.module)
        for module in targets:
            checkpoint_forward(module, req.preserve_rng_state, offloader)
        return
    if isinstance(req.module, nn.Sequential):
        checkpoint_chain(req.module, groups, req.preserve_rng_state, offloader)
        return
    raise ValueError(
        f"smp.set_activation_checkpointing: strategy {req.strategy!r} on the nn.ModuleList "
        f"'{req.paths[0]}' groups layers that your forward chains; smp sees that chain only in the "
        "captured graph, which it builds with pipeline_parallel_degree > 1 or tensor_parallel_degree > 1. "
        "Here the model runs whole: use strategy='each', or hold the layers in an nn.Sequential"
    )
