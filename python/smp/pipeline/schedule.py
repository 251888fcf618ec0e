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
