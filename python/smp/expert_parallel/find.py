"""Which modules of a model are mixture-of-experts expert banks, and whether smp understands them.

transformers 5 keeps a layer's experts in an `...Experts` module: 3-D banks `gate_up_proj`
`[experts, 2I, H]` (or `up_proj` without a gate) and `down_proj` `[experts, H, I]` (`[experts, in,
out]` where `is_transposed`), optional per-expert biases, applied to `(hidden_states, top_k_index,
top_k_weights)` from the block's router (`transformers.integrations.moe.use_experts_implementation`
marks such classes). Its forward loops over the experts hit, a data-dependent loop no graph capture
follows, so the module is recognised by its parameters and marks rather than by its graph. Anything
else that looks like experts (a `ModuleList` of expert MLPs, 3-D banks of another layout) is named in
an error: smp does not guess how its block routes.
"""

from __future__ import annotations

import dataclasses

from torch import nn


class ExpertLayoutError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class ExpertBank:
    """One recognised experts module: its path, the module, its expert count and bank names."""

    path: str
    module: nn.Module
    num_experts: int
    banks: tuple[str, ...]  # the 3-D parameters holding every expert (and their 2-D biases)


# What a transformers experts module carries (use_experts_implementation's attributes).
_MARKS = ("has_gate", "has_bias", "is_transposed", "_apply_gate", "act_fn")
_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


def expert_banks(model: nn.Module) -> list[ExpertBank]:
    """Every experts module smp can divide among ranks; an error names the first it cannot."""
    found = []
    for path, module in model.named_modules():
        if _is_bank_module(module):
            found.append(_bank(path, module))
        elif _is_expert_list(path, module):
            raise ExpertLayoutError(
                f"smp expert parallelism: {path!r} ({type(module).__name__}) is a ModuleList of "
                f"{len(module)} expert MLPs, a layout whose routing lives in its parent's forward; smp "
                "divides transformers' 3-D expert banks (transformers >= 5 builds Mixtral, Qwen2-MoE, "
                "Qwen3-MoE and OLMoE so): load the model with transformers 5, or set "
                "expert_parallel_degree to 1"
            )
    return found


def _is_bank_module(module: nn.Module) -> bool:
    own = dict(module.named_parameters(recurse=False))
    return "down_proj" in own and own["down_proj"].dim() == 3


def _bank(path: str, module: nn.Module) -> ExpertBank:
    own = dict(module.named_parameters(recurse=False))
    missing = [m for m in _MARKS if not hasattr(module, m)]
    counts = {name: p.shape[0] for name, p in own.items()}
    if missing or len(set(counts.values())) != 1 or not any(w in own for w in _WEIGHTS[:2]):
        raise ExpertLayoutError(
            f"smp expert parallelism: {path!r} ({type(module).__name__}) holds 3-D expert banks "
            f"({', '.join(f'{n} {tuple(p.shape)}' for n, p in own.items())}) in a layout smp does not "
            f"understand (it lacks {', '.join(missing) or 'one leading expert dimension'}); smp divides "
            "transformers' experts modules (use_experts_implementation): set expert_parallel_degree "
            "to 1 for this model"
        )
    if getattr(module, "has_post_expert_norm", False):
        raise ExpertLayoutError(
            f"smp expert parallelism: {path!r} ({type(module).__name__}) normalizes each expert's "
            "output, which smp's expert banks do not do yet; set expert_parallel_degree to 1"
        )
    (num_experts,) = set(counts.values())
    return ExpertBank(path, module, num_experts, tuple(own))


def _is_expert_list(path: str, module: nn.Module) -> bool:
    return isinstance(module, nn.ModuleList) and path.rsplit(".", 1)[-1] == "experts" and len(module) > 1


def check_divides(banks: list[ExpertBank], degree: int, model: nn.Module) -> None:
    """Errors for a model ep cannot divide: no experts at all, or experts that do not divide by E."""
    if not banks:
        raise ExpertLayoutError(
            f"smp config: expert_parallel_degree={degree}, but {type(model).__name__} has no "
            "mixture-of-experts layer (no experts module with 3-D expert banks); set "
            "expert_parallel_degree to 1"
        )
    for bank in banks:
        if bank.num_experts % degree:
            divisors = [d for d in range(1, bank.num_experts + 1) if bank.num_experts % d == 0]
            raise ExpertLayoutError(
                f"smp config: expert_parallel_degree={degree} does not divide the {bank.num_experts} "
                f"experts of {bank.path!r}; set it to one of {divisors} (that also divides the "
                "data-parallel degree)"
            )
