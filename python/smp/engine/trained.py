"""Which parameters train, and when that set becomes final.

The set is final once smp has built state for it: a captured model's stage graphs at its first
step (of any kind), a whole model's gradient averaging at its first step that runs backward,
sharded or mixed-precision optimizer state when built (as DDP fixes it when it wraps a model).
Until then the gradient averaging follows requires_grad; a change later is an error at the next
backward (forward-only steps may run with anything frozen, on graphs captured apart), not
gradients left out or never averaged.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from torch import nn

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class TrainedSet:
    """Reads the flags of the parameters the module had when the set was taken (listing them anew
    each step walked every submodule, a host cost a step could see: docs/benchmarks.md, "Host
    overhead")."""

    def __init__(self, module: nn.Module):
        self._module = module
        self._named: list[tuple[str, nn.Parameter]] = []  # the parameters, when the set was taken
        self._params: list[nn.Parameter] = []  # (the same, without names)
        self._flags: list[bool] = []  # and their requires_grad then
        self._final = False
        # If requires_grad changed after the set became final: the error for the next backward,
        # and the names that differ (keys the graphs captured while it differs).
        self.changed: str | None = None
        self.changed_names: tuple[str, ...] = ()

    def take(self, final: bool) -> None:
        """Takes the set now (when the gradient handling is set up for it)."""
        self._named = list(self._module.named_parameters())
        self._params = [p for _, p in self._named]
        self._flags = list(map(_REQUIRES_GRAD, self._params))
        self._final = final

    def make_final(self) -> None:
        self._final = True

    def check(self, follow: Callable[[], None]) -> None:
        """At a step's start: a change before the set is final is followed (`follow()` sets the
        gradient handling up anew); a later one is recorded for the next backward to raise."""
        self.changed, self.changed_names = None, ()
        now = list(map(_REQUIRES_GRAD, self._params))  # (each step: the loop in C)
        if now == self._flags:
            return
        if not self._final:
            follow()
            self.take(final=False)
            return
        pairs = zip(self._named, self._flags, now, strict=True)
        changed = [(name, was) for (name, _), was, flag in pairs if was != flag]
        self.changed_names = tuple(name for name, _ in changed)
        listed = ", ".join(f"{name!r} ({was} -> {not was})" for name, was in changed[:5])
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        self.changed = (
            f"smp: requires_grad of {listed}{more} changed after smp set up which parameters train "
            "(at the first step of a pipeline or tensor-parallel model, the first training step of "
            "a whole one, or when sharded or mixed-precision optimizer state was built: gradient "
            "averaging, sums across stages, optimizer state), as DDP does when it wraps a model; "
            "training another set later is not supported. Set requires_grad before the first "
            "smp.step call; to train another set of parameters later, save a checkpoint and resume "
            "from it in a new run with the new settings"
        )

    def raise_if_changed(self) -> None:
        if self.changed is not None:
            raise ValueError(self.changed)
