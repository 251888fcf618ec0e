"""Activation checkpointing and offloading (SMP v1's `smp.set_activation_checkpointing` and
`offload_activations`).

A script marks modules after wrapping and before the first step; the engine keeps the
requests. A model run as a captured graph (pipeline or tensor parallelism) gets each
region's nodes outlined on every stage into a `RecomputeRegion` (smp.passes.regions); a
model run whole gets its modules' forwards wrapped. Either way torch.utils.checkpoint does
the recompute, and an `ActivationOffloader` may hold the kept inputs on the host.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import fx, nn

from smp.passes.regions import Region, outline_regions
from smp.recompute import hf_flags
from smp.recompute.offload import ActivationOffloader
from smp.recompute.region import RecomputeRegion, checkpoint_chain, checkpoint_forward
from smp.recompute.requests import CheckpointRequest, layer_groups, regions, request, span_label

__all__ = [
    "ActivationOffloader",
    "CheckpointRequest",
    "Checkpointing",
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


class Checkpointing:
    """A model's checkpointing requests, in order, and the offloader their regions share (on CUDA,
    with offload_activations)."""

    def __init__(self, module: nn.Module, offload: bool, horizon: int, captured: bool):
        self._captured = captured  # regions are outlined in the stage graphs, else forwards wrapped now
        self._offload = offload
        self.requests: list[CheckpointRequest] = []
        self.offloader = (
            ActivationOffloader(horizon, module.parameters) if offload and torch.cuda.is_available() else None
        )

    def add(self, req: CheckpointRequest, started: bool) -> None:
        """Recomputes the request's regions in backward (before the first step only)."""
        if started:
            raise ValueError(
                f"smp.set_activation_checkpointing({req.paths[0] or 'the whole model'}): called after "
                "the first step, when the model is already partitioned and running; call it after "
                "smp.DistributedModel(...) and before the first @smp.step call"
            )
        self.requests.append(req)
        if not self._captured:  # the module runs whole: its forwards are wrapped now
            apply_eager(req, self.offloader)

    def regions(self) -> list[tuple[Region, bool]]:
        return regions(self.requests)

    def saving_for(self, k: int):
        """Around microbatch k's forward: checkpointed regions offload their inputs for it."""
        return self.offloader.forward_of(k) if self.offloader is not None else contextlib.nullcontext()

    def before_backward(self, k: int) -> None:
        if self.offloader is not None:
            self.offloader.before_backward(k)

    def finish_step(self) -> None:
        if self.offloader is not None:
            self.offloader.finish_step()

    def check_first_step(self) -> None:
        """Warns where offload_activations can do nothing."""
        if not self._offload:
            return
        if not self.requests:
            warnings.warn(
                "smp: offload_activations is on but no module is checkpointed, so there is nothing to "
                "offload; call smp.set_activation_checkpointing(module) before the first step",
                stacklevel=5,  # the script line that called the step
            )
        elif self.offloader is None:
            warnings.warn(
                "smp: offload_activations has no effect here: activations are CPU tensors, already in "
                "host memory",
                stacklevel=5,  # the script line that called the step
            )
