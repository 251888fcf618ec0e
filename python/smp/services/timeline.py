"""The pipeline timeline: what each rank did and when, written as a Chrome trace and a picture.

Switched on by the config key "timeline" (true, or {"path", "start", "steps", "every"}) or by
the environment variable SMP_TIMELINE=<dir>. Each rank then records, per step:

- each schedule action ("F" / "B", and any kind a schedule adds, e.g. "W") from the moment the
  scheduler resumes its microbatch to the moment control comes back;
- each pipeline message: a send from its post to the first time this rank sees it complete
  (Gloo's work has no completion callback, so completion is polled at this rank's next message
  and at the end of the step), a receive from its post to the end of the wait for it;
- each gradient bucket, from its all-reduce's launch to its observed completion.

Clock: time.perf_counter_ns, which is CLOCK_MONOTONIC on Linux, one clock for every process of a
host. At start the ranks exchange host names and readings once (after a barrier, on the messaging
group): ranks on rank 0's host use the clock as it is (exact); ranks on other hosts are shifted by
the difference of their reading from rank 0's, which is right to within the barrier's exit skew
(well under a millisecond on a cluster network, short against a pipeline action).

When off, the runtime holds None instead of a recorder: one `is not None` test per action and
per message, nothing allocated. Writing is a collective: every rank sends its events to rank 0
(an object gather), which writes <path>/timeline.json and <path>/timeline.png. It happens after
`steps` recorded steps, after every `every` recorded steps, or when the script calls
smp.write_timeline() on every rank. It is never left to atexit: by then a rank may have
destroyed its groups or died, and a gather that waits for it would hang the others; at exit rank 0
only says so if events were recorded and never written.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from typing import Any

import torch.distributed as dist

from smp import faults
from smp.config_options import TimelineOptions

now = time.perf_counter_ns  # the clock every event uses (ns, monotonic)

_recorder: Recorder | None = None
_group: dist.ProcessGroup | None = None  # smp's messaging group (all ranks): the clock exchange, the gather


class Recorder:
    """One rank's events. The runtime calls `record` (and the step calls `begin_step`/`end_step`)."""

    def __init__(self, options: TimelineOptions, identity: dict[str, int], offset_ns: int):
        self.options = options
        self.identity = identity  # rank, stage, tp, rdp
        self._offset = offset_ns
        self._events: list[tuple] = []
        self._step = 0  # @smp.step calls so far
        self._recorded = 0  # steps recorded since the last write
        self.recording = False

    def begin_step(self) -> bool:
        """Counts a step; whether this one is recorded."""
        self._step += 1
        o = self.options
        self.recording = self._step >= o.start and (o.steps is None or self._step < o.start + o.steps)
        return self.recording

    def end_step(self) -> bool:
        """Ends a recorded step; whether the files are due now (the same answer on every rank)."""
        if not self.recording:
            return False
        self.recording = False
        self._recorded += 1
        o = self.options
        if o.every is not None and self._recorded % o.every == 0:
            return True
        return o.steps is not None and self._step == o.start + o.steps - 1

    def record(self, kind: str, start_ns: int, end_ns: int, **fields: Any) -> None:
        """One event: kind "F"/"B"/"W" (compute), "send", "recv" or "bucket", with its fields
        (microbatch, stage, peer, bytes, ...). Ignored outside recorded steps."""
        if self.recording:
            self._events.append((kind, start_ns + self._offset, end_ns + self._offset, self._step, fields))

    @property
    def unwritten(self) -> int:
        """Events recorded since the last write."""
        return len(self._events)

    def take(self) -> list[tuple]:
        events, self._events = self._events, []
        self._recorded = 0
        return events


class Pending:
    """Nonblocking operations (sends, buckets) whose completion is noted when first seen."""

    def __init__(self, recorder: Recorder):
        self._recorder = recorder
        self._open: list[tuple[dist.Work, str, int, dict]] = []

    @property
    def recording(self) -> bool:
        """Whether the recorder records this step (so adding is worth its cost)."""
        return self._recorder.recording

    def add(self, work: dist.Work, kind: str, start_ns: int, **fields: Any) -> None:
        self._open.append((work, kind, start_ns, fields))

    def poll(self) -> None:
        """Records those that have completed by now."""
        if not self._open:
            return
        t = now()
        still = []
        for work, kind, start, fields in self._open:
            if work.is_completed():
                self._recorder.record(kind, start, t, **fields)
            else:
                still.append((work, kind, start, fields))
        self._open = still

    def close(self) -> None:
        """After the caller waited for all of them: the rest completed by now."""
        t = now()
        for _, kind, start, fields in self._open:
            self._recorder.record(kind, start, t, **fields)
        self._open = []


def recorder() -> Recorder | None:
    """This process's recorder, or None when the timeline is off."""
    return _recorder


def start(options: TimelineOptions | None, identity: dict[str, int], group: dist.ProcessGroup) -> None:
    """Called by smp.init on every rank (a collective when on): aligns the clocks, starts recording."""
    global _recorder, _group
    _recorder, _group = None, group
    if options is not None:
        _recorder = Recorder(options, identity, _clock_offset(group))
        atexit.unregister(_warn_unwritten)  # registered once, however often smp.init runs
        atexit.register(_warn_unwritten)


def _warn_unwritten() -> None:
    """At exit, a note (no collective: peers may be gone) that recorded events were never written."""
    rec = _recorder
    if rec is not None and rec.unwritten and rec.identity["rank"] == 0:
        print(
            f"smp: the timeline recorded {rec.unwritten} events on rank 0 that were never written; call "
            "smp.write_timeline() on every rank after training, or give 'timeline' a 'steps' or 'every'",
            file=sys.stderr,
        )


def stop() -> None:
    """smp's state is reset: events not written are dropped."""
    global _recorder, _group
    _recorder, _group = None, None


def _clock_offset(group: dist.ProcessGroup) -> int:
    """ns to add to this rank's clock to read rank 0's (0 on rank 0's host: one monotonic clock)."""
    readings: list[Any] = [None] * dist.get_world_size(group)
    with faults.waiting("aligning the timeline's clocks", faults.group_of("messaging", group)):
        dist.barrier(group=group)
        reading = (socket.gethostname(), now())
        dist.all_gather_object(readings, reading, group=group)
    host0, t0 = readings[0]
    return 0 if reading[0] == host0 else t0 - reading[1]


def write(path: str | None = None) -> str | None:
    """Every rank calls it: rank 0 gathers the events recorded since the last write and writes
    <path>/timeline.json (Chrome trace) and <path>/timeline.png. Returns the JSON's path on rank 0."""
    rec = _recorder
    if rec is None:
        raise RuntimeError(
            "smp.write_timeline: the timeline is off; set 'timeline': true (or {'path': DIR}) in the smp "
            "config, or the environment variable SMP_TIMELINE=DIR, before smp.init"
        )
    mine = (rec.identity, rec.take())
    gathered: list[Any] | None = [None] * dist.get_world_size(_group) if rec.identity["rank"] == 0 else None
    with faults.waiting("gathering the timeline on rank 0", faults.group_of("messaging", _group)):
        dist.gather_object(mine, gathered, dst=0, group=_group)
    if gathered is None:
        return None
    from smp.services import timeline_files  # matplotlib is imported only by the rank that draws

    directory = path or rec.options.path
    os.makedirs(directory, exist_ok=True)
    trace = os.path.join(directory, "timeline.json")
    timeline_files.write_trace(gathered, trace)
    timeline_files.write_picture(gathered, os.path.join(directory, "timeline.png"))
    return trace
