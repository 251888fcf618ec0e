"""The communication actions of a lowered schedule, and the layouts they are lowered for.

A Transfer posts the messages of one bundle: what one stage's action sends to one stage on another
rank (a bundle holds every value of that pair, in one order both ends know). Three kinds of
message, named by the letter the kinds end in:
- F: activations, sent by the F of the stage that computes them to the F of each stage that reads
  them;
- O: the model's outputs, sent by the F of the stage that computes them to every other rank (to
  its stage of the rank's own index, stage r being on rank r under every placement), which reads
  them when its microbatch resumes after its forward (at its B of the rank's last stage);
- B: input gradients, sent by the B of the reading stage back to the B of the computing stage.

A SEND posts its bundle once its action has computed it; a RECV posts the receives, which its
action waits for. Messages between two stages of one rank are no transfers: they are handed over
in memory, the schedule running the sender first.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

SENDS = ("SEND_F", "SEND_O", "SEND_B")
RECEIVES = ("RECV_F", "RECV_O", "RECV_B")
KINDS = SENDS + RECEIVES


class Transfer(NamedTuple):
    kind: str  # one of KINDS
    microbatch: int
    stage: int  # this rank's stage: the sender's for a SEND, the receiver's for a RECV
    peer: int  # the stage at the other end
    # On the tagged path, a receive posted one microbatch ahead, in the layout of the program that
    # ran microbatch - 1 (the program of its own microbatch is not known yet); a SEND says the same
    # of the receive it answers. False: posted in the program of its own microbatch.
    ahead: bool = False

    @property
    def message(self) -> tuple[str, int, int, int]:
        """(letter, microbatch, sending stage, receiving stage): the same for a SEND and its RECV."""
        letter = self.kind[-1]
        if self.kind in SENDS:
            return (letter, self.microbatch, self.stage, self.peer)
        return (letter, self.microbatch, self.peer, self.stage)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which stages exchange messages: the pairs (sending stage, receiving stage) of activations and
    of gradients, and the stages that compute model outputs. Pairs on one rank are included (the
    schedule must run their sender first); transfers are made for pairs across ranks only."""

    activations: frozenset[tuple[int, int]]
    gradients: frozenset[tuple[int, int]]
    outputs: frozenset[int]

    @staticmethod
    def chain(num_stages: int) -> Layout:
        """Each stage reads the one before; the last computes the outputs (what a schedule's lists
        are made for, and their unit-time slots are placed with)."""
        return Layout(
            frozenset((s, s + 1) for s in range(num_stages - 1)),
            frozenset((s + 1, s) for s in range(num_stages - 1)),
            frozenset({num_stages - 1}),
        )

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def complete(num_stages: int) -> Layout:
        """Every pair a split can exchange: any stage reading any earlier one, every stage computing
        outputs. A program's own layout is part of it, so its lowering serves every program: the
        transfers a program's layout lacks post nothing."""
        pairs = [(a, b) for a in range(num_stages) for b in range(a + 1, num_stages)]
        return Layout(frozenset(pairs), frozenset((b, a) for a, b in pairs), frozenset(range(num_stages)))

    def senders(self, letter: str, stage: int) -> list[int]:
        """The stages whose `letter` ("F" or "B") messages `stage` receives, in stage order."""
        pairs = self.activations if letter == "F" else self.gradients
        return sorted(src for src, dst in pairs if dst == stage)

    def receivers(self, letter: str, stage: int) -> list[int]:
        """The stages that receive `stage`'s `letter` ("F" or "B") messages, in stage order."""
        pairs = self.activations if letter == "F" else self.gradients
        return sorted(dst for src, dst in pairs if src == stage)
