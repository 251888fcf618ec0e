"""smp configuration: SMP v1's parameters, their defaults, and validation.

A config comes as a dict to `smp.init(config)`, as JSON in the environment variable
SMP_CONFIG, or as JSON in SM_HP_MP_PARAMETERS (where SageMaker's launcher put it for SMP v1).
Precedence, key by key: SM_HP_MP_PARAMETERS over the script's dict over SMP_CONFIG. The
launcher's config winning over the script's is SMP v1's behaviour on SageMaker (scripts say
so in comments); SMP_CONFIG is smp's own default layer. Every mistake is a ValueError that
names the key, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import json
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

from smp import schedules
from smp.config_options import (
    TimelineOptions,
    check_compile,
    check_timeline,
    check_timeout,
    type_error,
    warn_unmapped_sdp_keys,
)

DEFAULTS_VAR = "SMP_CONFIG"  # below the script's dict
LAUNCHER_VAR = "SM_HP_MP_PARAMETERS"  # above it, as on SageMaker
ENV_VARS = (DEFAULTS_VAR, LAUNCHER_VAR)
PLACEMENT_ALIASES = {"cluster": "DPT", "spread": "TPD"}
PLACEMENT_ORDERS = tuple("".join(p) for p in itertools.permutations("DPT"))

_PLUMBING = "configured SMP v1's plumbing (SageMaker, Horovod)"
# SMP v1 keys that real scripts pass and that change nothing in smp: accepted, with a
# warning that says why. key -> a predicate of the key, why it has no effect.
LEGACY_NO_OP_KEYS = {
    "ddp_port": _PLUMBING,
    "ddp_dist_backend": _PLUMBING + "; smp's groups always use the 'smp' backend",
    "contiguous": _PLUMBING,
    "horovod": _PLUMBING,
    "predefined_hooks": _PLUMBING,
    "deterministic_server": "configured SMP v1's parameter server, which smp does not have",
    "static_mode": "asked SMP v1 to trace once and reuse the graph, which smp always does",
    "fast_mode": "asked SMP v1 to send activations straight to the stages that use them, which smp "
    "always does",
    "checkpoint_attentions": "checkpointed attention inside SMP v1's own DistributedTransformer "
    "layers; smp shards the model's own layers",
    "_match_weights": "checked SMP v1's re-initialized distributed weights; smp slices the original "
    "weights, so they always match",
    "_fp32_grad_accumulation": "asked for fp32 gradient accumulation, which smp always does under bf16/fp16",
    "fp16_params": "asked for fp16 distributed parameters; smp's parameter dtype follows 'fp16' / "
    "'bf16' (set 'fp16': true)",
}

ALIASES = {"partitions": "pipeline_parallel_degree", "_prescaled_batch": "prescaled_batch"}
# Keys whose null means "SMP's default" (SMP's own config had default_partition: None).
NULL_MEANS_DEFAULT = ("default_partition",)


TIMELINE_VAR = "SMP_TIMELINE"  # a directory: the timeline on, written there


@dataclasses.dataclass(frozen=True)
class Config:
    """The validated configuration (see docs: every SMP v1 parameter, same defaults)."""

    pipeline_parallel_degree: int = 1
    tensor_parallel_degree: int = 1
    microbatches: int = 1
    pipeline: str = "interleaved"
    active_microbatches: int | None = None  # None: pp + 2, capped at microbatches
    prescaled_batch: bool = False
    shard_optimizer_state: bool = False
    placement_strategy: str = "cluster"
    auto_partition: bool = True
    default_partition: int = 0
    memory_weight: float = 0.8
    optimize: str = "speed"
    ddp: bool = False
    fp16: bool = False
    bf16: bool = False
    offload_activations: bool = False
    activation_loading_horizon: int = 4
    delayed_parameter_initialization: bool = False
    tensor_parallel_seed: int = 0
    skip_tracing: bool = False
    sharded_data_parallel_degree: int = 1
    # Context parallelism (SMP v2's keys): the ranks of a cp group cut every sequence of one batch
    # between them (smp.context_parallel); "p2p" ring attention, "all_gather" or "a2a" (Ulysses).
    context_parallel_degree: int = 1
    cp_comm_type: str = "p2p"
    # Sharded data parallelism's knobs (SMP v1's names and defaults; smp.sharded_data says what
    # each maps to in FSDP2): parameters of a unit under the threshold stay gathered from
    # forward to backward; at most this many parameters gathered at once (prefetch depth);
    # global gradient clipping at this L2 norm, always on under sdp as in SMP v1 (<= 0: off).
    sdp_reduce_bucket_size: int = 500_000_000
    sdp_param_persistence_threshold: int = 1_000_000
    sdp_max_live_parameters: int = 1_000_000_000
    sdp_hierarchical_allgather: bool = True
    sdp_gradient_clipping: float = 1.0
    # smp additions (not in SMP v1):
    # SMP's behaviour: every user of a shared parameter on one stage (else it is replicated).
    colocate_shared_parameters: bool = False
    # Print the pipeline partition report on global rank 0, and check for non-finite values.
    debug: bool = False
    # Seconds any wait on a peer may last before it fails (None: smp's default, see
    # smp.parallel_state.default_timeout); smp.init(timeout=timedelta) sets it too.
    timeout: float | None = None
    # Report a NaN/inf loss or gradient with the step and the stage it first appeared on
    # (on with debug too); fp16 loss scaling's overflow handling is unchanged.
    check_finite: bool = False
    # Record each rank's pipeline actions, messages and gradient buckets and write a Chrome trace
    # and a picture (smp.services.timeline). Given as true, a dict of TimelineOptions' fields, or
    # the environment variable SMP_TIMELINE=<dir>; None: off.
    timeline: TimelineOptions | None = None
    # Inputs whose shapes change between steps: each new input signature is captured and cached
    # (smp.engine.signatures). Warn once at this many distinct signatures (capture costs time)...
    signature_warn_after: int = 8
    # ... and keep at most this many captured (train/eval mode, signature) graphs, evicting the
    # least recently used.
    signature_cache_size: int = 32
    # torch.compile each stage's graph (per cached signature): true, or a dict of torch.compile's
    # options ({"backend": "inductor", "mode": ..., "dynamic": ...}); None: eager.
    compile: dict | None = None
    # Pipeline messages on one tag, posted in an order both ends derive from the schedule (what
    # NCCL needs; smp.pipeline.message_order). None: on for CUDA tensors (sent GPU to GPU), off
    # for CPU tensors (tagged Gloo messages); true selects it on CPU too.
    ordered_messages: bool | None = None
    # With shard_optimizer_state: reduce each gradient bucket as soon as it is complete and keep
    # only this rank's chunk of it (ZeRO-2), so the full fp32 gradients never exist at once. It
    # saves memory where buckets complete early in the backward: one microbatch, no accumulation
    # over steps (smp.data_parallel.grad_sync). None: on where it saves memory, true: on wherever
    # it can be (no parameter shared across pipeline stages), false: off.
    shard_gradients: bool | None = None

    @property
    def placement_order(self) -> str:
        """The layout as a permutation of D, P, T (rightmost varies fastest)."""
        return PLACEMENT_ALIASES.get(self.placement_strategy, self.placement_strategy)

    @property
    def num_active_microbatches(self) -> int:
        if self.active_microbatches is not None:
            return self.active_microbatches
        return min(self.pipeline_parallel_degree + 2, self.microbatches)

    def schedule(self) -> schedules.Schedule:
        """The pipeline's schedule under this config (one object per config: every step asks)."""
        return _schedule(
            self.pipeline, self.pipeline_parallel_degree, self.microbatches, self.num_active_microbatches
        )

    def check_world(self, world_size: int, local_size: int | None = None) -> None:
        """Checks the layout against the processes there are; warns where SMP's advice applies."""
        pp, tp = self.pipeline_parallel_degree, self.tensor_parallel_degree
        cp = self.context_parallel_degree
        degrees = f"pipeline_parallel_degree ({pp}) x tensor_parallel_degree ({tp})"
        if cp > 1:
            degrees += f" x context_parallel_degree ({cp})"
        if world_size % (pp * tp * cp):
            raise ValueError(
                f"smp config: world size {world_size} is not divisible by {degrees} = {pp * tp * cp}; "
                f"launch a multiple of {pp * tp * cp} processes or change the degrees"
            )
        sdp, dp = self.sharded_data_parallel_degree, world_size // (pp * tp * cp)
        if dp % sdp:
            divisors = [d for d in range(1, dp + 1) if dp % d == 0]
            raise ValueError(
                f"smp config: sharded_data_parallel_degree={sdp} does not divide the data-parallel "
                f"degree {dp} (world size {world_size} / ({degrees})); set it to one of {divisors}"
            )
        if local_size is not None and tp > local_size:
            warnings.warn(
                f"smp config: tensor_parallel_degree={tp} is larger than the {local_size} processes "
                "per node, so tensor parallelism crosses nodes and its activations travel between "
                "them; keep tensor_parallel_degree <= processes per node and use pipeline "
                "parallelism across nodes",
                stacklevel=3,
            )


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_schedule = functools.lru_cache(maxsize=16)(schedules.Schedule)
# A week: longer than any wait a job can mean, and far inside what the C++ timeouts (int64
# milliseconds) and datetime.timedelta can hold.
# The pipeline schedules are smp.schedules' kinds.
_CHOICES = {
    "pipeline": schedules.NAMES,
    "optimize": ("speed", "memory"),
    "cp_comm_type": ("p2p", "all_gather", "a2a"),
}


_POSITIVE_INTS = (
    "pipeline_parallel_degree",
    "tensor_parallel_degree",
    "microbatches",
    "activation_loading_horizon",
    "sharded_data_parallel_degree",
    "context_parallel_degree",
    "signature_warn_after",
    "signature_cache_size",
)


def from_env(var: str | None = None) -> dict[str, Any]:
    """The config held as JSON in `var`; without `var`, SMP_CONFIG under SM_HP_MP_PARAMETERS."""
    if var is None:
        return {**from_env(DEFAULTS_VAR), **from_env(LAUNCHER_VAR)}
    text = os.environ.get(var)
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"smp config: {var} is not valid JSON ({e}); set it to a JSON object") from e
    if not isinstance(value, dict):
        raise ValueError(f"smp config: {var} must hold a JSON object, got {type(value).__name__}")
    return value


def parse(config: Mapping[str, Any] | None = None) -> Config:
    """Merges SMP_CONFIG, `config` and SM_HP_MP_PARAMETERS (each winning over the one before,
    key by key) and validates the result."""
    if config is not None and not isinstance(config, Mapping):
        raise ValueError(f"smp config must be a dict, got {type(config).__name__}: {config!r}")
    script = _normalized(dict(config or {}), "the config")
    launcher = _normalized(from_env(LAUNCHER_VAR), LAUNCHER_VAR)
    overridden = {k: (script[k], v) for k, v in launcher.items() if k in script and script[k] != v}
    if overridden:
        changes = ", ".join(f"'{k}'={new!r} (script: {old!r})" for k, (old, new) in overridden.items())
        warnings.warn(
            f"smp config: {LAUNCHER_VAR} sets {changes}; the launcher's config wins over the script's, "
            "as in SMP v1 on SageMaker",
            stacklevel=3,
        )
    merged = {**_normalized(from_env(DEFAULTS_VAR), DEFAULTS_VAR), **script, **launcher}
    if "timeline" not in merged and os.environ.get(TIMELINE_VAR):
        merged["timeline"] = {"path": os.environ[TIMELINE_VAR]}
    values = {name: _check_value(name, value) for name, value in merged.items()}
    config = _check_combination(Config(**values))
    warn_unmapped_sdp_keys(merged, config.sharded_data_parallel_degree)
    return config


def _normalized(source: dict[str, Any], where: str) -> dict[str, Any]:
    """One source's keys under their canonical names, legacy no-op keys dropped (with a warning)."""
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in source.items():
        name = ALIASES.get(key, key)
        if name in LEGACY_NO_OP_KEYS:
            _warn_no_op(name)
            continue
        if name not in _FIELDS:
            raise ValueError(_unknown_key_message(key))
        if value is None and name in NULL_MEANS_DEFAULT:
            continue
        if name in out and out[name] != value:
            first = given_as[name]
            raise ValueError(
                f"smp config: '{first}' ({out[name]!r}) and '{key}' ({value!r}) disagree in {where}; "
                "set only one of them"
            )
        out[name], given_as[name] = value, key
    return out


def _warn_no_op(key: str) -> None:
    # One warning per key (Python shows a given warning once per call site).
    warnings.warn(f"smp config: '{key}' {LEGACY_NO_OP_KEYS[key]}; accepted, with no effect", stacklevel=4)


def _unknown_key_message(key: str) -> str:
    known = sorted([*_FIELDS, *ALIASES])
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(_FIELDS))}"
    return f"smp config: unknown key '{key}'{hint}"


def _check_value(name: str, value: Any) -> Any:
    default = _FIELDS[name].default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise type_error(name, value, "true or false")
        return value
    if name in ("sdp_reduce_bucket_size", "sdp_param_persistence_threshold", "sdp_max_live_parameters"):
        # SMP v1 scripts write them as int(5e8) or 5e8
        bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        if bad or value < 0 or value != int(value):
            raise type_error(name, value, "a non-negative whole number of elements, e.g. 500000000")
        return int(value)
    if name == "sdp_gradient_clipping":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise type_error(name, value, "a number (the L2 norm to clip to; <= 0: no clipping)")
        return float(value)
    if name == "memory_weight":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise type_error(name, value, "a number in [0, 1]")
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"smp config: 'memory_weight' must be in [0, 1], got {value!r}")
        return float(value)
    if name in ("placement_strategy", *_CHOICES) and not isinstance(value, str):
        raise type_error(name, value, "a string")  # (a list or dict is not even hashable)
    if name == "placement_strategy":
        if value not in PLACEMENT_ALIASES and value not in PLACEMENT_ORDERS:
            raise ValueError(
                f"smp config: 'placement_strategy' must be 'cluster', 'spread' or a permutation of "
                f"'DPT' ({', '.join(PLACEMENT_ORDERS)}), got {value!r}"
            )
        return value
    if name == "ordered_messages":
        if value is not None and not isinstance(value, bool):
            raise type_error(name, value, "true, false or null (null: on for CUDA, off for CPU)")
        return value
    if name == "shard_gradients":
        if value is not None and not isinstance(value, bool):
            raise type_error(name, value, "true, false or null (null: where it saves memory)")
        return value
    if name == "timeout":
        return check_timeout(value, "'timeout'")
    if name == "timeline":
        return check_timeline(value)
    if name == "compile":
        return check_compile(value)
    if name in _CHOICES:
        if value not in _CHOICES[name]:
            choices = " or ".join(repr(c) for c in _CHOICES[name])
            raise ValueError(f"smp config: '{name}' must be {choices}, got {value!r}")
        return value
    # The remaining fields are integers.
    if value is None and name == "active_microbatches":
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(name, value, "an integer")
    if (name in _POSITIVE_INTS or name == "active_microbatches") and value < 1:
        raise ValueError(f"smp config: '{name}' must be a positive integer, got {value!r}")
    if name == "default_partition" and value < 0:
        raise ValueError(f"smp config: 'default_partition' must be >= 0, got {value!r}")
    return value


def _check_combination(config: Config) -> Config:
    pp, tp = config.pipeline_parallel_degree, config.tensor_parallel_degree
    if config.fp16 and config.bf16:
        raise ValueError("smp config: 'fp16' and 'bf16' are both true; choose one half-precision type")
    if config.active_microbatches is not None and config.active_microbatches > config.microbatches:
        raise ValueError(
            f"smp config: active_microbatches ({config.active_microbatches}) exceeds microbatches "
            f"({config.microbatches}); set active_microbatches <= microbatches"
        )
    stages = schedules.num_stages(config.pipeline, pp)
    if config.default_partition >= stages:
        counted = "pipeline_parallel_degree" if stages == pp else "the stages, 2 x pipeline_parallel_degree"
        raise ValueError(
            f"smp config: default_partition ({config.default_partition}) must be in [0, "
            f"{counted}) = [0, {stages}); set it to a stage index below {stages}"
        )
    if config.sharded_data_parallel_degree != 1:
        _check_sdp(config)
    _check_cuda_graphs(config)
    if tp & (tp - 1):
        warnings.warn(
            f"smp config: tensor_parallel_degree={tp} is not a power of two; SMP recommends 2, 4 or 8 "
            "(at most the GPUs per node) for efficient collectives",
            stacklevel=3,
        )
    return config


# torch.compile modes that record CUDA graphs (CUDAGraph trees).
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _check_cuda_graphs(config: Config) -> None:
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


def _check_sdp(config: Config) -> None:
    """Sharded data parallelism (smp.sharded_data, on FSDP2) with what it cannot serve: each a
    clear error naming the fix."""
    sdp = config.sharded_data_parallel_degree
    head = f"smp config: sharded_data_parallel_degree={sdp}"
    if config.shard_optimizer_state:
        raise ValueError(
            f"{head} already shards the optimizer state (with the parameters and gradients); "
            "shard_optimizer_state=True is its ZeRO-1 alternative: set only one of them"
        )
    if config.schedule().splits_backward:
        raise ValueError(
            f"{head} with pipeline '{config.pipeline}': FSDP2 reduce-scatters a layer's gradients "
            "when its backward ends, but this schedule computes weight gradients later; use "
            "pipeline 'interleaved' or 'simple'"
        )
