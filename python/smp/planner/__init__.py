"""The config planner: `smp.plan(...)` in Python, `python -m smp.plan` on the command line.

It walks the Best Practices seed's list in order (walk.py) over a model's counts (model_facts.py
from a Hugging Face config, measured_facts.py from a real module), estimating each layout's
memory per GPU (memory.py) and its step time on the hardware described (hardware.py,
step_time.py), and recommends the fastest layout that fits. `scan.py` plans one job over several
cluster sizes. The package is `smp.planner` so that `smp.plan` can be the function;
`smp/plan.py` is the command line's entry point.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from smp.planner import hardware as hardware_
from smp.planner import memory, model_facts, model_presets
from smp.planner.hardware import Hardware
from smp.planner.layout import Layout, cp_problem, ep_problem, from_config
from smp.planner.report import PlanResult
from smp.planner.units import parse_memory
from smp.planner.walk import evaluate, walk

PRECISIONS = ("bf16", "fp16", "fp32")

__all__ = ["Hardware", "Layout", "PlanResult", "plan"]


def plan(
    model: str | Mapping[str, Any] | nn.Module | Callable[[], nn.Module],
    seq_len: int,
    global_batch: int,
    gpus: int,
    gpus_per_node: int | None = None,
    gpu_memory: str | int | None = None,
    layout: Mapping[str, Any] | None = None,
    precision: str = "bf16",
    runtime: str = "smp",
    hardware: str | Mapping[str, Any] | Hardware | None = None,
) -> PlanResult:
    """Plans (or, with `layout`, evaluates) a layout for training `model`.

    model: a Hugging Face config (a path to config.json, a dict, or a PretrainedConfig), a preset's
        name (model_presets.py: "mixtral-8x7b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b"), or an
        nn.Module or a function that builds one (its counts are then measured, see measured_facts).
    seq_len, global_batch: tokens per sample; samples per optimizer step over every GPU.
    gpus, gpus_per_node, gpu_memory: the job; gpu_memory as "40GiB", "80GB" or bytes (both default
        to the hardware's).
    layout: an smp config plus "activation_checkpointing" ("none", "each", "group_N"): evaluate it.
    precision: "bf16", "fp16" or "fp32" for the walk; a `layout` is read as smp.init reads it
        (fp32 unless it sets "fp16" or "bf16").
    runtime: "smp" (this library's buffers) or "smp_v1" (SMP v1's, which the seed's table measured).
    hardware: a preset's name ("a100-40gb", the default: the seed's ml.p4d.24xlarge; "a100-80gb",
        "h100-sxm", "h200"), a JSON file's path or a dict of its fields (docs/planner.md), or a
        Hardware: what the step time is computed on.
    """
    workload = make_workload(seq_len, global_batch, gpus, gpus_per_node, gpu_memory, hardware)
    check_choices(precision, runtime)
    return plan_job(facts_of(model, seq_len), workload, layout, precision, runtime)


def plan_job(
    facts: model_facts.ModelFacts,
    workload: memory.Workload,
    layout: Mapping[str, Any] | None = None,
    precision: str = "bf16",
    runtime: str = "smp",
) -> PlanResult:
    """`plan` over counts and a job already built (scan.py plans one model on many jobs)."""
    chosen = memory.RUNTIMES[runtime]
    if layout is not None:
        candidate = from_config(layout, workload.gpus)
        _check_tp(candidate, facts)
        problem = cp_problem(candidate, workload.seq_len, facts.heads) or ep_problem(candidate, facts.experts)
        if problem:
            raise ValueError(f"smp.plan: {problem}")
        return PlanResult(facts, workload, runtime, evaluated=evaluate(facts, candidate, workload, chosen))
    done = walk(facts, workload, chosen, precision)
    return PlanResult(facts, workload, runtime, tuple(done.candidates), tuple(done.notes))


def check_choices(precision: str, runtime: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"smp.plan: precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if runtime not in memory.RUNTIMES:
        raise ValueError(f"smp.plan: runtime {runtime!r} is not one of {', '.join(memory.RUNTIMES)}")


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"smp.plan: {name} must be a positive integer, got {value!r}")
    return value


def make_workload(
    seq_len, global_batch, gpus, gpus_per_node=None, gpu_memory=None, hardware=None
) -> memory.Workload:
    """The job, checked: every mistake a ValueError naming the value and the fix."""
    hw = hardware_.load(hardware)
    gpus = _positive("gpus", gpus)
    if gpus_per_node is not None:
        _positive("gpus_per_node", gpus_per_node)
    per_node = hardware_.check_nodes(hw, gpus, gpus_per_node)
    return memory.Workload(
        seq_len=_positive("seq_len", seq_len),
        global_batch=_positive("global_batch", global_batch),
        gpus=gpus,
        gpus_per_node=per_node,
        gpu_memory=hw.memory if gpu_memory is None else parse_memory(gpu_memory),
        hardware=hw,
    )


def facts_of(model, seq_len: int) -> model_facts.ModelFacts:
    if isinstance(model, str) and model.lower() in model_presets.MODELS and not os.path.exists(model):
        return model_facts.from_hf_config(model_presets.MODELS[model.lower()], seq_len)
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
