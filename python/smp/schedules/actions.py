"""What a schedule is made of: actions, and what each waits for."""

from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # "F", "B" or "W"
    microbatch: int
    stage: int  # the pipeline stage it runs (a rank of "zero_bubble_v" runs two)


def waits_for(kind: str, k: int, stage: int, last_stage: int) -> tuple[str, int, int] | None:
    """The action whose message (kind, k) on `stage` waits for, as (kind, k, stage): the stage
    before's F k for an F, the stage after's B k for a B; None for the first stage's F, the last
    stage's B, and a W (it follows its own stage's B, earlier in its rank's list)."""
    if kind == "F" and stage > 0:
        return ("F", k, stage - 1)
    if kind == "B" and stage < last_stage:
        return ("B", k, stage + 1)
    return None
