"""The ordered message path: every message between two stages on ONE tag, posted by both ends in
one order they derive from the schedule data, as NCCL needs (it matches point-to-point operations
by issue order, not by tag; on CPU the same path runs over Gloo with one tag, which then matches
by order too, so the ordering is tested without GPUs).

The order. Every action of every rank gets its unit-time slot (smp.schedules.unit_time_slots: an
action's slot is after the slots of the actions whose messages it waits for). The messages an
action sends get its slot. Between two ranks, the messages in both directions of one slot form a
group (inside it: by sender, lower rank first, then in the order the sender's action sends them).
All groups of all pairs are in one global order: by slot, then by pair (lower rank, higher rank).
Each rank posts the operations of the groups it takes part in strictly in that order, so what a
rank has posted is always a prefix of its sequence, whatever the timing.

How they are posted: one isend or irecv each, not batch_isend_irecv. NCCL gives a pair's
unbatched operations their own two-rank communicator and stream, where they run in issue order;
inside a group both ends post the lower rank's sends first, so a send and a receive never wait on
each other. A batch would instead run on the whole group's one communicator and stream: every
operation of the rank, to any peer, queued behind the one before (torch.distributed.pipelining
stopped batching same-direction operations for that head-of-line blocking), and with one
communicator for all, the first batch would have to involve every rank of the group. Before the
first step every rank exchanges one element with each of its peers, in pair order, so that the
pair communicators (whose creation blocks until both ranks arrive) all exist before any stage
waits on a message.

Why it cannot deadlock, given the schedule lists cannot (smp.schedules). A rank posts up
to a group when one of its actions sends in it (at the action's end), or when it must wait for a
message in it. Every group before it has an earlier slot (or the same slot and a lower pair), so
its sends come from actions this rank already ran: slots grow along a rank's list, and a message
is always waited for in a later slot than it was sent in. So each rank's sends are ready when
their group is posted, and the first group of the global order not yet done is at the head of
its ranks' streams once both post it, which each does at the latest when it waits for a message
in it or in a later group. That holds even with one stream per rank for all its peers (a backend
that serializes everything), which tests/python/test_zero_bubble.py replays for every schedule up
to pp = 8; per-pair streams only remove waits.

Gradient messages exist only in steps that run model.backward; a step started with grad mode
off (evaluation under torch.no_grad()) leaves them out of its order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from smp.schedules import Action

ACTIVATION, OUTPUT, GRADIENT = range(3)


class Message(NamedTuple):
    src: int
    dst: int
    kind: int
    microbatch: int
    name: str


def sent_by(
    pipe, stage: int, kind: str, k: int, with_gradients: bool, ranks: tuple[int, ...]
) -> list[Message]:
    """The messages stage's action (kind, k) sends to other ranks (`ranks`: each stage's pipeline
    rank), in the order smp.pipeline.stage sends them. A model output goes to every other rank,
    addressed to its stage of the same index (stage r runs on rank r under every placement)."""
    values, out = pipe.values, []
    if kind == "F":
        for name in pipe.stages[stage].produced:
            value = values[name]
            out += [Message(stage, dst, ACTIVATION, k, name) for dst in value.consumers]
            if value.is_output:
                out += [Message(stage, r, OUTPUT, k, name) for r in sorted(set(ranks)) if r != ranks[stage]]
    elif kind == "B" and with_gradients:
        for name in pipe.stages[stage].received:
            value = values[name]
            if value.requires_grad:
                out.append(Message(stage, value.src, GRADIENT, k, name))
    return [m for m in out if ranks[m.src] != ranks[m.dst]]


def posting_order(
    pipe, rank: int, slots: list[list[Action | None]], ranks: tuple[int, ...], with_gradients: bool
) -> list[tuple[int, list[Message]]]:
    """The groups of messages between `rank` and the other ranks, (peer, messages) each, in the one
    global order every rank posts them in (see the module's docstring)."""
    by_key: dict[tuple[int, int, int], list[Message]] = {}  # (slot, low rank, high rank) -> group
    for row in slots:
        for t, action in enumerate(row):
            if action is None:
                continue
            for msg in sent_by(pipe, action.stage, action.kind, action.microbatch, with_gradients, ranks):
                src, dst = ranks[msg.src], ranks[msg.dst]
                if rank in (src, dst):
                    by_key.setdefault((t, min(src, dst), max(src, dst)), []).append(msg)
    order = []
    for (_, low, high), group in sorted(by_key.items()):
        group.sort(key=lambda m: ranks[m.src] != low)  # stable: the sender's own order inside
        order.append((high if low == rank else low, group))
    return order


class OrderedChannels:
    """One pipeline rank's ordered message path (shared by its stages): sends collected per action
    and posted with flush(), and receives posted group by group as the order says (see the
    module's docstring). `stage_ranks`: each stage's pipeline rank; `group_ranks`: each pipeline
    rank's global rank."""

    def __init__(self, pipe, rank: int, stage_ranks, group_ranks: list[int], group, device, slots):
        self._pipe, self._rank, self._group = pipe, rank, group
        self._stage_ranks, self._group_ranks = tuple(stage_ranks), group_ranks
        self._device = device
        self._slots = slots
        self._orders: dict[bool, list[tuple[int, list[Message]]]] = {}
        self._order: list[tuple[int, list[Message]]] | None = None
        self._connected = False
        self._reset()

    def _reset(self) -> None:
        self._order = None
        self._position: dict[Message, int] = {}  # message -> its group's place in the order
        self._next = 0  # the first group not yet posted
        self._outbox: dict[Message, torch.Tensor] = {}
        self._received: dict[Message, tuple[torch.Tensor, dist.Work]] = {}
        self._sends: list[dist.Work] = []

    def start(self, with_gradients: bool) -> None:
        """At a step's first message: this step's order (with gradients if it runs backward)."""
        if not self._connected:
            self._connect()
        self._order = self._order_for(with_gradients)
        self._position = {m: i for i, (_, group) in enumerate(self._order) for m in group}
        self._next = 0

    def _connect(self) -> None:
        """One element to or from every peer, in pair order (sorted peers: pairs (peer, rank) then
        (rank, peer)), each waited for: creates the pair communicators one at a time, in an order
        no two ranks can disagree on (see the module's docstring)."""
        peers = sorted({peer for peer, _ in self._order_for(True)})  # a training step's: every peer
        for peer in peers:
            token = torch.zeros(1, device=self._device)
            op = dist.isend if self._rank < peer else dist.irecv
            op(token, self._group_ranks[peer], self._group, tag=0).wait()
        self._connected = True

    def _order_for(self, with_gradients: bool) -> list[tuple[int, list[Message]]]:
        if with_gradients not in self._orders:
            self._orders[with_gradients] = posting_order(
                self._pipe, self._rank, self._slots, self._stage_ranks, with_gradients
            )
        return self._orders[with_gradients]

    @property
    def started(self) -> bool:
        return self._order is not None

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        self._check_known(msg)
        self._outbox[msg] = tensor

    def flush(self) -> None:
        """Posts the groups holding this action's sends (and every group before them)."""
        if self._outbox:
            self._advance(max(self._position[msg] for msg in self._outbox))

    def wait(self, msg: Message) -> torch.Tensor:
        """The received tensor of `msg`, posting its group (and earlier ones) first if need be."""
        self._check_known(msg)
        if msg not in self._received:
            self._advance(self._position[msg])
        buffer, work = self._received.pop(msg)
        work.wait()
        return buffer

    def finish_step(self) -> list[dist.Work]:
        """The step's sends to wait for; raises if the step left part of its order unposted."""
        if self._order is not None:
            left = sorted({peer for peer, _ in self._order[self._next :]})
            if left or self._received or self._outbox:
                self._reset()
                raise RuntimeError(
                    f"smp: pipeline rank {self._rank} ended a step with messages to or from ranks "
                    f"{left} not exchanged, which the ordered message path cannot match in a later "
                    "step; with grad mode on, call model.backward on every microbatch (run "
                    "forward-only steps under torch.no_grad())"
                )
        sends = self._sends
        self._reset()
        return sends

    def _check_known(self, msg: Message) -> None:
        if msg not in self._position:
            raise RuntimeError(
                f"smp: pipeline rank {self._rank}'s message {msg} is not in the order derived from "
                "the schedule (a step that runs model.backward must start with grad mode on)"
            )

    def _advance(self, upto: int) -> None:
        """Posts the groups of the order up to and including the `upto`-th."""
        for g in range(self._next, upto + 1):
            peer, group = self._order[g]
            for msg in group:
                if self._stage_ranks[msg.dst] == self._rank:
                    value = self._pipe.values[msg.name]
                    buffer = torch.empty(value.shape, dtype=value.dtype, device=self._device)
                    work = dist.irecv(buffer, self._group_ranks[peer], self._group, tag=0)
                    self._received[msg] = (buffer, work)
                else:
                    if msg not in self._outbox:
                        raise RuntimeError(
                            f"smp: pipeline rank {self._rank} must post {msg} before it is computed: "
                            "the schedule's message order is broken (a bug in smp)"
                        )
                    tensor = self._outbox.pop(msg)
                    self._sends.append(dist.isend(tensor, self._group_ranks[peer], self._group, tag=0))
            self._next = g + 1
