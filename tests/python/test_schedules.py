"""The Schedule object (smp.schedules) in one process, against expectations written independently of
its code.

- test_gpipe_actions_by_hand / test_one_f_one_b_actions_by_hand: "simple" and "interleaved" at small
  pipelines, each rank's list written out by hand (GPipe: every F, then every B; 1F1B: a rank starts
  min(active, p - rank, m) forwards, then alternates B and F, then drains).
- test_every_kind_is_complete_ordered_and_placed: every kind in KINDS at p in {1, 2, 3, 4}, m in
  {1, 2, 4, 8}: each rank runs F and B (and W exactly when the kind splits the backward) of every
  microbatch on each of its stages exactly once, F before B before W; every stage is on exactly one
  rank (zero_bubble_v: rank r holds r and 2p-1-r); waits_for is the previous stage's F for an F and
  the next stage's B for a B; slots() holds each rank's list in order, and every action's awaited
  action sits, on the rank holding its stage, in a strictly earlier slot.
- test_config_names_are_the_kinds / test_config_schedule_is_the_schedule_by_hand: the config accepts
  exactly the names in KINDS, and Config.schedule() is the Schedule built by hand (active
  microbatches defaulting to min(p + 2, m)).
- test_schedule_refuses_bad_values: the object's own validation.

The zero-bubble kinds' in-flight limits, renderings and message orders are tested in
test_zero_bubble.py, the text rendering of "simple"/"interleaved" in test_timeline.py.
"""

from __future__ import annotations

import pytest
from smp import config as smp_config
from smp.schedules import KINDS, NAMES, Action, Schedule


def _parse(text: str, stage: int) -> list[Action]:
    """'F0 F1 B0' -> [Action("F", 0, stage), ...]."""
    return [Action(word[0], int(word[1:]), stage) for word in text.split()]


def _check_by_hand(name: str, p: int, m: int, active: int, expected: list[str]) -> None:
    schedule = Schedule(name, p, m, active)
    assert schedule.num_stages == p and schedule.stage_ranks == tuple(range(p))
    for rank, text in enumerate(expected):
        assert schedule.rank_stages(rank) == (rank,)
        assert schedule.actions(rank) == _parse(text, rank), (name, p, m, active, rank)


@pytest.mark.parametrize(
    "p, m, expected",
    [
        (1, 3, ["F0 F1 F2 B0 B1 B2"]),
        (2, 3, ["F0 F1 F2 B0 B1 B2", "F0 F1 F2 B0 B1 B2"]),
        (3, 2, ["F0 F1 B0 B1"] * 3),
    ],
)
def test_gpipe_actions_by_hand(p, m, expected):
    for active in (1, m):  # GPipe ignores the limit: every microbatch's activations live at once
        _check_by_hand("simple", p, m, active, expected)


@pytest.mark.parametrize(
    "p, m, active, expected",
    [
        (1, 3, 3, ["F0 B0 F1 B1 F2 B2"]),
        (2, 4, 4, ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"]),
        (
            3,
            4,
            4,
            ["F0 F1 F2 B0 F3 B1 B2 B3", "F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
        ),
        # active_microbatches caps the first rank's warm-up: min(2, 3 - 0, 4) = 2.
        (
            3,
            4,
            2,
            ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
        ),
        # Fewer microbatches than the warm-up: m caps it (min(4, 4 - 0, 2) = 2).
        (4, 2, 4, ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"]),
        (3, 3, 1, ["F0 B0 F1 B1 F2 B2"] * 3),
    ],
)
def test_one_f_one_b_actions_by_hand(p, m, active, expected):
    _check_by_hand("interleaved", p, m, active, expected)


def _awaited(action: Action, last_stage: int) -> tuple[str, int, int] | None:
    """What an action waits for, written from the pipeline's data flow."""
    kind, k, s = action
    if kind == "F":
        return ("F", k, s - 1) if s > 0 else None
    if kind == "B":
        return ("B", k, s + 1) if s < last_stage else None
    return None  # W waits for nothing but its own stage's B, earlier in the same list


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_is_complete_ordered_and_placed(name):
    for p in (1, 2, 3, 4):
        v_shaped = KINDS[name].stages_per_rank == 2 and p > 1
        for m in (1, 2, 4, 8):
            for active in sorted({1, min(p + 2, m), m}):
                schedule = Schedule(name, p, m, active)
                where = (name, p, m, active)
                kinds = "FBW" if schedule.splits_backward else "FB"

                # Placement: every stage on exactly one rank.
                stages = schedule.num_stages
                assert stages == (2 * p if v_shaped else p), where
                assert len(schedule.stage_ranks) == stages, where
                held = [schedule.rank_stages(r) for r in range(p)]
                assert sorted(s for row in held for s in row) == list(range(stages)), where
                for r, row in enumerate(held):
                    assert row == ((r, 2 * p - 1 - r) if v_shaped else (r,)), where
                    assert all(schedule.stage_ranks[s] == r for s in row), where

                # Each rank: every (kind, k, stage) of its stages once, F before B before W.
                lists = [schedule.actions(r) for r in range(p)]
                for r, actions in enumerate(lists):
                    expected = {(kind, k, s) for kind in kinds for k in range(m) for s in held[r]}
                    assert len(actions) == len(expected) and set(actions) == expected, (where, r)
                    position = {tuple(a): i for i, a in enumerate(actions)}
                    for s in held[r]:
                        for k in range(m):
                            order = [position[(kind, k, s)] for kind in kinds]
                            assert order == sorted(order), (where, r, k, s)

                # What each action waits for, and the unit-time slots.
                slots = schedule.slots()
                assert len(slots) == p, where
                slot_of = {}
                for r, row in enumerate(slots):
                    assert [a for a in row if a is not None] == lists[r], (where, r)
                    assert row and row[-1] is not None, (where, r)  # a finished rank is not idle
                    for t, a in enumerate(row):
                        if a is not None:
                            slot_of[tuple(a)] = (r, t)
                for actions in lists:
                    for a in actions:
                        needed = schedule.waits_for(a)
                        assert needed == _awaited(a, stages - 1), (where, a)
                        if needed is not None:
                            rank, t = slot_of[needed]
                            assert rank == schedule.stage_ranks[needed[2]], (where, a)
                            assert t < slot_of[tuple(a)][1], (where, a, needed)


def test_config_names_are_the_kinds(monkeypatch):
    for var in smp_config.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    assert set(NAMES) == set(KINDS)
    for name in KINDS:
        assert smp_config.parse({"pipeline": name}).pipeline == name
    with pytest.raises(ValueError) as raised:
        smp_config.parse({"pipeline": "nope"})
    message = str(raised.value)
    assert "'nope'" in message
    for name in KINDS:  # the error lists every kind, whatever KINDS holds
        assert repr(name) in message, (name, message)


@pytest.mark.parametrize("name", list(KINDS))
def test_config_schedule_is_the_schedule_by_hand(name, monkeypatch):
    for var in smp_config.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    for pp, m, active in ((1, 1, None), (2, 8, None), (4, 3, None), (4, 8, 2), (3, 5, 5)):
        options = {"pipeline": name, "pipeline_parallel_degree": pp, "microbatches": m}
        if active is not None:
            options["active_microbatches"] = active
        got = smp_config.parse(options).schedule()
        assert got == Schedule(name, pp, m, active if active is not None else min(pp + 2, m)), options


def test_schedule_refuses_bad_values():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'nope'") as raised:
        Schedule("nope", 2, 4, 4)
    for name in KINDS:
        assert repr(name) in str(raised.value)
    with pytest.raises(ValueError, match=r"microbatches \(0\)"):
        Schedule("interleaved", 2, 0, 1)
    with pytest.raises(ValueError, match=r"active_microbatches \(0\)"):
        Schedule("interleaved", 2, 4, 0)
    with pytest.raises(ValueError, match=r"pipeline rank 2 is outside \[0, 2\)"):
        Schedule("simple", 2, 4, 4).actions(2)
