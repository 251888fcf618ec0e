"""A measured module's mixture of experts (measured_facts.py): its layers' experts modules, found
as expert parallelism finds them (smp.expert_parallel.find: transformers' 3-D expert banks), so
that the planner counts E experts' parameters, divided by ep, but top_k experts' compute per token,
as moe_facts.py does from a config.

A bank weight is `[E, out, in]` (`[E, in, out]` where the module `is_transposed`); `gate_up_proj`
/ `up_proj` is the experts' first matrix (tensor parallelism cuts its outputs), `down_proj` their
last (cut along its inputs). The router is the layer's `[E, hidden]` matrix: replicated, as smp's
tensor parallelism leaves it. A `ModuleList` of expert MLPs, which smp does not divide, stays
counted as dense layers (the report's source says so).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

from torch import nn

from smp.expert_parallel.find import ExpertBank, ExpertLayoutError, expert_banks
from smp.planner.facts import Matmul, Params

TOP_K_KEYS = ("num_experts_per_tok", "top_k", "moe_topk")
_FIRST = ("gate_up_proj", "up_proj")


@dataclasses.dataclass(frozen=True)
class Experts:
    experts: int  # per MoE layer
    top_k: int
    moe_layers: int
    expert: Params  # one routed expert's parameters (the average over the MoE layers)
    params: frozenset[int]  # ids of every bank parameter: not counted as the layers' own
    routers: frozenset[int]  # ids of the routers' [E, hidden] matrices: replicated
    matmuls: tuple[Matmul, ...]  # the experts' matrices, at their share of the layers


def find(module: nn.Module, layers: nn.Module, hidden: int, top_k: int | None) -> Experts | None:
    """The experts of `layers`, or None for a dense model (or one whose experts smp cannot divide)."""
    try:
        banks = expert_banks(layers)
    except ExpertLayoutError:
        return None
    if not banks:
        return None
    counts = {b.num_experts for b in banks}
    if len(counts) != 1:
        raise ValueError(
            f"smp.plan: {type(module).__name__}'s MoE layers hold different numbers of experts "
            f"({sorted(counts)}); the planner plans one expert count per model"
        )
    (experts,) = counts
    if top_k is None or not 1 <= top_k <= experts:
        raise ValueError(
            f"smp.plan: {type(module).__name__} has {experts} experts per MoE layer but no experts per "
            f"token in [1, {experts}] (found {top_k!r} as num_experts_per_tok / top_k); set the config's "
            "num_experts_per_tok"
        )
    bank_params = [p for b in banks for p in b.module.parameters(recurse=False)]
    total = sum(p.numel() for p in bank_params) // (experts * len(banks))
    share = len(banks) / len(layers)
    return Experts(
        experts=experts,
        top_k=top_k,
        moe_layers=len(banks),
        expert=Params(total, total),
        params=frozenset(id(p) for p in bank_params),
        routers=frozenset(id(p) for p in layers.parameters() if tuple(p.shape) == (experts, hidden)),
        matmuls=_matmuls(banks[0], share),
    )


def _matmuls(bank: ExpertBank, share: float) -> tuple[Matmul, ...]:
    transposed = bool(getattr(bank.module, "is_transposed", False))
    found = []
    for name in bank.banks:
        weight = getattr(bank.module, name)
        if weight.dim() != 3:
            continue  # a bias
        k, n = (weight.shape[1], weight.shape[2]) if transposed else (weight.shape[2], weight.shape[1])
        found.append(Matmul(k, n, "n" if name in _FIRST else "k", experts=bank.num_experts, share=share))
    return tuple(found)


@contextmanager
def traceable(layers: nn.Module):
    """transformers' "eager" experts loop over the experts hit, found with a data-dependent
    nonzero that a fake-tensor forward cannot follow; "grouped_mm" runs the same (token, expert)
    pairs in one pass of known shape, so its saved tensors stand for eager's (the same rows,
    gathered once rather than expert by expert)."""
    configs = {
        id(c): c
        for m in layers.modules()
        if (c := getattr(m, "config", None)) is not None
        and getattr(c, "_experts_implementation", None) == "eager"
        and hasattr(m, "has_gate")
    }
    for c in configs.values():
        c._experts_implementation = "grouped_mm"
    try:
        yield
    finally:
        for c in configs.values():
            c._experts_implementation = "eager"
