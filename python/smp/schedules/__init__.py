"""Pipeline schedules as data: the order in which one pipeline rank runs microbatch forwards and
backwards on its stage(s), and the messages between them.

An action is (kind, microbatch, stage), kind "F", "B" or "W". F is the forward; B the backward (in
"zero_bubble" and "zero_bubble_v", only its input-gradient part, whose result goes upstream at
once); W the weight-gradient part that those schedules split from B and defer. Every schedule
but "zero_bubble_v" runs one stage per rank (stage r on rank r); "zero_bubble_v" runs two, in a V:
rank r holds stages r and 2p-1-r, so the first rank also holds the last stage.

Lowering (smp.schedules.lowering) places the sends and receives of every message between ranks
(smp.schedules.transfers) among a rank's actions, for the tagged or the ordered message path: that
list is what the rank's executor runs, and nothing else orders the messages. The unit-time
simulation of every rank's lowered list (smp.schedules.simulation) places the actions in slots
(unit_time_slots, for the timeline, the planner and `python -m smp.pipeline`) and raises if the
lists deadlock or break a rule; its docstring argues why a list it accepts cannot deadlock when
run for real.
"""

from smp.schedules.actions import Action
from smp.schedules.render import main, render_text
from smp.schedules.schedule import (
    KINDS,
    NAMES,
    Kind,
    Schedule,
    default_active,
    num_stages,
    rank_actions,
    rank_stages,
    stage_ranks,
    unit_time_slots,
)
from smp.schedules.transfers import Layout, Transfer

SCHEDULES = NAMES

__all__ = [
    "KINDS",
    "NAMES",
    "Layout",
    "SCHEDULES",
    "Action",
    "Kind",
    "Schedule",
    "Transfer",
    "default_active",
    "main",
    "num_stages",
    "rank_actions",
    "rank_stages",
    "render_text",
    "stage_ranks",
    "unit_time_slots",
]
