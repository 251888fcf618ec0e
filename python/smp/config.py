"""smp configuration: SMP v1's parameters, their defaults, and validation.

A config comes as a dict to `smp.init(config)`, as JSON in the environment variable
SMP_CONFIG, or as JSON in SM_HP_MP_PARAMETERS (where SageMaker's launcher put it for SMP v1).
Precedence, key by key: SM_HP_MP_PARAMETERS over the script's dict over SMP_CONFIG. The
launcher's config winning over the script's is SMP v1's behaviour on SageMaker (scripts say
so in comments); SMP_CONFIG is smp's own default layer. Every mistake is a ValueError that
names the key, the value and the fix: the checks are smp.config_rules' tables, and the values that
change nothing (warned about) smp.inert's.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from smp import inert, schedules
from smp.config_options import TimelineOptions
from smp.config_rules import PLACEMENT_ALIASES as PLACEMENT_ALIASES
from smp.config_rules import PLACEMENT_ORDERS as PLACEMENT_ORDERS
from smp.config_rules import VALUES, check_agreement
from smp.inert import LEGACY_NO_OP_KEYS as LEGACY_NO_OP_KEYS

DEFAULTS_VAR = "SMP_CONFIG"  # below the script's dict
LAUNCHER_VAR = "SM_HP_MP_PARAMETERS"  # above it, as on SageMaker
ENV_VARS = (DEFAULTS_VAR, LAUNCHER_VAR)

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
    # Expert parallelism (SMP v2's key): the data-parallel replicas a mixture of experts' experts
    # are divided among (smp.expert_parallel); 1: every replica holds every expert.
    expert_parallel_degree: int = 1
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
    # NCCL needs; smp.schedules.lowering). None: on for CUDA tensors (sent GPU to GPU), off
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
        return schedules.default_active(self.pipeline_parallel_degree, self.microbatches)

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
        dp = world_size // (pp * tp * cp)
        for key in ("sharded_data_parallel_degree", "expert_parallel_degree"):  # both cut dp
            degree = getattr(self, key)
            if dp % degree:
                divisors = [d for d in range(1, dp + 1) if dp % d == 0]
                raise ValueError(
                    f"smp config: {key}={degree} does not divide the data-parallel degree {dp} (world "
                    f"size {world_size} / ({degrees})); set it to one of {divisors}, or launch a "
                    f"multiple of {pp * tp * cp * degree} processes"
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
    config = Config(**{name: VALUES[name](name, value) for name, value in merged.items()})
    check_agreement(config)
    inert.warn_config_values(merged, config.sharded_data_parallel_degree)
    return config


def _normalized(source: dict[str, Any], where: str) -> dict[str, Any]:
    """One source's keys under their canonical names, legacy no-op keys dropped (with a warning)."""
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in source.items():
        name = ALIASES.get(key, key)
        if name in LEGACY_NO_OP_KEYS:
            inert.warn_dropped_key(name)
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


def _unknown_key_message(key: str) -> str:
    known = sorted([*_FIELDS, *ALIASES])
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(_FIELDS))}"
    return f"smp config: unknown key '{key}'{hint}"
