"""The lowered schedule (smp.schedules.lowering): a rank's F, B and W with the sends and receives of
its pipeline messages placed among them, and the unit-time simulation that checks every rank's
list for deadlock (smp.schedules.simulation), in one process.

- test_one_f_one_b_p2_m4_lowered_by_hand: 1F1B at p = 2, m = 4, stages each reading the one
  before, both message paths, each rank's list written out by hand. Tagged: a stage posts the
  receives of its next F (B) at the end of its F (B), microbatch 0's just before its action, and
  the model outputs after its last stage's F; sends follow their action. Ordered: every message
  in one order on both ends, by the unit-time slot of the action that sends it (rank 0: F0 F1 .
  B0 F2 B1 F3 B2 . B3; rank 1: . F0 B0 F1 B1 F2 B2 F3 B3), then the lower rank's sends first;
  receives as early as that order allows. `python -m smp.pipeline --lowered` prints the same.
- test_evaluation_lowers_no_gradients: a step without backward posts no gradient messages.
- test_every_kind_lowers_to_lists_the_simulation_accepts: every kind at p 2-4, m 1-5, both paths,
  with and without gradients, for the chain layout and the complete one (every pair a split can
  exchange, what the executor runs): the compute actions are the schedule's, in order; and the
  simulation completes.
- test_unit_time_slots_are_the_simulations: slots of the lowered lists, for the examples the
  timeline's rendering tests (by hand there).
- test_simulation_catches_broken_lists: the simulation refuses lists with a receive after its
  wait, a send before its action, a message without its other end, pairs posting in different
  orders on the ordered path, a tagged list run with ordered semantics, and compute orders that
  deadlock.
"""

from __future__ import annotations

import re

import pytest
from smp.schedules import KINDS, Action, Layout, Schedule, Transfer, lowering, render, simulation

_TOKEN = re.compile(r"(SEND|RECV)_([FOB])(\d+)([<>])(\d+)(\^?)|([FBW])(\d+)")


def _parse(text: str, rank: int) -> list:
    """'F0 SEND_F0>1 RECV_B1<1^' on a one-stage-per-rank pipeline (stage r on rank r): '>' sends
    to, '<' receives from the stage after it; '^' posted a microbatch ahead."""
    out = []
    for token in text.split():
        m = _TOKEN.fullmatch(token)
        assert m, token
        if m.group(7):
            out.append(Action(m.group(7), int(m.group(8)), rank))
        else:
            kind = f"{m.group(1)}_{m.group(2)}"
            out.append(Transfer(kind, int(m.group(3)), rank, int(m.group(5)), m.group(6) == "^"))
    return out


TAGGED = [
    "F0 SEND_F0>1 RECV_O0<1 F1 SEND_F1>1^ RECV_O1<1 RECV_B0<1 B0 RECV_B1<1^ F2 SEND_F2>1^ RECV_O2<1 "
    "B1 RECV_B2<1^ F3 SEND_F3>1^ RECV_O3<1 B2 RECV_B3<1^ B3",
    "RECV_F0<0 F0 SEND_O0>0 RECV_F1<0^ B0 SEND_B0>0 F1 SEND_O1>0 RECV_F2<0^ B1 SEND_B1>0^ F2 SEND_O2>0 "
    "RECV_F3<0^ B2 SEND_B2>0^ F3 SEND_O3>0 B3 SEND_B3>0^",
]
ORDERED = [
    "F0 SEND_F0>1 F1 SEND_F1>1 RECV_O0<1 RECV_B0<1 B0 RECV_O1<1 F2 SEND_F2>1 RECV_B1<1 B1 RECV_O2<1 "
    "F3 SEND_F3>1 RECV_B2<1 B2 RECV_O3<1 RECV_B3<1 B3",
    "RECV_F0<0 F0 RECV_F1<0 SEND_O0>0 B0 SEND_B0>0 F1 SEND_O1>0 B1 RECV_F2<0 SEND_B1>0 F2 SEND_O2>0 "
    "B2 RECV_F3<0 SEND_B2>0 F3 SEND_O3>0 B3 SEND_B3>0",
]


@pytest.mark.parametrize("ordered, expected", [(False, TAGGED), (True, ORDERED)], ids=["tagged", "ordered"])
def test_one_f_one_b_p2_m4_lowered_by_hand(ordered, expected):
    schedule = Schedule("interleaved", 2, 4, 4)
    chain = Layout.chain(2)
    for rank, text in enumerate(expected):
        assert list(schedule.program(rank, ordered, True, chain)) == _parse(text, rank), (ordered, rank)
    schedule.check(chain, ordered)
    text = render.render_lowered(schedule, ordered)  # what `python -m smp.pipeline --lowered` prints
    assert text == "\n".join(f"rank {r}: {line}" for r, line in enumerate(expected))


def test_evaluation_lowers_no_gradients():
    schedule = Schedule("interleaved", 2, 4, 4)
    for ordered in (False, True):
        for rank in range(2):
            lowered = schedule.program(rank, ordered, with_gradients=False, layout=Layout.chain(2))
            kinds = {a.kind for a in lowered}
            assert kinds == ({"F", "B", "SEND_F", "RECV_O"} if rank == 0 else {"F", "B", "RECV_F", "SEND_O"})


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_lowers_to_lists_the_simulation_accepts(name):
    for p in (2, 3, 4):
        for m in (1, 2, 5):
            for active in sorted({1, min(p + 2, m), m}):
                schedule = Schedule(name, p, m, active)
                for layout in (Layout.chain(schedule.num_stages), None):
                    for ordered in (False, True):
                        for grads in (True, False):
                            for rank in range(p):
                                lowered = schedule.program(rank, ordered, grads, layout)
                                computes = [a for a in lowered if isinstance(a, Action)]
                                assert computes == schedule.actions(rank), (name, p, m, rank)
                            schedule.check(layout, ordered, grads)


def test_unit_time_slots_are_the_simulations():
    rows = Schedule("interleaved", 3, 4, 4).slots()
    text = [" ".join(f"{a.kind}{a.microbatch}" if a else "." for a in row) for row in rows]
    assert text == [
        "F0 F1 F2 . . B0 F3 B1 . B2 . B3",
        ". F0 F1 . B0 F2 B1 F3 B2 . B3",
        ". . F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def _programs(schedule: Schedule, ordered: bool) -> list[list]:
    return [list(schedule.program(r, ordered, True, Layout.chain(schedule.num_stages))) for r in range(2)]


def _simulate(programs, ordered: bool):
    chain = Layout.chain(2)
    return simulation.simulate([tuple(p) for p in programs], (0, 1), chain, True, ordered, "test")


def test_simulation_catches_broken_lists():
    schedule = Schedule("interleaved", 2, 4, 4)
    for ordered in (False, True):
        assert _simulate(_programs(schedule, ordered), ordered) == schedule.slots()

    late = _programs(schedule, False)  # rank 1 posts F0's receive after F0
    late[1][0], late[1][1] = late[1][1], late[1][0]
    with pytest.raises(RuntimeError, match=r"waits for message \('F', 0, 0, 1\) at .* before posting"):
        _simulate(late, False)

    early = _programs(schedule, False)  # rank 0 sends F0's activations before computing F0
    early[0][0], early[0][1] = early[0][1], early[0][0]
    with pytest.raises(RuntimeError, match="sends .*SEND_F.* before computing"):
        _simulate(early, False)

    lonely = _programs(schedule, False)  # rank 1 never sends B2's gradient
    lonely[1].remove(Transfer("SEND_B", 2, 1, 0, True))
    with pytest.raises(RuntimeError, match=r"messages \[\('B', 2, 1, 0\)\] are sent or received, not both"):
        _simulate(lonely, False)

    swapped = _programs(schedule, True)  # rank 1 posts F1's receive after its own send
    i = swapped[1].index(Transfer("RECV_F", 1, 1, 0))
    swapped[1][i], swapped[1][i + 1] = swapped[1][i + 1], swapped[1][i]
    with pytest.raises(RuntimeError, match="ranks 0 and 1 post their messages in different orders"):
        _simulate(swapped, True)
    with pytest.raises(RuntimeError, match="different orders"):  # the tagged placement is not ordered
        _simulate(_programs(schedule, False), True)

    # rank 0 waits for B0's gradient before sending F1, which rank 1's second F waits for
    stuck = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)],
        [Action("F", 0, 1), Action("F", 1, 1), Action("B", 0, 1), Action("B", 1, 1)],
    ]
    chain = Layout.chain(2)
    programs = [lowering.tagged(actions, r, (0, 1), chain, 2, True) for r, actions in enumerate(stuck)]
    with pytest.raises(RuntimeError, match=r"deadlocks at slot 2: rank 0 at \('B', 0, 0\) waits for"):
        _simulate(programs, False)
