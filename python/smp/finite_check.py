"""The non-finite check (config "check_finite", or "debug"): a NaN or inf in a step's activations,
loss or gradients stops training on every rank with a report of the step and the stage where it
first appeared, instead of quietly turning every weight into NaN.

Each rank records what it sees during the step: the activations its stage produces (per
microbatch), the loss it backpropagates, and its gradients once averaged. At the end of the step
the ranks exchange their findings (one small all-gather over the world, only with the check on)
and all raise the same error, so none is left waiting. "First" follows the order of the
computation: forward activations by stage ascending, then the loss, then gradients by stage
descending (the backward runs from the last stage to the first).

Not with fp16: there inf/nan gradients are the loss scaler's overflow signal, and the step is
skipped and the scale lowered as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist


class NonFiniteError(FloatingPointError):
    """A NaN or inf appeared in training with the non-finite check on."""


def _finite(tensor: torch.Tensor) -> bool:
    if not tensor.is_floating_point():
        return True
    return math.isfinite(float(tensor.detach().float().sum()))  # one reduction; nan/inf propagate


class FiniteCheck:
    """`stages`: the pipeline stages this rank runs (one, or two under "zero_bubble_v")."""

    def __init__(self, stages: tuple[int, ...], rank: int):
        self._stages, self._rank = tuple(sorted(stages)), rank
        self._findings: list[tuple[int, int, str]] = []  # (order, stage, description)

    def start_step(self) -> None:
        self._findings = []

    def activations(self, k: int, produced: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """`produced`: per stage of this rank, the values it computed in microbatch k's forward."""
        for stage in sorted(produced):
            for name, tensor in produced[stage].items():
                if isinstance(tensor, torch.Tensor) and not _finite(tensor):
                    self._add(0, stage, f"activation {name!r} of microbatch {k}", (stage,))
                    return

    def loss(self, k: int, tensors: list[torch.Tensor]) -> None:
        if any(isinstance(t, torch.Tensor) and not _finite(t) for t in tensors):
            self._add(1, self._stages[0], f"the loss of microbatch {k}", self._stages)

    def gradients(self, named: list[tuple[str, torch.Tensor | None]]) -> None:
        for name, grad in named:
            if grad is not None and not _finite(grad):
                self._add(2, -self._stages[-1], f"the gradient of {name!r}", self._stages)
                return

    def end_step(self, step: int, named_grads: list[tuple[str, torch.Tensor | None]] | None) -> None:
        """The step's end: its gradients checked (None: no backward ran), then every rank's findings
        exchanged; raises on every rank if any (none is left waiting)."""
        if named_grads is not None:
            self.gradients(named_grads)
        self.raise_if_any(step, None)

    def _add(self, order: int, key: int, what: str, stages: tuple[int, ...]) -> None:
        if not any(o == order for o, _, _ in self._findings):
            where = f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"
            self._findings.append((order, key, f"{what} on pipeline {where} (rank {self._rank})"))

    def raise_if_any(self, step: int, group: dist.ProcessGroup | None) -> None:
        """Exchanges the findings over `group` (None: the default group; every rank calls this) and
        raises on all if any."""
        found = self._findings
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            everyone: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, found, group=group)
            found = [f for part in everyone for f in part]
        if not found:
            return
        found.sort()
        first, rest = found[0], found[1:]
        then = "; then " + "; ".join(d for _, _, d in rest[:5]) if rest else ""
        raise NonFiniteError(
            f"smp check_finite: a NaN or inf first appeared at step {step} in {first[2]}{then}. Look "
            "there for the cause (a learning rate too high, a log or division of zero, bad input "
            "data); turn the check off with 'check_finite': false and 'debug': false"
        )
