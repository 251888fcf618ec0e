"""Receives posted one microbatch ahead, on the tagged message path.

Gloo sends a message only once its receive is posted (the sender announces it, the receiver
answers when it posts, then the data flows). A stage that posts a microbatch's receives when
that microbatch's action starts therefore waits a round trip and the transfer on every action;
on a 2-core CPU pipeline that was 3-7 % of the step. So each stage posts the receives of its next
forward at the end of a forward, and those of its next backward at the end of a backward (every
schedule runs a stage's F, B and W in microbatch order), and the data arrives while the stage
computes something else.

A receive is posted with the layout (values, shapes, tags) of the program that ran the previous
microbatch. A step's microbatches may run different programs (the step function calls the model
with other shapes), and every rank picks the same program for a microbatch, so both ends of a
link see a change the same way and settle what was posted for the old layout:
- the sender (`fill`): when its action of microbatch k runs another program than k - 1 did on
  its stage, it first sends placeholders (zeros) for what the receiver posted in k - 1's layout;
- the receiver (`drain`): waits for those and drops them, then posts k's own receives.
At the step's end the same happens for backward receives posted for a microbatch that ran no
backward. A stage runtime does the posting and sending; this object, one per rank and shared by
its programs, records who ran and who posted what.
"""

from __future__ import annotations

from typing import Protocol


class _Poster(Protocol):
    index: int

    def fill(self, kind: str, k: int) -> None: ...

    def drain(self, kind: str, k: int) -> None: ...


class Lookahead:
    def __init__(self, microbatches: int):
        self.microbatches = microbatches
        self._ran: dict[tuple[int, str, int], _Poster] = {}  # (stage, "F"/"B", k) -> its runtime
        self._posted: dict[tuple[int, str, int], _Poster] = {}  # early receives and who holds them

    def begin(self, runtime: _Poster, kind: str, k: int) -> bool:
        """`runtime` starts `kind` ("F" or "B") of microbatch k on its stage: settles what was posted
        or is owed in another program's layout; True if `runtime` posted k's receives already."""
        stage = runtime.index
        self._ran[(stage, kind, k)] = runtime
        previous = self._ran.get((stage, kind, k - 1))
        if previous is not None and previous is not runtime:
            previous.fill(kind, k)  # (the peers posted k in previous's layout)
        poster = self._posted.pop((stage, kind, k), None)
        if poster is not None and poster is not runtime:
            poster.drain(kind, k)
        return poster is runtime

    def ahead(self, runtime: _Poster, kind: str, k: int) -> int | None:
        """The microbatch whose `kind` receives `runtime` should post now, at the end of its `kind`
        of microbatch k (None: the last microbatch); noted as posted by it."""
        if k + 1 >= self.microbatches:
            return None
        self._posted[(runtime.index, kind, k + 1)] = runtime
        return k + 1

    def finish(self) -> None:
        """The step's end: placeholders for receives the peers posted for a backward that did not
        run (a microbatch with no model.backward), and this rank's such receives drained."""
        for (stage, kind, k), runtime in list(self._ran.items()):
            if k + 1 < self.microbatches and (stage, kind, k + 1) not in self._ran:
                runtime.fill(kind, k + 1)
        for (_, kind, k), runtime in self._posted.items():
            runtime.drain(kind, k)
        self._ran.clear()
        self._posted.clear()
