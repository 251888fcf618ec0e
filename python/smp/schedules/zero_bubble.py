"""The zero-bubble schedules' action lists, placed greedily in time (ZB-H1 and ZB-V: Qi et al.,
"Zero Bubble Pipeline Parallelism", ICLR 2024)."""

from __future__ import annotations

import functools
from typing import NamedTuple

from smp.schedules.actions import Action, waits_for


def in_flight_limit(stage: int, num_stages: int, microbatches: int, active_microbatches: int) -> int:
    """How many microbatches a stage of a one-stage-per-rank pipeline starts before its first
    backward (1F1B's limit; ZB-H1 keeps it)."""
    return min(active_microbatches, num_stages - stage, microbatches)


@functools.lru_cache(maxsize=64)
def zero_bubble(num_stages: int, microbatches: int, active: int) -> tuple[tuple[Action, ...], ...]:
    """Every stage's ZB-H1 actions (_greedy with one stage per rank and interleaved's in-flight
    limit per stage)."""
    # Each stage holds at most the microbatches it holds under 1F1B, so its peak is no higher
    # than 1F1B's on every stage. (ZB-H1 in the paper lets later stages hold as many as the first,
    # bounding only the largest stage's count; with a last stage whose activations per microbatch
    # are larger (the logits), that raised the pipeline's peak, measured, above 1F1B's.)
    limits = tuple(in_flight_limit(s, num_stages, microbatches, active) for s in range(num_stages))
    return _greedy(tuple((s,) for s in range(num_stages)), microbatches, limits)


@functools.lru_cache(maxsize=64)
def zero_bubble_v(num_ranks: int, microbatches: int, active: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's ZB-V actions (_greedy over the V placement). The limit counts stage-
    microbatches, two per microbatch of a one-stage-per-rank pipeline (see
    smp.schedules.schedule.rank_actions)."""
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
                needed = waits_for(a.kind, a.microbatch, a.stage, last)
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
        needed = waits_for(kind, k, s, last)
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
