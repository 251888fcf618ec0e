"""A schedule as text: `python -m smp.pipeline` prints its unit-time timeline, or (`--lowered`)
each rank's lowered list."""

from __future__ import annotations

from smp.schedules.actions import Action
from smp.schedules.schedule import NAMES, Schedule, default_active, rank_stages, stage_ranks, unit_time_slots
from smp.schedules.transfers import SENDS, Layout, Transfer


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


def render_lowered(schedule: Schedule, ordered: bool) -> str:
    """Each rank's lowered list for stages that each read the one before: "F3", then its sends
    and receives, e.g. "SEND_F3>1" (to stage 1) and "RECV_B4<1^" (from stage 1, posted a
    microbatch ahead). Where a rank runs two stages, the later one's are lower case."""
    layout = Layout.chain(schedule.num_stages)
    lines = []
    for rank in range(schedule.num_ranks):
        first = min(schedule.rank_stages(rank))
        cells = [_entry(a, a.stage != first) for a in schedule.program(rank, ordered, True, layout)]
        lines.append(f"rank {rank}: " + " ".join(cells))
    return "\n".join(lines)


def _entry(action: Action | Transfer, lower: bool) -> str:
    if isinstance(action, Action):
        return _cell(action, lower)
    arrow = ">" if action.kind in SENDS else "<"
    kind = action.kind.lower() if lower else action.kind
    return f"{kind}{action.microbatch}{arrow}{action.peer}{'^' if action.ahead else ''}"


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
    p.add_argument("--schedule", choices=NAMES, default="interleaved")
    p.add_argument("--active", type=int, default=None, help="active_microbatches (default: min(pp + 2, m))")
    p.add_argument("--lowered", choices=("tagged", "ordered"), help="print each rank's lowered list instead")
    args = p.parse_args(argv)
    active = args.active if args.active is not None else default_active(args.pp, args.microbatches)
    if args.lowered:
        schedule = Schedule(args.schedule, args.pp, args.microbatches, active)
        print(render_lowered(schedule, args.lowered == "ordered"))
    else:
        print(render_text(args.schedule, args.pp, args.microbatches, active))
