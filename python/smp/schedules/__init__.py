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

from smp.schedules.actions import Action
from smp.schedules.render import main, render_text
from smp.schedules.schedule import (
    KINDS,
    NAMES,
    Kind,
    Schedule,
    num_stages,
    rank_actions,
    rank_stages,
    stage_ranks,
    unit_time_slots,
)

SCHEDULES = NAMES

__all__ = [
    "KINDS",
    "NAMES",
    "SCHEDULES",
    "Action",
    "Kind",
    "Schedule",
    "main",
    "num_stages",
    "rank_actions",
    "rank_stages",
    "render_text",
    "stage_ranks",
    "unit_time_slots",
]
