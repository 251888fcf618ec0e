"""SMP v1 settings that change nothing in smp, each with why: config keys that never do (accepted
and dropped), config values and DistributedModel arguments that changed something in SMP v1 but
not here (kept, and warned about only when given such a value: a script's defaults stay quiet).
Each warns once, naming the setting, the value and why it has no effect."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

_PLUMBING = "configured SMP v1's plumbing (SageMaker, Horovod)"
# Config keys that real scripts pass and that change nothing in smp, whatever their value:
# accepted, dropped, and warned about. key -> why it has no effect.
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

# Config keys whose value smp reads nowhere, or only with sharded data parallelism on: key ->
# (whether a value given with this config changes something in SMP v1 that it does not in smp,
# why). `sdp` is sharded_data_parallel_degree.
Applies = Callable[[Any, int], bool]
CONFIG_VALUES: dict[str, tuple[Applies, str]] = {
    "optimize": (
        lambda value, sdp: value == "memory",
        "SMP v1 balanced its partition and pipeline for memory with it; smp's partition weighs "
        "memory by 'memory_weight' (raise it towards 1.0) and its pipeline keeps "
        "'active_microbatches' in flight (lower it)",
    ),
    # SMP v1 averaged gradients over replicas only with ddp true; smp always does (true is a no-op).
    "ddp": (
        lambda value, sdp: value is False,
        "smp averages gradients over the data-parallel replicas whenever there are several "
        "(SMP v1 did so only with 'ddp': true); remove the key or set it true",
    ),
    "skip_tracing": (
        lambda value, sdp: value is True,
        "SMP v1 then skipped its tracing run; smp always captures the model at the first step, on "
        "fake tensors (no device memory or compute)",
    ),
    "sdp_reduce_bucket_size": (
        lambda value, sdp: sdp > 1,
        "FSDP2 reduce-scatters each sharded unit's (layer's) gradients as one collective, so the "
        "unit is the bucket; there is no bucket size to set",
    ),
    "sdp_hierarchical_allgather": (
        lambda value, sdp: sdp > 1 and value is not False,
        "FSDP2 all-gathers each unit over the sdp group in one collective (NCCL picks its own "
        "algorithm across nodes); there is no two-level all-gather to turn on",
    ),
}

# smp.DistributedModel's arguments that change nothing: name -> (whether a value changes something
# in SMP v1 that it does not in smp: SMP v1's default never does, why).
MODEL_ARGUMENTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "trace_device": (
        lambda value: value != "gpu",
        "SMP v1 ran its tracing step on that device; smp captures the model on fake tensors (no "
        "device memory), wherever the first microbatch's tensors are",
    ),
    "trace_memory_usage": (
        lambda value: bool(value),
        "SMP v1 then measured memory in its tracing step to partition by it; smp's partition counts "
        "parameter and activation bytes from the captured graph (weighed by 'memory_weight')",
    ),
    "overlapping_allreduce": (
        lambda value: not value,
        "SMP v1 then reduced gradients after the backward; smp's gradient buckets always start "
        "during the backward, as soon as each is complete",
    ),
    "find_unused_parameters": (
        lambda value: bool(value),
        "SMP v1 passed it to DDP to find parameters without gradients; smp's gradient sync always "
        "handles them (they need no setting)",
    ),
    "gradient_as_bucket_view": (
        lambda value: bool(value),
        "smp's gradients already are views of its flat gradient buffers, which its buckets average in place",
    ),
}


def warn_dropped_key(key: str) -> None:
    """The warning for a LEGACY_NO_OP_KEYS key (Python shows a given warning once per call site)."""
    warnings.warn(f"smp config: '{key}' {LEGACY_NO_OP_KEYS[key]}; accepted, with no effect", stacklevel=4)


def warn_config_values(given: Mapping[str, Any], sdp: int) -> None:
    """One warning for each key of CONFIG_VALUES given a value that changes nothing here."""
    for key, (applies, why) in CONFIG_VALUES.items():
        if key in given and applies(given[key], sdp):
            warnings.warn(f"smp config: '{key}': {given[key]!r} has no effect: {why}", stacklevel=4)


def warn_model_arguments(given: Mapping[str, Any]) -> None:
    """One warning for each DistributedModel argument given a value that changes nothing here."""
    for name, (applies, why) in MODEL_ARGUMENTS.items():
        if applies(given[name]):
            warnings.warn(f"smp.DistributedModel: {name}={given[name]!r} has no effect: {why}", stacklevel=3)
