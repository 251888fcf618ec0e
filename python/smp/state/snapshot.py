"""The moment a background save's copy of the state is complete.

A background save copies the model's buffers at the call and the parameters and optimizer state
in its thread, while the next step's forward and backward run: only the optimizer's step (and a
load) changes those, and they wait here first. The call itself then costs almost nothing.
"""

from __future__ import annotations

import threading

_copied = threading.Event()
_copied.set()  # nothing being copied


def begin() -> None:
    """A save starts copying in the background: what changes the state must wait."""
    _copied.clear()


def done() -> None:
    """The copy is complete (or failed: the save reports that itself)."""
    _copied.set()


def wait() -> None:
    """Returns once no background save is still copying the state (at once when none is)."""
    _copied.wait()
