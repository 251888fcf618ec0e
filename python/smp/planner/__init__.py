"""The config planner: `smp.plan(...)` in Python, `python -m smp.plan` on the command line.

It walks the Best Practices seed's list in order (walk.py) over a model's counts (model_facts.py
from a Hugging Face config, measured_facts.py from a real module), estimating each layout's
memory per GPU (memory.py) and relative step time (step_time.py), and stops at the first layout
that fits. The package is `smp.planner` so that `smp.plan` can be the function; `smp/plan.py`
is the command line's entry point.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from smp.planner import memory, model_facts
from smp.planner.layout import Layout, from_config
from smp.planner.report import PlanResult
from smp.planner.units import parse_memory
from smp.planner.walk import evaluate, walk

PRECISIONS = ("bf16", "fp16", "fp32")

__all__ = ["Layout", "PlanResult", "plan"]


def plan(
    model: str | Mapping[str, Any] | nn.Module | Callable[[], nn.Module],
    seq_len: int,
    global_batch: int,
    gpus: int,
    gpus_per_node: int = 8,
    gpu_memory: str | int = "40GiB",
    layout: Mapping[str, Any] | None = None,
    precision: str = "bf16",
    runtime: str = "smp",
) -> PlanResult:
    """Plans (or, with `layout`, evaluates) a layout for training `model`.

    model: a Hugging Face config (a path to config.json, a dict, or a PretrainedConfig), or an
        nn.Module or a function that builds one (its counts are then measured, see measured_facts).
    seq_len, global_batch: tokens per sample; samples per optimizer step over every GPU.
    gpus, gpus_per_node, gpu_memory: the job; gpu_memory as "40GiB", "80GB" or bytes.
    layout: an smp config plus "activation_checkpointing" ("none", "each", "group_N"): evaluate it.
    precision: "bf16", "fp16" or "fp32" for the walk; a `layout` is read as smp.init reads it
        (fp32 unless it sets "fp16" or "bf16").
    runtime: "smp" (this library's buffers) or "smp_v1" (SMP v1's, which the seed's table measured).
    """
    workload = _workload(seq_len, global_batch, gpus, gpus_per_node, gpu_memory)
    if precision not in PRECISIONS:
        raise ValueError(f"smp.plan: precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if runtime not in memory.RUNTIMES:
        raise ValueError(f"smp.plan: runtime {runtime!r} is not one of {', '.join(memory.RUNTIMES)}")
    facts = _facts(model, seq_len)
    chosen = memory.RUNTIMES[runtime]
    if layout is not None:
        candidate = from_config(layout, gpus)
        _check_tp(candidate, facts)
        return PlanResult(facts, workload, runtime, evaluated=evaluate(facts, candidate, workload, chosen))
    done = walk(facts, workload, chosen, precision)
    return PlanResult(facts, workload, runtime, tuple(done.candidates), tuple(done.notes))


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"smp.plan: {name} must be a positive integer, got {value!r}")
    return value


def _workload(seq_len, global_batch, gpus, gpus_per_node, gpu_memory) -> memory.Workload:
    gpus = _positive("gpus", gpus)
    per_node = _positive("gpus_per_node", gpus_per_node)
    if gpus > per_node and gpus % per_node:
        raise ValueError(
            f"smp.plan: {gpus} GPUs do not fill nodes of {per_node}; give a multiple of gpus_per_node"
        )
    return memory.Workload(
        seq_len=_positive("seq_len", seq_len),
        global_batch=_positive("global_batch", global_batch),
        gpus=gpus,
        gpus_per_node=per_node,
        gpu_memory=parse_memory(gpu_memory),
    )


def _facts(model, seq_len: int) -> model_facts.ModelFacts:
    if isinstance(model, str):
        return model_facts.from_hf_config(model_facts.load_hf_config(model), seq_len)
    if isinstance(model, Mapping):
        return model_facts.from_hf_config(model, seq_len)
    if isinstance(model, nn.Module) or callable(model):
        from smp.planner import measured_facts  # imports the module's code only when asked

        return measured_facts.from_module(model, seq_len)
    if hasattr(model, "to_dict"):  # a transformers PretrainedConfig
        return model_facts.from_hf_config(model.to_dict(), seq_len)
    raise ValueError(
        "smp.plan: model must be a config.json path, a config dict, an nn.Module or a function building "
        f"one, got {type(model).__name__}"
    )


def _check_tp(layout: Layout, facts: model_facts.ModelFacts) -> None:
    tp = layout.tp
    if facts.heads % tp or facts.kv_heads % tp:
        divisors = [d for d in (1, 2, 4, 8, 16, 32, 64) if facts.heads % d == 0 and facts.kv_heads % d == 0]
        raise ValueError(
            f"smp.plan: tensor_parallel_degree {tp} does not divide the model's {facts.heads} attention "
            f"heads ({facts.kv_heads} key/value heads); choose one of {divisors}"
        )
