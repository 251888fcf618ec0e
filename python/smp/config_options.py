"""The config's structured values: the timeline's options, torch.compile's arguments and group
timeouts, each checked with an error that names the key, the value and the fix; the sdp_*
keys FSDP2 has no counterpart for; the layouts CUDA graphs and expert parallelism refuse."""

from __future__ import annotations

import dataclasses
import warnings
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


# sdp_* keys FSDP2 has no counterpart for: given with sharded_data_parallel_degree > 1, they warn.
SDP_UNMAPPED = {
    "sdp_reduce_bucket_size": "FSDP2 reduce-scatters each sharded unit's (layer's) gradients as one "
    "collective, so the unit is the bucket; there is no bucket size to set",
    "sdp_hierarchical_allgather": "FSDP2 all-gathers each unit over the sdp group in one collective "
    "(NCCL picks its own algorithm across nodes); there is no two-level all-gather to turn on",
}


def warn_unmapped_sdp_keys(given: Mapping[str, Any], sdp: int) -> None:
    """The sdp_* keys a script set that FSDP2 cannot honour (only when sdp is on)."""
    if sdp == 1:
        return
    for key, why in SDP_UNMAPPED.items():
        if key in given and not (key == "sdp_hierarchical_allgather" and given[key] is False):
            warnings.warn(f"smp config: '{key}' has no effect: {why}", stacklevel=4)


# torch.compile modes that record CUDA graphs (CUDAGraph trees).
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_cuda_graphs(config: Any) -> None:
    """CUDA graphs only where they were measured to keep parity: a model that runs whole. A graph
    overwrites its outputs at the next replay; a pipeline keeps several microbatches' outputs and
    messages alive at once, and sharded layouts run collectives and FSDP2's hooks between graphs."""
    mode = (config.compile or {}).get("mode")
    if mode not in _CUDA_GRAPH_MODES:
        return
    layout = {
        "pipeline_parallel_degree": config.pipeline_parallel_degree,
        "tensor_parallel_degree": config.tensor_parallel_degree,
        "sharded_data_parallel_degree": config.sharded_data_parallel_degree,
    }
    over = {k: v for k, v in layout.items() if v != 1}
    if over:
        listed = ", ".join(f"{k}={v}" for k, v in over.items())
        raise ValueError(
            f"smp config: compile mode {mode!r} records CUDA graphs, which smp supports only for a model "
            f"that runs whole (every degree 1), not with {listed}; use 'compile': true (or mode "
            "'default' / 'max-autotune-no-cudagraphs') in this layout"
        )


def check_expert_parallel(config: Any) -> None:
    """Expert parallelism with what it does not serve yet: each a clear error naming the fix."""
    ep = config.expert_parallel_degree
    if ep == 1:
        return
    others = {
        "pipeline_parallel_degree": config.pipeline_parallel_degree,
        "tensor_parallel_degree": config.tensor_parallel_degree,
        "sharded_data_parallel_degree": config.sharded_data_parallel_degree,
    }
    over = [f"{k}={v}" for k, v in others.items() if v != 1]
    if config.shard_optimizer_state:
        over.append("shard_optimizer_state=true")
    if config.compile is not None:  # the exchange's splits are read on the host, data dependent
        over.append("compile")
    if over:
        raise ValueError(
            f"smp config: expert_parallel_degree={ep} runs with data parallelism only so far, not with "
            f"{', '.join(over)}; set expert_parallel_degree to 1 for this layout, or drop the others "
            "(docs/expert_parallel.md says what composes)"
        )
