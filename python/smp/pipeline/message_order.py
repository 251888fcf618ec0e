"""The ordered message path: every message between two stages on ONE tag, posted by both ends in
one order they derive from the schedule data, as NCCL needs (it matches point-to-point operations
by issue order, not by tag; on CPU the same path runs over Gloo with one tag, which then matches
by order too, so the ordering is tested without GPUs).

The order. Every action of every rank gets its unit-time slot (schedule.unit_time_slots: an
action's slot is after the slots of the actions whose messages it waits for). The messages an
action sends get its slot. For each pair of ranks, their messages in both directions are grouped
by slot, groups in slot order, and inside a group by sender, then in the order the sender's action
sends them. Both ends post a group's operations together (batch_isend_irecv: a send and a receive
that would otherwise wait on each other go out at once) and groups strictly in order. Messages
between two stages of one rank ("zero_bubble_v") never leave it and are not in the order.

Why it cannot deadlock, given the schedule lists cannot (smp.pipeline.schedule). A rank posts a
group when one of its actions sends in it, or when it must wait for a message in it (then every
earlier group is posted first: its receives, and its sends, which earlier actions of this rank
already made, because slots grow along a rank's list and a message is always waited for in a
later slot than it was sent in). So each rank's own sends are always ready when their group is
posted, both ends post the same groups in the same order, and every wait is for a message whose
sending action the tagged path would also have run first.

Gradient messages exist only in steps that run model.backward; a step started with grad mode
off (evaluation under torch.no_grad()) leaves them out of its order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from smp.pipeline import schedule

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


def peer_groups(
    pipe, rank: int, slots: list[list[schedule.Action | None]], ranks: tuple[int, ...], with_gradients: bool
) -> dict[int, list[list[Message]]]:
    """For each other pipeline rank: the groups of messages between it and `rank`, in posting order."""
    by_slot: dict[int, dict[int, list[Message]]] = {}  # peer -> slot -> messages
    for row in slots:
        for t, action in enumerate(row):
            if action is None:
                continue
            for msg in sent_by(pipe, action.stage, action.kind, action.microbatch, with_gradients, ranks):
                src, dst = ranks[msg.src], ranks[msg.dst]
                if rank in (src, dst):
                    peer = dst if src == rank else src
                    by_slot.setdefault(peer, {}).setdefault(t, []).append(msg)
    return {
        peer: [sorted(groups[t], key=lambda m: ranks[m.src] != min(rank, peer)) for t in sorted(groups)]
        for peer, groups in by_slot.items()
    }


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
        self._orders: dict[bool, dict[int, list[list[Message]]]] = {}
        self._groups: dict[int, list[list[Message]]] | None = None
        self._reset()

    def _reset(self) -> None:
        self._groups = None
        self._group_of: dict[Message, int] = {}
        self._next: dict[int, int] = {}  # peer -> its first group not yet posted
        self._outbox: dict[Message, torch.Tensor] = {}
        self._received: dict[Message, tuple[torch.Tensor, dist.Work]] = {}
        self._sends: list[dist.Work] = []

    def start(self, with_gradients: bool) -> None:
        """At a step's first message: this step's order (with gradients if it runs backward)."""
        if with_gradients not in self._orders:
            self._orders[with_gradients] = peer_groups(
                self._pipe, self._rank, self._slots, self._stage_ranks, with_gradients
            )
        self._groups = self._orders[with_gradients]
        self._group_of = {m: i for groups in self._groups.values() for i, g in enumerate(groups) for m in g}
        self._next = dict.fromkeys(self._groups, 0)

    @property
    def started(self) -> bool:
        return self._groups is not None

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        self._check_known(msg)
        self._outbox[msg] = tensor

    def flush(self) -> None:
        """Posts the groups holding this action's sends (and every group before them)."""
        last: dict[int, int] = {}
        for msg in self._outbox:
            peer = self._stage_ranks[msg.dst]
            last[peer] = max(last.get(peer, -1), self._group_of[msg])
        for peer, upto in sorted(last.items()):
            self._advance(peer, upto)

    def wait(self, msg: Message) -> torch.Tensor:
        """The received tensor of `msg`, posting its group (and earlier ones) first if need be."""
        self._check_known(msg)
        if msg not in self._received:
            self._advance(self._stage_ranks[msg.src], self._group_of[msg])
        buffer, work = self._received.pop(msg)
        work.wait()
        return buffer

    def finish_step(self) -> list[dist.Work]:
        """The step's sends to wait for; raises if the step left part of its order unposted."""
        if self._groups is not None:
            left = [p for p, groups in self._groups.items() if self._next[p] < len(groups)]
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
        if msg not in self._group_of:
            raise RuntimeError(
                f"smp: pipeline rank {self._rank}'s message {msg} is not in the order derived from "
                "the schedule (a step that runs model.backward must start with grad mode on)"
            )

    def _advance(self, peer: int, upto: int) -> None:
        groups = self._groups[peer]
        for g in range(self._next[peer], upto + 1):
            ops, received = [], []
            for msg in groups[g]:
                if self._stage_ranks[msg.dst] == self._rank:
                    value = self._pipe.values[msg.name]
                    buffer = torch.empty(value.shape, dtype=value.dtype, device=self._device)
                    ops.append(dist.P2POp(dist.irecv, buffer, self._group_ranks[peer], self._group, tag=0))
                    received.append((msg, buffer))
                else:
                    if msg not in self._outbox:
                        raise RuntimeError(
                            f"smp: pipeline rank {self._rank} must post {msg} before it is computed: "
                            "the schedule's message order is broken (a bug in smp)"
                        )
                    tensor = self._outbox.pop(msg)
                    ops.append(dist.P2POp(dist.isend, tensor, self._group_ranks[peer], self._group, tag=0))
            works = _post(ops)
            self._next[peer] = g + 1
            for op, work in zip(ops, works, strict=True):
                if op.op is dist.isend:
                    self._sends.append(work)
            by_buffer = {id(op.tensor): work for op, work in zip(ops, works, strict=True)}
            for msg, buffer in received:
                self._received[msg] = (buffer, by_buffer[id(buffer)])


def _post(ops: list) -> list:
    """A group's operations at once: NCCL runs them as one group, so a send and a receive that
    wait on each other cannot deadlock; Gloo posts them in this order (sends do not block)."""
    if not ops:
        return []
    if ops[0].tensor.is_cuda:
        return dist.batch_isend_irecv(ops)
    # Gloo: batch_isend_irecv gives no work per operation there; posting one by one in the
    # group's order is the same to Gloo, whose sends do not wait for the receiver.
    return [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
