"""Pipeline schedules as data: the order in which one pipeline rank runs microbatch forwards and
backwards on its stage(s).

An action is (kind, microbatch, stage), kind "F", "B" or "W". F is the forward; B the backward (in
"zero_bubble" and "zero_bubble_v", only its input-gradient part, whose result goes upstream at
once); W the weight-gradient part that those schedules split from B and defer. Every schedule
but "zero_bubble_v" runs one stage per rank (stage r on rank r); "zero_bubble_v" runs two, in a V:
rank r holds stages r and 2p-1-r, so the first rank also holds the last stage.

Why the lists cannot deadlock. Sends never block, W neither sends nor waits for anything, and
every other wait is for a message that an action of another stage sends (F(k) on stage s waits
for F(k) on s-1, B(k) for B(k) on s+1). Every schedule's lists are checked by placing them in unit
time (unit_time_slots: each action in the first slot after its rank's previous action and after
the actions it waits for; the simulation raises if no rank can move), so each action waits only
for actions of strictly earlier slots. Run with any real durations, a stuck pipeline would have
every stuck rank waiting at an action whose awaited action sits on another stuck rank behind an
action of a slot no later than its own, so strictly earlier than the waiter's: slots would fall
forever along that chain, which a finite list cannot do. The ordered message path (one tag,
matched by posting order) keeps this: both ends derive their posting order from these same slots
(smp.pipeline.message_order).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from smp.config import PIPELINE_SCHEDULES, pipeline_stages

SCHEDULES = tuple(PIPELINE_SCHEDULES)
# Schedules whose backward is split into B and W.
SPLIT_BACKWARD = ("zero_bubble", "zero_bubble_v")


class Action(NamedTuple):
    kind: str  # "F", "B" or "W"
    microbatch: int
    stage: int  # the pipeline stage it runs (a rank of "zero_bubble_v" runs two)


def num_stages(schedule: str, num_ranks: int) -> int:
    """How many stages the model is cut into for `num_ranks` pipeline ranks (see stage_ranks)."""
    _check_schedule(schedule)
    return pipeline_stages(schedule, num_ranks)


def stage_ranks(schedule: str, num_ranks: int) -> tuple[int, ...]:
    """The pipeline rank of every stage: one stage per rank, or for "zero_bubble_v" (with more than
    one rank) two in a V, rank r holding stages r and 2p-1-r. Stage r is on rank r either way."""
    if num_stages(schedule, num_ranks) == num_ranks:
        return tuple(range(num_ranks))
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


def rank_stages(schedule: str, rank: int, num_ranks: int) -> tuple[int, ...]:
    """The stages `rank` runs, in pipeline order."""
    return tuple(s for s, r in enumerate(stage_ranks(schedule, num_ranks)) if r == rank)


def rank_actions(
    schedule: str, rank: int, num_ranks: int, microbatches: int, active_microbatches: int
) -> list[Action]:
    """The actions of pipeline rank `rank`.

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
    zero_bubble_v: ZB-V (the same paper, section 6): the model cut into 2p stages, rank r running
    stages r and 2p-1-r, each backward split into B and W as above. A rank holds at most
    2 * min(active_microbatches, p, m) stage-microbatches (F done, W not); each stage being half
    the size of a one-stage-per-rank stage, that is about the activations the first rank holds
    under "interleaved", on every rank (measured: 0.94-1.07x its peak at p = 4, m = 8, 4 active).
    With F = B = W = 1 unit per half-size stage, a step takes 6m + 1 units per rank at p = 2
    (m = 4: 25 slots against 1F1B's 30 of the same units; m = 8: 49 against 54) and 6m + 4 at
    p = 4, m = 8 (52 against 66).
    """
    _check_schedule(schedule)
    if microbatches < 1 or active_microbatches < 1:
        raise ValueError(
            f"smp: microbatches ({microbatches}) and active_microbatches ({active_microbatches}) must be >= 1"
        )
    if not 0 <= rank < num_ranks:
        raise ValueError(f"smp: pipeline rank {rank} is outside [0, {num_ranks})")
    if schedule == "zero_bubble_v" and num_ranks > 1:
        return list(_zero_bubble_v(num_ranks, microbatches, active_microbatches)[rank])
    forwards = [Action("F", k, rank) for k in range(microbatches)]
    backwards = [Action("B", k, rank) for k in range(microbatches)]
    if schedule == "simple":
        return forwards + backwards
    if schedule in SPLIT_BACKWARD:
        return list(_zero_bubble(num_ranks, microbatches, active_microbatches)[rank])
    in_flight = _in_flight_limit(rank, num_ranks, microbatches, active_microbatches)
    actions = forwards[:in_flight]
    for k in range(in_flight, microbatches):
        actions += [backwards[k - in_flight], forwards[k]]
    actions += backwards[microbatches - in_flight :]
    return actions


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"smp: unknown pipeline schedule {schedule!r}; use one of {SCHEDULES}")


def _in_flight_limit(stage: int, num_stages: int, microbatches: int, active_microbatches: int) -> int:
    return min(active_microbatches, num_stages - stage, microbatches)


@functools.lru_cache(maxsize=64)
def _zero_bubble(num_stages: int, microbatches: int, active: int) -> tuple[tuple[Action, ...], ...]:
    """Every stage's ZB-H1 actions (_greedy with one stage per rank and interleaved's in-flight
    limit per stage)."""
    # Each stage holds at most the microbatches it holds under 1F1B, so its peak is no higher
    # than 1F1B's on every stage. (ZB-H1 in the paper lets later stages hold as many as the first,
    # bounding only the largest stage's count; with a last stage whose activations per microbatch
    # are larger (the logits), that raised the pipeline's peak, measured, above 1F1B's.)
    limits = tuple(_in_flight_limit(s, num_stages, microbatches, active) for s in range(num_stages))
    return _greedy(tuple((s,) for s in range(num_stages)), microbatches, limits)


@functools.lru_cache(maxsize=64)
def _zero_bubble_v(num_ranks: int, microbatches: int, active: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's ZB-V actions (_greedy over the V placement). The limit counts stage-
    microbatches, two per microbatch of a one-stage-per-rank pipeline (see rank_actions)."""
    last = 2 * num_ranks - 1
    held = tuple((r, last - r) for r in range(num_ranks))
    limit = 2 * min(active, num_ranks, microbatches)
    return _greedy(held, microbatches, (limit,) * num_ranks)


# The orders of preference _greedy tries: B first keeps gradients flowing upstream; F first
# starts microbatches sooner (better where the limit still allows it); W first frees memory.
_PREFERENCES = ("BFW", "FBW", "BWF")


class Costs(NamedTuple):
    """The durations a schedule is placed with, in units of a stage's F."""

    b: float
    w: float

    def of(self, action: Action) -> float:
        if action.kind == "F":
            return 1.0
        if action.stage == 0:  # receives no values: its B does nothing, its W is its whole backward
            return 0.0 if action.kind == "B" else self.b + self.w
        return self.b if action.kind == "B" else self.w


# The paper's unit model, and what the split at the linear layers costs (measured on a transformer
# stage on CPU: B 1.0-1.1x its F, W 0.61-0.66x; docs/benchmarks.md). W is the linears' weight
# products alone, cheaper than B, which also runs attention's and the elementwise ops' backward.
_UNIT = Costs(1.0, 1.0)
_MEASURED = Costs(1.0, 2 / 3)


def _greedy(
    held: tuple[tuple[int, ...], ...], microbatches: int, limits: tuple[int, ...]
) -> tuple[tuple[Action, ...], ...]:
    """Of _place's schedules over the orders of preference in _PREFERENCES, each placed with both
    cost models, the one that runs shortest with the measured costs (then with unit costs; then
    the first). Any of them is correct: the choice only moves idle time."""
    candidates = [
        _place(held, microbatches, limits, order, costs)
        for costs in (_UNIT, _MEASURED)
        for order in _PREFERENCES
    ]
    return min(candidates, key=lambda lists: (_makespan(lists, _MEASURED), _makespan(lists, _UNIT)))


def _makespan(lists: tuple[tuple[Action, ...], ...], costs: Costs) -> float:
    """How long the ranks' lists take, run in order, each action starting once its rank is free and
    what it waits for (F(k) of the stage before, B(k) of the stage after) has ended."""
    last = max(a.stage for actions in lists for a in actions)
    ended: dict[tuple[str, int, int], float] = {}
    at, free = [0] * len(lists), [0.0] * len(lists)
    while any(i < len(actions) for i, actions in zip(at, lists, strict=True)):
        for r, actions in enumerate(lists):
            while at[r] < len(actions):
                a = actions[at[r]]
                needed = _waits_for(a.kind, a.microbatch, a.stage, last)
                if needed is not None and needed not in ended:
                    break
                start = max(free[r], ended[needed] if needed is not None else 0.0)
                ended[(a.kind, a.microbatch, a.stage)] = free[r] = start + costs.of(a)
                at[r] += 1
    return max(free)


def _place(
    held: tuple[tuple[int, ...], ...], microbatches: int, limits: tuple[int, ...], order: str, costs: Costs
) -> tuple[tuple[Action, ...], ...]:
    """Actions placed greedily in time for ranks holding the stages `held` (a stage's index is its
    place in the pipeline), each rank in turn from the earliest free one.
    A rank that is free runs the first kind in `order` it can: a B whose gradient has arrived; an
    F whose input has arrived while the rank holds fewer than its limit of stage-microbatches (F
    done, W not; a rank holding several stages keeps a place for each later stage's F, so that a
    microbatch it has started can always go on); its oldest pending W; the oldest microbatch
    first, then the later stage (which brings a microbatch to its loss sooner). If none can run,
    it waits for the next action to end.

    Actions take what `costs` says (on the first stage, which receives no values and so sends no
    gradient, B does nothing and W is its whole backward: smp.pipeline.split_backward). The lists
    are the result; the runtime then runs them in this order whatever the real durations are."""
    last = max(max(stages) for stages in held)
    done = {kind: [0] * (last + 1) for kind in "FBW"}
    finished: dict[tuple[str, int, int], float] = {}  # (kind, k, stage) -> when it ends
    actions: list[list[Action]] = [[] for _ in held]
    free = [0.0] * len(held)  # when each rank can start its next action
    total = 3 * microbatches * sum(len(stages) for stages in held)

    def arrived(kind: str, k: int, s: int, t: float) -> bool:  # what (kind, k) on s waits for is done
        needed = _waits_for(kind, k, s, last)
        return needed is None or finished.get(needed, t + 1) <= t

    def choose(rank: int, t: float) -> Action | None:
        stages = sorted(held[rank], reverse=True)  # the later stage first
        holding = sum(done["F"][s] - done["W"][s] for s in stages)
        ready = {
            "B": [
                Action("B", done["B"][s], s)
                for s in stages
                if done["B"][s] < done["F"][s] and arrived("B", done["B"][s], s, t)
            ],
            "F": [
                Action("F", done["F"][s], s)
                for i, s in enumerate(stages)  # i: this rank's stages after s, each kept a place
                if done["F"][s] < microbatches
                and holding + i < limits[rank]
                and arrived("F", done["F"][s], s, t)
            ],
            "W": [Action("W", done["W"][s], s) for s in stages if done["W"][s] < done["B"][s]],
        }
        return next((min(ready[kind], key=lambda a: a.microbatch) for kind in order if ready[kind]), None)

    while len(finished) < total:
        busy = [r for r in range(len(held)) if len(actions[r]) < 3 * microbatches * len(held[r])]
        t = min(free[r] for r in busy)
        for rank in (r for r in busy if free[r] == t):
            choice = choose(rank, t)
            if choice is not None:
                finished[(choice.kind, choice.microbatch, choice.stage)] = free[rank] = t + costs.of(choice)
                actions[rank].append(choice)
                done[choice.kind][choice.stage] += 1
                break
        else:  # no rank free now can run anything: they wait for the next end or start
            later = [end for end in finished.values() if end > t] + [free[r] for r in busy if free[r] > t]
            if not later:
                raise RuntimeError(f"smp: the greedy schedule for stages {held} deadlocks at time {t}")
            for r in busy:
                free[r] = max(free[r], min(later))
    return tuple(tuple(a) for a in actions)


def unit_time_slots(
    schedule: str, num_ranks: int, microbatches: int, active_microbatches: int
) -> list[list[Action | None]]:
    """Each rank's actions placed in time slots, every action one slot long: an action runs in
    the first slot after what it waits for (the previous stage's F k, the next stage's B k) and
    this rank's previous action. None is an idle slot (a bubble)."""
    last = num_stages(schedule, num_ranks) - 1
    todo = [rank_actions(schedule, r, num_ranks, microbatches, active_microbatches) for r in range(num_ranks)]
    finished: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, stage) -> slot
    slots: list[list[Action | None]] = [[] for _ in range(num_ranks)]
    ran_count = [0] * num_ranks
    t = 0
    while any(n < len(actions) for n, actions in zip(ran_count, todo, strict=True)):
        ran = []
        for r, actions in enumerate(todo):
            n = ran_count[r]
            action = actions[n] if n < len(actions) else None
            ready = action is not None and _inputs_ready(action, last, finished, t)
            slots[r].append(action if ready else None)
            if ready:
                ran.append(action)
                ran_count[r] += 1
        if not ran:
            raise RuntimeError(f"smp: schedule {schedule!r} deadlocks at slot {t}")
        for action in ran:
            finished[(action.kind, action.microbatch, action.stage)] = t
        t += 1
    for row in slots:  # a rank that is done is not idle
        while row and row[-1] is None:
            row.pop()
    return slots


def _inputs_ready(action: Action, last_stage: int, finished: dict, t: int) -> bool:
    needed = _waits_for(action.kind, action.microbatch, action.stage, last_stage)
    return needed is None or finished.get(needed, t) < t


def _waits_for(kind: str, k: int, stage: int, last_stage: int) -> tuple[str, int, int] | None:
    """The action whose message (kind, k) on `stage` waits for, as (kind, k, stage): the stage
    before's F k for an F, the stage after's B k for a B; None for the first stage's F, the last
    stage's B, and a W (it follows its own stage's B, earlier in its rank's list)."""
    if kind == "F" and stage > 0:
        return ("F", k, stage - 1)
    if kind == "B" and stage < last_stage:
        return ("B", k, stage + 1)
    return None


def render_text(schedule: str, num_ranks: int, microbatches: int, active_microbatches: int) -> str:
    """The unit-time timeline as text: one row per rank, "F3"/"B3"/"W3" per slot, "." when idle.
    Where a rank runs two stages, the later one's actions are lower case ("f3", "b3", "w3")."""
    slots = unit_time_slots(schedule, num_ranks, microbatches, active_microbatches)
    ranks = stage_ranks(schedule, num_ranks)
    two = len(ranks) > num_ranks
    width = len(f"B{microbatches - 1}")
    length = max(len(row) for row in slots)
    lines = []
    for r, row in enumerate(slots):
        cells = [_cell(a, two and a.stage >= num_ranks) if a is not None else "." for a in row]
        label = f"rank {r} (stages {', '.join(map(str, rank_stages(schedule, r, num_ranks)))})"
        lines.append(f"{label if two else f'stage {r}'}: " + " ".join(c.ljust(width) for c in cells).rstrip())
    busy = sum(a is not None for row in slots for a in row)
    total = num_ranks * length
    lines.append(f"{length} slots; idle {total - busy} of {total} rank-slots ({(total - busy) / total:.0%})")
    return "\n".join(lines)


def _cell(action: Action, lower: bool) -> str:
    kind = action.kind.lower() if lower else action.kind
    return f"{kind}{action.microbatch}"


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m smp.pipeline",
        description="Print a pipeline schedule's timeline (every action one time slot).",
    )
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--schedule", choices=SCHEDULES, default="interleaved")
    p.add_argument("--active", type=int, default=None, help="active_microbatches (default: min(pp + 2, m))")
    args = p.parse_args(argv)
    active = args.active if args.active is not None else min(args.pp + 2, args.microbatches)
    print(render_text(args.schedule, args.pp, args.microbatches, active))
