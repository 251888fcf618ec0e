"""Plain gradients: each parameter's own `.grad`, stepped as they are (fp32 training without
sharded optimizer state, at any pipeline or tensor-parallel layout). The gradient averaging left
them averaged in place; the step, clipping and state are GradientState's."""

from __future__ import annotations

from smp.gradients.state import GradientState


class PlainGradients(GradientState):
    pass
