"""The timeline's files, from every rank's events (smp.services.timeline gathers them on rank 0).

`ranks` is a list, one entry per rank: (identity, events), identity {"rank", "stage", "tp",
"rdp"}, each event (kind, start_ns, end_ns, step, fields) on rank 0's clock.

timeline.json is a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing): one
process per rank, named "rank r (stage s, tp t, rdp d)" ("stages s, s'" under "zero_bubble_v");
its "compute" thread holds the F/B actions as complete events, with the waits for messages nested
in them; sends, receives and
gradient buckets are async slices beside it (they overlap, which complete events on one thread
may not); an arrow goes from the action that sent each message to the action that waited for it.

timeline.png draws the actions: ranks as rows, time across, a box per action coloured by
microbatch with its number written in, backwards hatched and darker. The part of an action spent
waiting for a message (a receive) is pale: that, and the gaps between actions, are bubbles.
"""

from __future__ import annotations

import json
from typing import Any

COMPUTE_TID, MESSAGES_TID, BUCKETS_TID = 0, 1, 2
_ASYNC = ("send", "recv", "bucket")


def is_compute(kind: str) -> bool:
    """Schedule actions ("F", "B", and any later kind such as "W"), as opposed to messages."""
    return kind not in _ASYNC


def rank_name(identity: dict[str, int]) -> str:
    i = identity
    stages = i["stages"]
    where = f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"
    return f"rank {i['rank']} ({where}, tp {i['tp']}, rdp {i['rdp']})"


def _origin(ranks: list[tuple[dict, list]]) -> int:
    starts = [e[1] for _, events in ranks for e in events]
    return min(starts) if starts else 0


def trace_events(ranks: list[tuple[dict, list]]) -> list[dict[str, Any]]:
    """The Chrome trace's events (timestamps in microseconds from the first event)."""
    origin = _origin(ranks)

    def us(t: int) -> float:
        return (t - origin) / 1000

    out: list[dict[str, Any]] = []
    next_id = 0
    sends: dict[tuple, tuple[int, int]] = {}  # (step, src, dst, tag) -> (pid, post time)
    recvs: dict[tuple, tuple[int, int]] = {}  # (step, src, dst, tag) -> (pid, wait end)
    for identity, events in sorted(ranks, key=lambda r: r[0]["rank"]):
        pid = identity["rank"]
        out += _metadata(pid, identity)
        for kind, start, end, step, fields in events:
            args = {"step": step, **fields}
            if is_compute(kind):
                name = f"{kind}{fields.get('microbatch', '')}"
                out.append(
                    {"ph": "X", "name": name, "cat": kind, "pid": pid, "tid": COMPUTE_TID}
                    | {"ts": us(start), "dur": (end - start) / 1000, "args": args}
                )
                continue
            next_id += 1
            tid = BUCKETS_TID if kind == "bucket" else MESSAGES_TID
            name = _async_name(kind, fields)
            common = {"name": name, "cat": kind, "id": next_id, "pid": pid, "tid": tid}
            out.append(common | {"ph": "b", "ts": us(start), "args": args})
            out.append(common | {"ph": "e", "ts": us(end)})
            if kind == "send":
                sends[(step, pid, fields["peer_rank"], fields["tag"])] = (pid, start)
            elif kind == "recv":
                recvs[(step, fields["peer_rank"], pid, fields["tag"])] = (pid, end)
                wait = fields["wait_start"]  # inside the action that waited: nested on its track
                out.append(
                    {"ph": "X", "name": f"wait: {name}", "cat": "wait", "pid": pid, "tid": COMPUTE_TID}
                    | {"ts": us(wait), "dur": (end - wait) / 1000, "args": args}
                )
    for key, (src_pid, posted) in sorted(sends.items()):
        if key not in recvs:
            continue
        next_id += 1
        dst_pid, received = recvs[key]
        flow = {"name": "message", "cat": "pipeline", "id": next_id, "tid": COMPUTE_TID}
        out.append(flow | {"ph": "s", "pid": src_pid, "ts": us(posted)})
        out.append(flow | {"ph": "f", "bp": "e", "pid": dst_pid, "ts": us(received)})
    return out


def _metadata(pid: int, identity: dict[str, int]) -> list[dict[str, Any]]:
    named = [(COMPUTE_TID, "compute"), (MESSAGES_TID, "messages"), (BUCKETS_TID, "gradient buckets")]
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": rank_name(identity)}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}},
        *(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
            for tid, name in named
        ),
    ]


def _async_name(kind: str, fields: dict[str, Any]) -> str:
    if kind == "bucket":
        return f"bucket {fields['bucket']}"
    arrow = "->" if kind == "send" else "<-"
    return f"{kind} {fields['what']} mb{fields['microbatch']} {arrow} stage {fields['peer_stage']}"


def write_trace(ranks: list[tuple[dict, list]], path: str) -> None:
    steps = sorted({e[3] for _, events in ranks for e in events})
    trace = {
        "traceEvents": trace_events(ranks),
        "displayTimeUnit": "ms",
        "otherData": {"producer": "smp pipeline timeline", "steps": steps},
    }
    with open(path, "w") as f:
        json.dump(trace, f)


def write_picture(ranks: list[tuple[dict, list]], path: str) -> None:
    """The PNG: one row per rank, the actions as boxes (drawn without pyplot, so the script's
    matplotlib backend and figures are left alone)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ranks = sorted(ranks, key=lambda r: r[0]["rank"])
    origin = _origin(ranks)
    fig = Figure(figsize=(10, 1.2 + 0.45 * len(ranks)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    span = max((e[2] - origin for _, events in ranks for e in events), default=1) / 1e6
    for row, (_, events) in enumerate(ranks):
        _draw_row(ax, row, events, origin, span)
    _draw_step_starts(ax, ranks, origin)
    ax.set_yticks(range(len(ranks)), [rank_name(identity) for identity, _ in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("ms")
    steps = sorted({e[3] for _, events in ranks for e in events})
    which = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}" if steps else "no steps"
    ax.set_title(
        f"smp pipeline timeline, {which}: forward solid, backward hatched; "
        "pale: waiting for a message, gaps: idle between actions",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _waits(events: list[tuple]) -> list[tuple[int, int]]:
    """When this rank sat waiting for a message (inside an action): drawn pale, as idle time."""
    return [(e[4]["wait_start"], e[2]) for e in events if e[0] == "recv"]


def _style(kind: str, microbatch: int) -> tuple[tuple[float, ...], str | None]:
    """Face colour by microbatch; backward darker and hatched, a later kind (e.g. "W") paler, dotted."""
    from matplotlib import colormaps
    from matplotlib.colors import to_rgb

    base = to_rgb(colormaps["tab10"](microbatch % 10))
    if kind == "F":
        return base, None
    if kind == "B":
        return tuple(0.65 * c for c in base), "///"
    return tuple(0.5 + 0.5 * c for c in base), ".."


def _draw_row(ax, row: int, events: list[tuple], origin: int, span: float) -> None:
    """One rank's actions, waits pale on top, labels on the part after the waits. Boxes go in one
    collection per hatch (a collection per box makes a long run's picture take seconds)."""
    boxes: dict[str | None, tuple[list, list]] = {}  # hatch -> (x ranges, colours)
    pale: list[tuple[float, float]] = []
    waits = _waits(events)

    def ms(t: int) -> float:
        return (t - origin) / 1e6

    for kind, start, end, _, fields in events:
        if not is_compute(kind):
            continue
        k = fields.get("microbatch", 0)
        face, hatch = _style(kind, k)
        ranges, colours = boxes.setdefault(hatch, ([], []))
        ranges.append((ms(start), ms(end) - ms(start)))
        colours.append(face)
        inside = [(max(a, start), min(b, end)) for a, b in waits if a < end and b > start]
        pale += [(ms(a), ms(b) - ms(a)) for a, b in inside]
        busy_from = ms(max([start, *(b for _, b in inside)]))
        if ms(end) - busy_from > span * 0.012:  # wide enough for its number
            label = str(k) if kind in ("F", "B") else f"{kind}{k}"
            style = {"ha": "center", "va": "center", "fontsize": 7, "color": "white", "weight": "bold"}
            ax.text((busy_from + ms(end)) / 2, row, label, **style)
    height = (row - 0.38, 0.76)
    for hatch, (ranges, colours) in boxes.items():
        ax.broken_barh(ranges, height, facecolors=colours, edgecolor="black", hatch=hatch, lw=0.4)
    if pale:
        ax.broken_barh(pale, height, facecolors="0.88")


def _draw_step_starts(ax, ranks: list[tuple[dict, list]], origin: int) -> None:
    """A dotted line where each step's first action starts (on any rank)."""
    firsts: dict[int, int] = {}
    for _, events in ranks:
        for kind, start, _, step, _ in events:
            if is_compute(kind):
                firsts[step] = min(firsts.get(step, start), start)
    for step, start in sorted(firsts.items()):
        x = (start - origin) / 1e6
        ax.axvline(x, color="grey", ls=":", lw=0.8)
        ax.text(x, -0.5, f" step {step}", fontsize=7, color="grey", va="bottom")
