"""The schedule kinds, and the Schedule object: one pipeline's schedule, the one place its facts
live (how many stages, where each runs, each rank's actions, their unit-time slots, whether the
backward is split). Config validates `pipeline` against KINDS; the engine, the executor, the
message order, the planner and the timeline read a Schedule.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from smp.schedules import lowering, simulation, zero_bubble
from smp.schedules.actions import Action, waits_for
from smp.schedules.transfers import Layout


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a schedule name means."""

    stages_per_rank: int  # the model is cut into this many stages per pipeline rank
    splits_backward: bool  # B is only the input gradients; W (weight gradients) is its own action
    # (num_ranks, microbatches, active_microbatches) -> every rank's actions.
    lists: Callable[[int, int, int], tuple[tuple[Action, ...], ...]]
    # (rank, num_ranks, microbatches, active_microbatches) -> the most microbatches whose
    # activations the rank holds at once, in units of its whole share of the layers (the planner's
    # memory model).
    held: Callable[[int, int, int, int], int]


def _one_f_one_b(num_ranks: int, microbatches: int, active: int) -> tuple[tuple[Action, ...], ...]:
    lists = []
    for rank in range(num_ranks):
        forwards = [Action("F", k, rank) for k in range(microbatches)]
        backwards = [Action("B", k, rank) for k in range(microbatches)]
        in_flight = zero_bubble.in_flight_limit(rank, num_ranks, microbatches, active)
        actions = forwards[:in_flight]
        for k in range(in_flight, microbatches):
            actions += [backwards[k - in_flight], forwards[k]]
        actions += backwards[microbatches - in_flight :]
        lists.append(tuple(actions))
    return tuple(lists)


def _gpipe(num_ranks: int, microbatches: int, active: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(
        tuple(
            [Action("F", k, r) for k in range(microbatches)]
            + [Action("B", k, r) for k in range(microbatches)]
        )
        for r in range(num_ranks)
    )


def _held_gpipe(rank: int, num_ranks: int, microbatches: int, active: int) -> int:
    return microbatches  # every microbatch's activations at once


def _held_one_f_one_b(rank: int, num_ranks: int, microbatches: int, active: int) -> int:
    # 1F1B's in-flight limit; ZB-H1 keeps it (a microbatch held from its F to its W).
    return zero_bubble.in_flight_limit(rank, num_ranks, microbatches, active)


def _held_v(rank: int, num_ranks: int, microbatches: int, active: int) -> int:
    # Up to 2 min(active, p, m) half-size stage-microbatches on every rank.
    return min(active, num_ranks, microbatches)


KINDS: dict[str, Kind] = {
    "interleaved": Kind(1, False, _one_f_one_b, _held_one_f_one_b),
    "simple": Kind(1, False, _gpipe, _held_gpipe),
    "zero_bubble": Kind(1, True, zero_bubble.zero_bubble, _held_one_f_one_b),
    "zero_bubble_v": Kind(2, True, zero_bubble.zero_bubble_v, _held_v),
}
NAMES = tuple(KINDS)


def default_active(num_ranks: int, microbatches: int) -> int:
    """Microbatches in flight when the config leaves active_microbatches unset: pp + 2, at most m."""
    return min(num_ranks + 2, microbatches)


def kind(schedule: str) -> Kind:
    found = KINDS.get(schedule)
    if found is None:
        raise ValueError(f"smp: unknown pipeline schedule {schedule!r}; use one of {NAMES}")
    return found


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One pipeline's schedule: `name` over `num_ranks` pipeline ranks, `microbatches` per step, at
    most `active_microbatches` holding activations on a rank (see rank_actions)."""

    name: str
    num_ranks: int
    microbatches: int
    active_microbatches: int

    def __post_init__(self) -> None:
        kind(self.name)
        if self.microbatches < 1 or self.active_microbatches < 1:
            raise ValueError(
                f"smp: microbatches ({self.microbatches}) and active_microbatches "
                f"({self.active_microbatches}) must be >= 1"
            )

    @property
    def splits_backward(self) -> bool:
        """Whether B is only the input gradients and W, the weight gradients, an action of its own."""
        return kind(self.name).splits_backward

    @property
    def num_stages(self) -> int:
        return num_stages(self.name, self.num_ranks)

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        return stage_ranks(self.name, self.num_ranks)

    def rank_stages(self, rank: int) -> tuple[int, ...]:
        return rank_stages(self.name, rank, self.num_ranks)

    def actions(self, rank: int) -> list[Action]:
        """`rank`'s F, B and W actions, in order."""
        return rank_actions(self.name, rank, self.num_ranks, self.microbatches, self.active_microbatches)

    def slots(self) -> list[list[Action | None]]:
        return unit_time_slots(self.name, self.num_ranks, self.microbatches, self.active_microbatches)

    def held(self, rank: int) -> int:
        """The most microbatches whose activations `rank` holds at once, in units of its whole share
        of the layers (a bound the action lists keep)."""
        return kind(self.name).held(rank, self.num_ranks, self.microbatches, self.active_microbatches)

    def program(
        self, rank: int, ordered: bool = False, with_gradients: bool = True, layout: Layout | None = None
    ) -> lowering.Lowered:
        """What `rank`'s executor runs: its actions with the sends and receives of `layout` (None:
        every pair a split can exchange, which serves every program) placed among them, for the
        ordered or the tagged message path (smp.schedules.lowering), with B's messages if
        `with_gradients`. Made once."""
        layout = layout if layout is not None else Layout.complete(self.num_stages)
        return lowered(self, rank, layout, ordered, with_gradients)

    def check(self, layout: Layout | None = None, ordered: bool = False, with_gradients: bool = True) -> None:
        """Raises if the ranks' lowered lists for `layout` (None: every pair) deadlock or break a
        rule (smp.schedules.simulation). Checked once per arguments."""
        layout = layout if layout is not None else Layout.complete(self.num_stages)
        check(self, layout, ordered, with_gradients)

    def waits_for(self, action: Action) -> tuple[str, int, int] | None:
        """The action (kind, microbatch, stage) whose message `action` waits for, or None."""
        return waits_for(action.kind, action.microbatch, action.stage, self.num_stages - 1)


def num_stages(schedule: str, num_ranks: int) -> int:
    """How many stages the model is cut into for `num_ranks` pipeline ranks (see stage_ranks): the
    schedule's stages per rank times the ranks, one stage when there is one rank."""
    per_rank = kind(schedule).stages_per_rank
    return 1 if num_ranks == 1 else per_rank * num_ranks


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
    under "interleaved", on every rank (docs/benchmarks.md, "ZB-V", measures it).
    With F = B = W = 1 unit per half-size stage, a step takes 6m + 1 units per rank at p = 2
    (m = 4: 25 slots against 1F1B's 30 of the same units; m = 8: 49 against 54) and 6m + 4 at
    p = 4, m = 8 (52 against 66).
    """
    found = kind(schedule)
    if microbatches < 1 or active_microbatches < 1:
        raise ValueError(
            f"smp: microbatches ({microbatches}) and active_microbatches ({active_microbatches}) must be >= 1"
        )
    if not 0 <= rank < num_ranks:
        raise ValueError(f"smp: pipeline rank {rank} is outside [0, {num_ranks})")
    if found.stages_per_rank > 1 and num_ranks == 1:  # one rank: one stage, no V
        found = KINDS["zero_bubble"]
    return list(_lists(found.lists, num_ranks, microbatches, active_microbatches)[rank])


@functools.lru_cache(maxsize=64)
def _lists(lists, num_ranks: int, microbatches: int, active: int) -> tuple[tuple[Action, ...], ...]:
    return lists(num_ranks, microbatches, active)


def unit_time_slots(
    schedule: str, num_ranks: int, microbatches: int, active_microbatches: int
) -> list[list[Action | None]]:
    """Each rank's actions placed in time slots, every action one slot long: an action runs in
    the first slot after what it waits for (the previous stage's F k, the next stage's B k) and
    this rank's previous action. None is an idle slot (a bubble). The simulation of the lists
    lowered for stages that each read the one before (smp.schedules.simulation); it raises if they
    deadlock."""
    return [list(row) for row in _slots(schedule, num_ranks, microbatches, active_microbatches)]


@functools.lru_cache(maxsize=64)
def _slots(
    schedule: str, num_ranks: int, microbatches: int, active: int
) -> tuple[tuple[Action | None, ...], ...]:
    ranks = stage_ranks(schedule, num_ranks)
    layout = Layout.chain(len(ranks))
    programs = [
        lowering.tagged(
            rank_actions(schedule, r, num_ranks, microbatches, active), r, ranks, layout, microbatches, True
        )
        for r in range(num_ranks)
    ]
    slots = simulation.simulate(programs, ranks, layout, with_gradients=True, serial=False, name=schedule)
    return tuple(tuple(row) for row in slots)


@functools.lru_cache(maxsize=256)
def lowered(
    schedule: Schedule, rank: int, layout: Layout, ordered: bool, with_gradients: bool
) -> lowering.Lowered:
    """`rank`'s actions with the transfers of `layout` placed among them for the ordered or the
    tagged message path (smp.schedules.lowering); without B's messages unless `with_gradients`."""
    name, p, m, active = (
        schedule.name,
        schedule.num_ranks,
        schedule.microbatches,
        schedule.active_microbatches,
    )
    ranks = stage_ranks(name, p)
    if ordered:
        return lowering.ordered(_slots(name, p, m, active), rank, ranks, layout, with_gradients)
    return lowering.tagged(rank_actions(name, rank, p, m, active), rank, ranks, layout, m, with_gradients)


@functools.lru_cache(maxsize=64)
def check(schedule: Schedule, layout: Layout, ordered: bool, with_gradients: bool) -> None:
    """Simulates every rank's lowered list (smp.schedules.simulation); raises if they deadlock or
    break a rule (the ordered path: one stream per rank)."""
    programs = [lowered(schedule, r, layout, ordered, with_gradients) for r in range(schedule.num_ranks)]
    ranks = stage_ranks(schedule.name, schedule.num_ranks)
    simulation.simulate(programs, ranks, layout, with_gradients, serial=ordered, name=schedule.name)
