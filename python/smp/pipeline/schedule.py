"""Pipeline schedules as data: the order in which one stage runs microbatch forwards and backwards.

An action is ("F", k), ("B", k) or ("W", k). F is the forward; B the backward (in "zero_bubble",
only its input-gradient part, whose result goes upstream at once); W the weight-gradient part
that "zero_bubble" splits from B and defers. Every stage runs forwards in microbatch order and
backwards in microbatch order, B(k) after F(k) and W(k) after B(k); any such per-stage lists are
deadlock-free together: sends never block, W neither sends nor waits for anything, and every
other wait is for a message that an earlier action of another stage sends (F(k) on stage s waits
for F(k) on s-1, B(k) for B(k) on s+1; order the actions of all stages by (kind, k) with every F
before the B's of the same k: each wait is on an action earlier in that order, so some stage can
always run its next action). The ordered message path (one tag, matched by posting order) keeps
this: both ends derive their posting order from these same lists (smp.pipeline.message_order).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

SCHEDULES = ("interleaved", "simple", "zero_bubble")


class Action(NamedTuple):
    kind: str  # "F", "B" or "W"
    microbatch: int


def stage_actions(
    schedule: str, stage: int, num_stages: int, microbatches: int, active_microbatches: int
) -> list[Action]:
    """The actions of `stage`.

    simple: all forwards, then all backwards (GPipe): every microbatch's activations
    are alive at once.
    interleaved: 1F1B. A stage starts at most min(active_microbatches, stages
    after it + 1) forwards before its first backward, then alternates, so at most that
    many microbatches hold activations at any time.
    zero_bubble: ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024). Each backward
    is split into B (input gradients, sent upstream at once) and W (weight gradients), and W is
    deferred to fill time a stage would otherwise wait. A microbatch holds activations from its F
    to its W; every stage holds at most as many as it holds under "interleaved", so no stage's
    peak is higher than interleaved's. What it gains is upstream stages getting gradients one
    W earlier per stage: 2(p-1) idle units instead of 1F1B's 3(p-1) (F = B = W = 1 unit).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"smp: unknown pipeline schedule {schedule!r}; use one of {SCHEDULES}")
    if microbatches < 1 or active_microbatches < 1:
        raise ValueError(
            f"smp: microbatches ({microbatches}) and active_microbatches ({active_microbatches}) must be >= 1"
        )
    forwards = [Action("F", k) for k in range(microbatches)]
    backwards = [Action("B", k) for k in range(microbatches)]
    if schedule == "simple":
        return forwards + backwards
    if schedule == "zero_bubble":
        return list(_zero_bubble(num_stages, microbatches, active_microbatches)[stage])
    in_flight = _in_flight_limit(stage, num_stages, microbatches, active_microbatches)
    actions = forwards[:in_flight]
    for k in range(in_flight, microbatches):
        actions += [backwards[k - in_flight], forwards[k]]
    actions += backwards[microbatches - in_flight :]
    return actions


def _in_flight_limit(stage: int, num_stages: int, microbatches: int, active_microbatches: int) -> int:
    return min(active_microbatches, num_stages - stage, microbatches)


@functools.lru_cache(maxsize=64)
def _zero_bubble(num_stages: int, microbatches: int, active: int) -> tuple[tuple[Action, ...], ...]:
    """Every stage's ZB-H1 actions, placed greedily in unit time (F, B and W one slot each): in each
    slot a stage runs its next B if the gradient it needs has arrived, else its next F if that
    one's input has arrived and fewer microbatches than interleaved's in-flight limit for the
    stage hold activations (F done, W not), else its oldest pending W. The lists are the result; the runtime
    then runs them in this order whatever the real durations are."""
    # Each stage holds at most the microbatches it holds under 1F1B, so its peak is no higher
    # than 1F1B's on every stage. (ZB-H1 in the paper lets later stages hold as many as the first,
    # bounding only the largest stage's count; with a last stage whose activations per microbatch
    # are larger (the logits), that raised the pipeline's peak, measured, above 1F1B's.)
    limits = [_in_flight_limit(s, num_stages, microbatches, active) for s in range(num_stages)]
    done_f, done_b, done_w = [0] * num_stages, [0] * num_stages, [0] * num_stages
    finished: dict[tuple[str, int, int], int] = {}
    actions: list[list[Action]] = [[] for _ in range(num_stages)]
    t = 0
    while any(w < microbatches for w in done_w):
        ran = []
        for s in range(num_stages):
            k = done_b[s]
            if k < done_f[s] and (s == num_stages - 1 or finished.get(("B", k, s + 1), t) < t):
                ran.append((s, Action("B", k)))
                continue
            k = done_f[s]
            if (
                k < microbatches
                and done_f[s] - done_w[s] < limits[s]
                and (s == 0 or finished.get(("F", k, s - 1), t) < t)
            ):
                ran.append((s, Action("F", k)))
            elif done_w[s] < done_b[s]:
                ran.append((s, Action("W", done_w[s])))
        for s, action in ran:
            finished[(action.kind, action.microbatch, s)] = t
            actions[s].append(action)
            counts = {"F": done_f, "B": done_b, "W": done_w}[action.kind]
            counts[s] += 1
        t += 1
    return tuple(tuple(a) for a in actions)


def unit_time_slots(
    schedule: str, num_stages: int, microbatches: int, active_microbatches: int
) -> list[list[Action | None]]:
    """Each stage's actions placed in time slots, every action one slot long: an action runs in
    the first slot after what it waits for (the previous stage's F k, the next stage's B k) and
    this stage's previous action. None is an idle slot (a bubble)."""
    todo = [
        stage_actions(schedule, s, num_stages, microbatches, active_microbatches) for s in range(num_stages)
    ]
    finished: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, stage) -> slot
    slots: list[list[Action | None]] = [[] for _ in range(num_stages)]
    t = 0
    while any(len(done) < len(actions) for done, actions in zip(_ran(slots), todo, strict=True)):
        ran = []
        for s, actions in enumerate(todo):
            n = len(_ran(slots)[s])
            action = actions[n] if n < len(actions) else None
            ready = action is not None and _inputs_ready(action, s, num_stages, finished, t)
            slots[s].append(action if ready else None)
            if ready:
                ran.append((s, action))
        if not ran:  # cannot happen for the schedules above; guards a future one
            raise RuntimeError(f"smp: schedule {schedule!r} deadlocks at slot {t}")
        for s, action in ran:
            finished[(action.kind, action.microbatch, s)] = t
        t += 1
    for row in slots:  # a stage that is done is not idle
        while row and row[-1] is None:
            row.pop()
    return slots


def _ran(slots: list[list[Action | None]]) -> list[list[Action]]:
    return [[a for a in row if a is not None] for row in slots]


def _inputs_ready(action: Action, stage: int, num_stages: int, finished: dict, t: int) -> bool:
    if action.kind == "F":
        needed = ("F", action.microbatch, stage - 1) if stage > 0 else None
    elif action.kind == "W":
        needed = None  # after this stage's own B, which ran earlier in its list
    else:
        needed = ("B", action.microbatch, stage + 1) if stage < num_stages - 1 else None
    return needed is None or finished.get(needed, t) < t


def render_text(schedule: str, num_stages: int, microbatches: int, active_microbatches: int) -> str:
    """The unit-time timeline as text: one row per stage, "F3"/"B3"/"W3" per slot, "." when idle."""
    slots = unit_time_slots(schedule, num_stages, microbatches, active_microbatches)
    width = len(f"B{microbatches - 1}")
    length = max(len(row) for row in slots)
    lines = []
    for s, row in enumerate(slots):
        cells = [f"{a.kind}{a.microbatch}" if a is not None else "." for a in row]
        lines.append(f"stage {s}: " + " ".join(c.ljust(width) for c in cells).rstrip())
    busy = sum(a is not None for row in slots for a in row)
    total = num_stages * length
    lines.append(f"{length} slots; idle {total - busy} of {total} stage-slots ({(total - busy) / total:.0%})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m smp.pipeline",
        description="Print a pipeline schedule's timeline (every action one time slot).",
    )
    p.add_argument("--pp", type=int, default=4, help="pipeline stages")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--schedule", choices=SCHEDULES, default="interleaved")
    p.add_argument("--active", type=int, default=None, help="active_microbatches (default: min(pp + 2, m))")
    args = p.parse_args(argv)
    active = args.active if args.active is not None else min(args.pp + 2, args.microbatches)
    print(render_text(args.schedule, args.pp, args.microbatches, active))
