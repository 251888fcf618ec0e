"""The config's structured values: the timeline's options, torch.compile's arguments and group
timeouts, each checked with an error that names the key, the value and the fix."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

MAX_TIMEOUT_SECONDS = 7 * 24 * 3600


@dataclasses.dataclass(frozen=True)
class TimelineOptions:
    """What the pipeline timeline records and when it writes (see smp.services.timeline)."""

    path: str = "smp_timeline"  # the directory rank 0 writes timeline.json and timeline.png in
    start: int = 1  # the first step recorded (1: the first @smp.step call)
    steps: int | None = None  # how many steps to record (None: every step from `start` on)
    every: int | None = None  # write after every N recorded steps (None: once `steps` are recorded)


def type_error(name: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"smp config: '{name}' must be {expected}, got {value!r} ({type(value).__name__})")


def check_timeout(value: Any, what: str) -> float | None:
    """A group timeout in seconds: a finite number in (0, MAX_TIMEOUT_SECONDS], or None (the default)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"smp config: {what} must be a number of seconds, got {value!r} ({type(value).__name__}); "
            "e.g. 'timeout': 300"
        )
    if not 0 < value <= MAX_TIMEOUT_SECONDS:  # also false for NaN
        raise ValueError(
            f"smp config: {what} must be in (0, {MAX_TIMEOUT_SECONDS}] seconds, got {value!r}; "
            "give the longest a rank may wait for a peer, e.g. 300"
        )
    return float(value)


_TIMELINE_KEYS = {f.name for f in dataclasses.fields(TimelineOptions)}


def check_timeline(value: Any) -> TimelineOptions | None:
    """'timeline': true/false/null, or a dict of TimelineOptions' fields."""
    if value is None or value is False:
        return None
    if value is True:
        return TimelineOptions()
    if not isinstance(value, Mapping):
        raise type_error("timeline", value, 'true, false or a dict like {"path": "timeline", "every": 10}')
    unknown = sorted(str(k) for k in value if k not in _TIMELINE_KEYS)
    if unknown:
        raise ValueError(
            f"smp config: 'timeline' has unknown key(s) {', '.join(repr(k) for k in unknown)}; "
            f"valid keys: {', '.join(sorted(_TIMELINE_KEYS))}"
        )
    path = value.get("path", TimelineOptions.path)
    if not isinstance(path, str) or not path:
        raise ValueError(
            f"smp config: 'timeline' path must be a non-empty string (a directory), got {path!r}"
        )
    counts = {}
    for key in ("start", "steps", "every"):
        n = value.get(key, getattr(TimelineOptions, key))
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(
                f"smp config: 'timeline' {key} must be a positive integer (a number of steps), got {n!r}"
            )
        counts[key] = n
    return TimelineOptions(path=path, **counts)


_COMPILE_KEYS = ("backend", "mode", "dynamic", "fullgraph", "options")


def check_compile(value: Any) -> dict | None:
    """'compile': true/false/null, or a dict of torch.compile's keyword arguments."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise type_error(
            "compile", value, 'true, false or a dict like {"backend": "inductor", "dynamic": false}'
        )
    unknown = sorted(str(k) for k in value if k not in _COMPILE_KEYS)
    if unknown:
        raise ValueError(
            f"smp config: 'compile' has unknown key(s) {', '.join(repr(k) for k in unknown)}; "
            f"valid keys (torch.compile's arguments): {', '.join(_COMPILE_KEYS)}"
        )
    if "dynamic" in value and value["dynamic"] not in (True, False, None):
        raise ValueError(
            f"smp config: 'compile' dynamic must be true, false or null, got {value['dynamic']!r}"
        )
    return dict(value)
