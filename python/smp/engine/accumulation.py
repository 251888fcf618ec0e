"""Gradient accumulation over steps (backward_passes_per_step, transformers' gradient
accumulation): the steps between two optimizer steps add to the gradients without averaging them
across ranks; the window's last step averages the sum."""

from __future__ import annotations


class Accumulation:
    def __init__(self, passes_per_step: int):
        self._per_step = passes_per_step  # steps with a backward per optimizer step
        self._done = 0  # of the current window

    @property
    def windowed(self) -> bool:
        """Whether gradients accumulate over several steps (backward_passes_per_step > 1)."""
        return self._per_step > 1

    @property
    def new_window(self) -> bool:
        """Whether the next backward starts a window (its gradients start from zero)."""
        return self._done == 0

    @property
    def last_of_window(self) -> bool:
        """Whether the next backward ends the window (its gradients are averaged across ranks)."""
        return self._done + 1 == self._per_step

    def backward_done(self) -> bool:
        """Counts a step that ran backward; whether it completed the window."""
        self._done = (self._done + 1) % self._per_step
        return self._done == 0
