"""What one program's stages exchange: its layout (which stage pairs send what) and, per pair, the
bundle of values a transfer posts (smp.schedules.transfers), in one order both ends use."""

from __future__ import annotations

import functools
from typing import NamedTuple

from smp.passes import PipelineGraph, Value
from smp.schedules.transfers import Layout

# A message's kind on the wire, in the tags of the tagged path (and the timeline's "what").
KIND_INDEX = {"F": 0, "O": 1, "B": 2}
KIND_NAMES = {"F": "activation", "O": "output", "B": "gradient"}


class Message(NamedTuple):
    """A message between two stages of one rank, handed over in memory."""

    src: int
    dst: int
    letter: str  # "F" (an activation) or "B" (a gradient)
    microbatch: int
    name: str


def layout_of(pipe: PipelineGraph) -> Layout:
    """The pairs of stages the split's values cross, forward and back, and where outputs come from."""
    values = pipe.values.values()
    return Layout(
        frozenset((v.src, dst) for v in values for dst in v.consumers),
        frozenset((dst, v.src) for v in values if v.requires_grad for dst in v.consumers),
        frozenset(v.src for v in values if v.is_output),
    )


class Bundles:
    """One program's bundles. `stage_ranks`: each stage's pipeline rank; `rank`: this rank's."""

    def __init__(self, pipe: PipelineGraph, stage_ranks: tuple[int, ...], rank: int, microbatches: int):
        self._values = [pipe.values[name] for name in sorted(pipe.values)]  # the one order
        self._value_id = {v.name: i for i, v in enumerate(self._values)}
        self.stage_ranks, self.rank, self._microbatches = stage_ranks, rank, microbatches
        self.layout = layout_of(pipe)

    @functools.cache  # noqa: B019 (one per program, which lives as long as its pipeline)
    def bundle(self, letter: str, sender: int, receiver: int) -> tuple[Value, ...]:
        """The values `sender` sends `receiver` as `letter` messages ("O": the model outputs it computes,
        to any other rank), in name order."""
        if letter == "F":
            return tuple(v for v in self._values if v.src == sender and receiver in v.consumers)
        if letter == "B":  # the gradients of the values `receiver` computed and `sender` read
            return tuple(
                v for v in self._values if v.src == receiver and sender in v.consumers and v.requires_grad
            )
        return tuple(v for v in self._values if v.src == sender and v.is_output)

    @functools.cache  # noqa: B019
    def senders(self, letter: str, stage: int) -> tuple[int, ...]:
        """The stages on other ranks whose `letter` messages `stage` receives ("O": to this rank)."""
        if letter == "O":
            found = sorted(self.layout.outputs)
        else:
            found = self.layout.senders(letter, stage)
        return tuple(s for s in found if self.stage_ranks[s] != self.rank and self.bundle(letter, s, stage))

    def tag(self, letter: str, k: int, name: str) -> int:
        """The tagged path's tag of `name`'s `letter` message of microbatch k."""
        return (KIND_INDEX[letter] * self._microbatches + k) * len(self._values) + self._value_id[name]
