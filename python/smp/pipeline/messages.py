"""One pipeline rank's messages: the transfers of its lowered schedule (smp.schedules.lowering),
run as the executor reaches them, and what its stages' actions take from them. One object per
rank, shared by its programs (a step's microbatches may run different programs: each input
signature and train/eval mode has its own).

A transfer's bundle depends on the program. A SEND posts what its action computed, in the program
its microbatch ran. A RECV is posted in the layout of a program already chosen:
- tagged path: a receive posted ahead (for microbatch k, at the end of the stage's action for
  k - 1) in the program of k - 1, if k - 1 ran that kind here (called the model, or
  model.backward); any other receive by its own action, when its program is known (a receive
  left there is not posted if the action does not run: a microbatch without model.backward).
  Every rank picks the same program for a microbatch, so both ends see a change of program the
  same way and settle it: the sender, when the receiver posted in another program's layout than
  its microbatch's (or its action computed nothing: no model.backward), first sends placeholders
  (zeros) for what was posted; the receiver's action drains those and posts its own. Receives
  still posted at the step's end are drained.
- ordered path: every receive in the program of the step (the one every microbatch of the step
  must run: a change would break the order both ends post in), in its place; those before the
  rank's first action wait for that action to pick the program. A send whose action computed
  nothing sends placeholders, which the step's end drains.
Messages between two stages of this rank are handed over in memory (`local`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from smp import faults
from smp.pipeline.bundles import Message
from smp.pipeline.wire import Incoming, Wire
from smp.schedules.transfers import RECEIVES, Transfer

_COMPUTED_BY = {"F": "F", "O": "F", "B": "B"}  # which action computes a message of each letter
_warned_host_staging: list[bool] = []  # a CUDA pipeline on the tagged path says so once


def ordered_path(ordered_messages: bool | None, device: torch.device) -> bool:
    """Whether the pipeline's messages take the ordered path (config `ordered_messages`; None:
    for CUDA tensors). A CUDA pipeline on the tagged path warns once."""
    ordered = device.type == "cuda" if ordered_messages is None else ordered_messages
    if not ordered and device.type == "cuda" and not _warned_host_staging:
        _warned_host_staging.append(True)
        warnings.warn(
            "smp: pipeline activations on CUDA are staged through host memory and sent over Gloo "
            "(ordered_messages is false); set it to true (or leave it unset) to send them GPU to "
            "GPU over NCCL",
            stacklevel=3,
        )
    return ordered


class Messages:
    """`wire`: the rank's point-to-point operations, on the tagged or the ordered path."""

    def __init__(self, wire: Wire):
        self.wire = wire
        self.ordered, self.rank, self.device = wire.ordered, wire.rank, wire.device
        self.local: dict[Message, torch.Tensor] = {}  # handed over between this rank's stages
        # (letter, k, receiving stage) -> sending stage -> (the program posted in, [(value, receive)])
        self._posted: dict[tuple[str, int, int], dict[int, tuple[Any, list]]] = {}
        self._ran: set[tuple[str, int, int]] = set()  # ("F"/"B", k, stage) computed this step
        # The last action's results, (key, program, value name -> tensor): every SEND of an action
        # comes before the rank's next action.
        self._out: tuple[tuple[str, int, int], Any, dict[str, torch.Tensor]] | None = None
        self._program: Any = None  # ordered: the step's program
        self._waiting: list[Transfer] = []  # ordered: receives before the step's program is known

    # --- the executor's transfers --------------------------------------------------------

    def run(self, transfer: Transfer, microbatches: list) -> None:
        """Runs one transfer of the lowered schedule; `microbatches`: the step's, by index."""
        if transfer.kind in RECEIVES:
            self._receive(transfer, microbatches)
        else:
            self._send(transfer, microbatches)

    def _receive(self, transfer: Transfer, microbatches: list) -> None:
        """Posts a receive in the layout of a program already chosen, or leaves it (see above)."""
        letter, k = transfer.kind[-1], transfer.microbatch
        if self.ordered:
            program = self._program
            if program is None:
                self._waiting.append(transfer)
                return
        else:
            program = _ran(microbatches[k - 1 if transfer.ahead else k], letter)
            if program is None:
                return
        self._post(program, letter, k, transfer.stage, transfer.peer)

    def _send(self, transfer: Transfer, microbatches: list) -> None:
        """Sends what the action computed, after placeholders for what the receiver posted in
        another program's layout (or if the action computed nothing)."""
        letter, k, stage = transfer.kind[-1], transfer.microbatch, transfer.stage
        ran = (_COMPUTED_BY[letter], k, stage) in self._ran
        program = microbatches[k].runtime
        if self.ordered:
            posted = self._program
        elif transfer.ahead:
            posted = _ran(microbatches[k - 1], letter)
        else:
            posted = program if ran else None
        if posted is not None and (not ran or posted is not program):
            self._placeholders(posted, letter, k, stage, transfer.peer)
        if ran:
            self._send_computed(program, letter, k, stage, transfer.peer)

    def _post(self, program, letter: str, k: int, stage: int, sender: int) -> list:
        bundles = program.bundles
        values = bundles.bundle(letter, sender, stage)
        posted = [(v, self.wire.recv(v, bundles, sender, stage, letter, k)) for v in values]
        if posted:
            self._posted.setdefault((letter, k, stage), {})[sender] = (program, posted)
        return posted

    def _send_computed(self, program, letter: str, k: int, stage: int, receiver: int) -> None:
        key, computed_by, tensors = self._out if self._out is not None else (None, None, None)
        if key != (_COMPUTED_BY[letter], k, stage) or computed_by is not program:
            raise RuntimeError(
                f"smp: pipeline stage {stage} sends microbatch {k}'s messages after another action ran: "
                "the lowered schedule's order is broken (a bug in smp)"
            )
        for value in program.bundles.bundle(letter, stage, receiver):
            self.wire.send(tensors[value.name], program.bundles, stage, receiver, letter, k, value.name)

    def _placeholders(self, program, letter: str, k: int, stage: int, receiver: int) -> None:
        """Zeros for what `receiver` posted in `program`'s layout, which it then drains."""
        for value in program.bundles.bundle(letter, stage, receiver):
            zeros = torch.zeros(value.shape, dtype=value.dtype, device=self.device)
            self.wire.send(zeros, program.bundles, stage, receiver, letter, k, value.name)

    # --- what the stages' actions take and give ---------------------------------------------

    def begin(self, program) -> None:
        """A microbatch calls the model on this rank, in `program`. On the ordered path the step's
        first call picks the step's program and posts the receives that waited for it."""
        if not self.ordered:
            return
        if self._program is None:
            self._program = program
            self.wire.connect(sorted(_peers(program.bundles)))
            waiting, self._waiting = self._waiting, []
            for t in waiting:
                self._post(program, t.kind[-1], t.microbatch, t.stage, t.peer)
        elif program is not self._program:
            raise RuntimeError(
                "smp: with ordered_messages, every microbatch of a step must run one program (the same "
                "input shapes and train/eval modes), but this step's microbatches run different ones; "
                "give them the same shapes (pad them), or set ordered_messages to false (the tagged path "
                "settles such changes)"
            )

    def incoming(self, program, letter: str, k: int, stage: int) -> dict[tuple[int, str], Incoming]:
        """The receives of `stage`'s `letter` messages of microbatch k from other ranks, (sending
        stage, value name) -> receive: those posted in `program`'s layout, the rest posted now (after
        draining what was posted in another program's)."""
        posted = self._posted.pop((letter, k, stage), {})
        out = {}
        for sender in program.bundles.senders(letter, stage):
            entry = posted.pop(sender, None)
            if entry is None or entry[0] is not program:
                if entry is not None:
                    _drain(entry)
                if self.ordered:
                    raise RuntimeError(
                        f"smp: pipeline stage {stage} needs microbatch {k}'s messages from stage {sender}, "
                        "which the ordered path did not post: the lowered schedule is broken (a bug in smp)"
                    )
                entry = (program, self._post(program, letter, k, stage, sender))
            out.update(((sender, value.name), incoming) for value, incoming in entry[1])
        for entry in posted.values():  # posted in a layout whose senders this program lacks
            _drain(entry)
        return out

    def computed(self, letter: str, k: int, stage: int, program, tensors: dict[str, torch.Tensor]) -> None:
        """`stage`'s action `letter` ("F" or "B") of microbatch k computed `tensors` (value name ->
        what it sends: activations and outputs, or input gradients) for its SENDs."""
        self._ran.add((letter, k, stage))
        self._out = ((letter, k, stage), program, tensors)

    def finish(self) -> None:
        """The step's end: drains the receives still posted (their senders sent placeholders), waits
        for the sends. Once per step; a second call finds nothing left."""
        if self._waiting:
            left = self._waiting
            self._waiting = []
            raise RuntimeError(f"smp: pipeline rank {self.rank} never posted {left[:3]}: a bug in smp")
        posted, self._posted = self._posted, {}
        with faults.waiting(f"pipeline rank {self.rank} draining receives", self.wire.group_name()):
            for entries in posted.values():
                for entry in entries.values():
                    _drain(entry)
        self.wire.finish()
        self._ran.clear()
        self._out = None
        self._program = None
        self.local.clear()  # gradients for stages of this rank in a step that ran no backward


def _ran(microbatch, letter: str) -> Any:
    """The program microbatch ran its `letter`'s action in on this rank, if it ran it (F: called
    the model; B: model.backward); else None."""
    if letter == "B" and not microbatch.backward_calls:
        return None
    return microbatch.runtime


def _drain(entry: tuple[Any, list]) -> None:
    for _, incoming in entry[1]:
        incoming.wait()


def _peers(bundles) -> set[int]:
    """The ranks a program's stages on this rank exchange messages with."""
    layout, ranks, rank = bundles.layout, bundles.stage_ranks, bundles.rank
    peers = set()
    for src, dst in layout.activations | layout.gradients:
        ends = {ranks[src], ranks[dst]}
        if rank in ends:
            peers |= ends
    for src in layout.outputs:  # from the rank that computes them to every other rank
        peers |= set(range(max(ranks) + 1)) if ranks[src] == rank else {ranks[src]}
    return peers - {rank}
