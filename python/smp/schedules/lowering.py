"""Lowering: a rank's F, B and W actions made into the one list its executor runs, with the
transfers (smp.schedules.transfers) placed among them. Two placements, one per message path:

- tagged (Gloo, each message tagged by microbatch and value, so receives match in any order):
  Gloo moves a message only once its receive is posted (the sender announces it, the receiver
  answers, then the data flows), so a receive posted when its action starts costs a round trip
  and the transfer on every action (docs/benchmarks.md, "receives posted a microbatch ahead").
  A stage's receives for microbatch k + 1 are therefore posted at the end of its action of the
  same kind for k (every schedule runs a stage's F, B and W in microbatch order), in the layout
  of k's program; microbatch 0's just before its action. Sends follow the action that computes
  them.
- ordered (NCCL, which matches a pair's operations by issue order; one tag on Gloo): both ends of
  every pair must post their messages in one order. Every message gets the unit-time slot of
  the action that sends it (smp.schedules.unit_time_slots); all messages are in one global order,
  by slot, then pair (lower rank, higher rank), then the lower rank's sends first, then in the
  order the sending action sends them; each rank posts its own in that order, as early as it
  allows: a send right after its action, a receive after the last action of its rank whose slot
  is not later than the send's. A rank's messages are then a prefix of that order at any time,
  which holds even where one stream runs all of a rank's operations (smp.schedules.simulation
  replays it so).

Both are made once per (schedule, rank, layout, path, whether the step runs backward: a step
without it has no gradient messages), by Schedule.program, and checked for deadlock by simulating
every rank's lowered list in unit time (Schedule.check).
"""

from __future__ import annotations

from smp.schedules.actions import Action
from smp.schedules.transfers import Layout, Transfer

Lowered = tuple[Action | Transfer, ...]


def sends(action: Action, layout: Layout, stage_ranks: tuple[int, ...], with_gradients: bool, ahead: bool):
    """The transfers that post what `action` computes for stages on other ranks."""
    kind, k, stage = action
    rank = stage_ranks[stage]
    if kind == "F":
        out = [Transfer("SEND_F", k, stage, d, ahead) for d in layout.receivers("F", stage)]
        if stage in layout.outputs:  # to every other rank's stage of its own index
            out += [Transfer("SEND_O", k, stage, q) for q in range(max(stage_ranks) + 1)]
    elif kind == "B" and with_gradients:
        out = [Transfer("SEND_B", k, stage, d, ahead) for d in layout.receivers("B", stage)]
    else:
        return []
    return [t for t in out if stage_ranks[t.peer] != rank]


def receives(letter: str, k: int, stage: int, layout: Layout, stage_ranks: tuple[int, ...], ahead: bool):
    """The transfers that post the receives of `letter` ("F" or "B") of microbatch k on `stage`."""
    rank = stage_ranks[stage]
    kind = "RECV_" + letter
    peers = [p for p in layout.senders(letter, stage) if stage_ranks[p] != rank]
    return [Transfer(kind, k, stage, p, ahead) for p in peers]


def output_receives(k: int, rank: int, layout: Layout, stage_ranks: tuple[int, ...]) -> list[Transfer]:
    """The receives of microbatch k's model outputs computed on other ranks, by this rank's stage of
    its own index."""
    return [Transfer("RECV_O", k, rank, src) for src in sorted(layout.outputs) if stage_ranks[src] != rank]


def tagged(
    actions: list[Action],
    rank: int,
    stage_ranks: tuple[int, ...],
    layout: Layout,
    microbatches: int,
    with_gradients: bool,
) -> Lowered:
    """The tagged path's lowered list of `rank` (see the module's docstring)."""
    last = max(s for s, r in enumerate(stage_ranks) if r == rank)  # the outputs arrive after its F
    out: list[Action | Transfer] = []
    for action in actions:
        kind, k, stage = action
        if kind == "W" or (kind == "B" and not with_gradients):
            out.append(action)
            continue
        if k == 0:  # nothing ran before it to post them ahead
            out += receives(kind, 0, stage, layout, stage_ranks, ahead=False)
        out.append(action)
        out += sends(action, layout, stage_ranks, with_gradients, ahead=k > 0)
        if k + 1 < microbatches:
            out += receives(kind, k + 1, stage, layout, stage_ranks, ahead=True)
        if kind == "F" and stage == last:
            out += output_receives(k, rank, layout, stage_ranks)
    return tuple(out)


def ordered(
    slots: list[list[Action | None]],
    rank: int,
    stage_ranks: tuple[int, ...],
    layout: Layout,
    with_gradients: bool,
) -> Lowered:
    """The ordered path's lowered list of `rank` (see the module's docstring)."""
    ops = []  # (key, transfer) for every message this rank sends or receives
    for sender, row in enumerate(slots):
        for t, action in enumerate(row):
            if action is None:
                continue
            for i, send in enumerate(sends(action, layout, stage_ranks, with_gradients, ahead=False)):
                receiver = stage_ranks[send.peer]
                if rank not in (sender, receiver):
                    continue
                low, high = min(sender, receiver), max(sender, receiver)
                key = (t, low, high, sender != low, i)
                if sender == rank:
                    ops.append((key, send))
                else:
                    letter, k, src, dst = send.message
                    ops.append((key, Transfer("RECV_" + letter, k, dst, src)))
    ops.sort(key=lambda op: op[0])
    out: list[Action | Transfer] = []
    i = 0
    for t, action in enumerate(slots[rank]):
        if action is None:
            continue
        while i < len(ops) and ops[i][0][0] < t:  # received before this action's slot
            out.append(ops[i][1])
            i += 1
        out.append(action)
        while i < len(ops) and ops[i][0][0] <= t:  # its sends, and what arrives in its slot
            out.append(ops[i][1])
            i += 1
    out += [op for _, op in ops[i:]]
    return tuple(out)
