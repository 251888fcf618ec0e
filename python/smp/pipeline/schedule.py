"""Pipeline schedules as data: the order in which one stage runs microbatch forwards and backwards.

An action is ("F", k) or ("B", k). Every stage runs forwards in microbatch order
and backwards in microbatch order, and B(k) after F(k); any such per-stage lists
are deadlock-free together, because sends never block and every wait is for a
message that an earlier action of another stage sends.
"""

from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("interleaved", "simple")


class Action(NamedTuple):
    kind: str  # "F" or "B"
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
    in_flight = min(active_microbatches, num_stages - stage, microbatches)
    actions = forwards[:in_flight]
    for k in range(in_flight, microbatches):
        actions += [backwards[k - in_flight], forwards[k]]
    actions += backwards[microbatches - in_flight :]
    return actions


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
    else:
        needed = ("B", action.microbatch, stage + 1) if stage < num_stages - 1 else None
    return needed is None or finished.get(needed, t) < t


def render_text(schedule: str, num_stages: int, microbatches: int, active_microbatches: int) -> str:
    """The unit-time timeline as text: one row per stage, "F3"/"B3" per slot, "." when idle."""
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
