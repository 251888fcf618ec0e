"""The config's checks as tables: what each key's value must be (VALUES: key -> its check), and
how keys must agree (AGREEMENT: rules, each with the keys it reads, when it is broken, and the
message naming the values and the fix). Values that change nothing here are smp.inert's."""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable
from typing import Any

from smp import schedules
from smp.config_options import check_compile, check_timeline, check_timeout, type_error

PLACEMENT_ALIASES = {"cluster": "DPT", "spread": "TPD"}
PLACEMENT_ORDERS = tuple("".join(p) for p in itertools.permutations("DPT"))

# --- one key's value: (key, value) -> the value to keep, or a ValueError ------------------------

Check = Callable[[str, Any], Any]


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise type_error(name, value, "true or false")
    return value


def _flag_or_null(null_means: str) -> Check:
    def check(name: str, value: Any) -> bool | None:
        if value is not None and not isinstance(value, bool):
            raise type_error(name, value, f"true, false or null (null: {null_means})")
        return value

    return check


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(name, value, "an integer")
    return value


def _positive(name: str, value: Any) -> int:
    if _integer(name, value) < 1:
        raise ValueError(f"smp config: '{name}' must be a positive integer, got {value!r}")
    return value


def _positive_or_null(name: str, value: Any) -> int | None:
    return None if value is None else _positive(name, value)


def _index(name: str, value: Any) -> int:
    if _integer(name, value) < 0:
        raise ValueError(f"smp config: '{name}' must be >= 0, got {value!r}")
    return value


def _element_count(name: str, value: Any) -> int:
    # SMP v1 scripts write them as int(5e8) or 5e8
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or value < 0 or value != int(value):
        raise type_error(name, value, "a non-negative whole number of elements, e.g. 500000000")
    return int(value)


def _norm(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise type_error(name, value, "a number (the L2 norm to clip to; <= 0: no clipping)")
    return float(value)


def _share(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error(name, value, "a number in [0, 1]")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"smp config: '{name}' must be in [0, 1], got {value!r}")
    return float(value)


def _string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise type_error(name, value, "a string")  # (a list or dict is not even hashable)
    return value


def _one_of(*choices: str) -> Check:
    def check(name: str, value: Any) -> str:
        if _string(name, value) not in choices:
            listed = " or ".join(repr(c) for c in choices)
            raise ValueError(f"smp config: '{name}' must be {listed}, got {value!r}")
        return value

    return check


def _placement(name: str, value: Any) -> str:
    if _string(name, value) not in PLACEMENT_ALIASES and value not in PLACEMENT_ORDERS:
        raise ValueError(
            f"smp config: '{name}' must be 'cluster', 'spread' or a permutation of "
            f"'DPT' ({', '.join(PLACEMENT_ORDERS)}), got {value!r}"
        )
    return value


VALUES: dict[str, Check] = {
    "pipeline_parallel_degree": _positive,
    "tensor_parallel_degree": _positive,
    "microbatches": _positive,
    "pipeline": _one_of(*schedules.NAMES),
    "active_microbatches": _positive_or_null,
    "prescaled_batch": _flag,
    "shard_optimizer_state": _flag,
    "placement_strategy": _placement,
    "auto_partition": _flag,
    "default_partition": _index,
    "memory_weight": _share,
    "optimize": _one_of("speed", "memory"),
    "ddp": _flag,
    "fp16": _flag,
    "bf16": _flag,
    "offload_activations": _flag,
    "activation_loading_horizon": _positive,
    "delayed_parameter_initialization": _flag,
    "tensor_parallel_seed": _integer,
    "skip_tracing": _flag,
    "sharded_data_parallel_degree": _positive,
    "expert_parallel_degree": _positive,
    "context_parallel_degree": _positive,
    "cp_comm_type": _one_of("p2p", "all_gather", "a2a"),
    "sdp_reduce_bucket_size": _element_count,
    "sdp_param_persistence_threshold": _element_count,
    "sdp_max_live_parameters": _element_count,
    "sdp_hierarchical_allgather": _flag,
    "sdp_gradient_clipping": _norm,
    "colocate_shared_parameters": _flag,
    "debug": _flag,
    "timeout": lambda name, value: check_timeout(value, f"'{name}'"),
    "check_finite": _flag,
    "timeline": lambda name, value: check_timeline(value),
    "signature_warn_after": _positive,
    "signature_cache_size": _positive,
    "compile": lambda name, value: check_compile(value),
    "ordered_messages": _flag_or_null("on for CUDA, off for CPU"),
    "shard_gradients": _flag_or_null("where it saves memory"),
}


# --- keys together: rules over the whole config --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    keys: tuple[str, ...]  # the keys it reads
    broken: Callable[[Any], bool]  # of the Config
    message: Callable[[Any], str]  # naming the values and the fix
    warns: bool = False  # smp runs as asked, where SMP advises otherwise: a warning, not an error


def _stages(c) -> int:
    return schedules.num_stages(c.pipeline, c.pipeline_parallel_degree)


def _partition_message(c) -> str:
    stages = _stages(c)
    counted = "pipeline_parallel_degree"
    if stages != c.pipeline_parallel_degree:
        counted = "the stages, 2 x pipeline_parallel_degree"
    return (
        f"smp config: default_partition ({c.default_partition}) must be in [0, {counted}) = [0, "
        f"{stages}); set it to a stage index below {stages}"
    )


# torch.compile modes that record CUDA graphs (CUDAGraph trees). Allowed only where they were
# measured to keep parity: a model that runs whole. A graph overwrites its outputs at the next
# replay; a pipeline keeps several microbatches' outputs and messages alive at once, and sharded
# layouts run collectives and FSDP2's hooks between graphs.
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
_DEGREES = ("pipeline_parallel_degree", "tensor_parallel_degree", "sharded_data_parallel_degree")


def _split_degrees(c) -> str:
    return ", ".join(f"{k}={getattr(c, k)}" for k in _DEGREES if getattr(c, k) != 1)


def _cuda_graph_message(c) -> str:
    return (
        f"smp config: compile mode {c.compile['mode']!r} records CUDA graphs, which smp supports only "
        f"for a model that runs whole (every degree 1), not with {_split_degrees(c)}; use 'compile': "
        "true (or mode 'default' / 'max-autotune-no-cudagraphs') in this layout"
    )


def _ep_refused(c) -> list[str]:
    """What expert parallelism does not serve yet, of what the config sets."""
    refused = ("context_parallel_degree",)
    out = [f"{k}={getattr(c, k)}" for k in refused if getattr(c, k) != 1]
    captured = [k for k in ("pipeline_parallel_degree", "tensor_parallel_degree") if getattr(c, k) != 1]
    if captured and c.sharded_data_parallel_degree != 1:
        # (FSDP2 over the captured stages would shard each block of experts over the sdp mesh)
        out.append(
            f"sharded_data_parallel_degree={c.sharded_data_parallel_degree} together with "
            + " and ".join(f"{k}={getattr(c, k)}" for k in captured)
        )
    return out


def _sdp(c) -> str:
    return f"smp config: sharded_data_parallel_degree={c.sharded_data_parallel_degree}"


AGREEMENT = (
    Rule(
        ("fp16", "bf16"),
        lambda c: c.fp16 and c.bf16,
        lambda c: "smp config: 'fp16' and 'bf16' are both true; choose one half-precision type",
    ),
    Rule(
        ("active_microbatches", "microbatches"),
        lambda c: c.active_microbatches is not None and c.active_microbatches > c.microbatches,
        lambda c: (
            f"smp config: active_microbatches ({c.active_microbatches}) exceeds microbatches "
            f"({c.microbatches}); set active_microbatches <= microbatches"
        ),
    ),
    Rule(
        ("default_partition", "pipeline", "pipeline_parallel_degree"),
        lambda c: c.default_partition >= _stages(c),
        _partition_message,
    ),
    # Sharded data parallelism (smp.sharded_data, on FSDP2) with what it cannot serve.
    Rule(
        ("sharded_data_parallel_degree", "shard_optimizer_state"),
        lambda c: c.sharded_data_parallel_degree != 1 and c.shard_optimizer_state,
        lambda c: (
            f"{_sdp(c)} already shards the optimizer state (with the parameters and gradients); "
            "shard_optimizer_state=True is its ZeRO-1 alternative: set only one of them"
        ),
    ),
    Rule(
        ("sharded_data_parallel_degree", "pipeline"),
        lambda c: c.sharded_data_parallel_degree != 1 and c.schedule().splits_backward,
        lambda c: (
            f"{_sdp(c)} with pipeline '{c.pipeline}': FSDP2 reduce-scatters a layer's gradients "
            "when its backward ends, but this schedule computes weight gradients later; use "
            "pipeline 'interleaved' or 'simple'"
        ),
    ),
    Rule(
        ("compile", *_DEGREES),
        lambda c: (c.compile or {}).get("mode") in _CUDA_GRAPH_MODES and bool(_split_degrees(c)),
        _cuda_graph_message,
    ),
    # Expert parallelism (smp.expert_parallel) composes with data, pipeline and tensor parallelism
    # and sdp (not sdp over a captured model: pipeline stages or tp) so far.
    Rule(
        ("expert_parallel_degree", *_DEGREES, "context_parallel_degree", "shard_optimizer_state", "compile"),
        lambda c: c.expert_parallel_degree != 1 and bool(_ep_refused(c)),
        lambda c: (
            f"smp config: expert_parallel_degree={c.expert_parallel_degree} runs with data, pipeline "
            f"and tensor parallelism only so far, not with {', '.join(_ep_refused(c))}; set "
            "expert_parallel_degree to 1 for this layout, or drop the others (docs/expert_parallel.md "
            "says what composes)"
        ),
    ),
    Rule(
        ("tensor_parallel_degree",),
        lambda c: bool(c.tensor_parallel_degree & (c.tensor_parallel_degree - 1)),
        lambda c: (
            f"smp config: tensor_parallel_degree={c.tensor_parallel_degree} is not a power of two; "
            "SMP recommends 2, 4 or 8 (at most the GPUs per node) for efficient collectives"
        ),
        warns=True,
    ),
)


def check_agreement(config) -> None:
    """Raises the first broken error rule's ValueError; warns for each broken warning rule."""
    for rule in AGREEMENT:
        if rule.broken(config):
            if not rule.warns:
                raise ValueError(rule.message(config))
            warnings.warn(rule.message(config), stacklevel=3)
