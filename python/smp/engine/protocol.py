"""What the engine asks of the optimizers attached to it (smp.DistributedOptimizer is one)."""

from __future__ import annotations

from typing import Protocol


class GradientConsumer(Protocol):
    @property
    def loss_scale(self) -> float:
        """The factor model.backward multiplies the loss gradient by (fp16 loss scaling); 1.0 if none."""
        ...

    def step_starting(self) -> None:
        """Called at the start of each training step of a partitioned model, before its backward
        (and once at partitioning, for a model partitioned by its first step): where the
        optimizer keeps gradients in buffers of its own, it hands them over now (use_flat_grads)."""
        ...

    def gradients_ready(self) -> None:
        """Called once per training step, after the backward and the gradient averaging."""
        ...
