"""What smp knows about each Parameter, behind named functions.

Wrapping, partitioning, sharding and delayed initialization change which Parameter
objects the model trains, while an optimizer (or other user code) may still hold the
old ones. These facts travel with the Parameter objects themselves, so every holder
can ask, and only this module knows how they are stored:

- replaced: smp.DistributedModel gave the module a fresh Parameter in place of this
  one (an optimizer built before wrapping holds these: that mistake is caught);
- moved: the model now trains another Parameter in its place (its tensor-parallel
  shard, or its materialized copy under delayed initialization); `current` follows;
- nonlocal: pipeline partitioning gave it to another stage; this rank freed it;
- expert: expert parallelism gave this rank its block of a mixture of experts' banks (the ranks
  of an ep group hold different experts: each block counts once in a global norm);
- fp32 gradient: under bf16/fp16 its gradient is accumulated in fp32 here, and
  `param.grad` holds it in the parameter's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

_REPLACED = "_smp_replaced"
_MOVED_TO = "_smp_moved_to"
_NONLOCAL = "_smp_nonlocal"
_GRAD32 = "_smp_grad32"
_EXPERT = "_smp_expert"


def mark_expert(param: nn.Parameter) -> None:
    setattr(param, _EXPERT, True)


def is_expert(param: torch.Tensor) -> bool:
    return getattr(param, _EXPERT, False)


def mark_replaced(param: nn.Parameter) -> None:
    setattr(param, _REPLACED, True)


def is_replaced(param: torch.Tensor) -> bool:
    return getattr(param, _REPLACED, False)


def mark_moved(param: nn.Parameter, to: nn.Parameter) -> None:
    """The model trains `to` in place of `param` from now on (the first move wins)."""
    if getattr(param, _MOVED_TO, None) is None:
        setattr(param, _MOVED_TO, to)


def is_moved(param: torch.Tensor) -> bool:
    return getattr(param, _MOVED_TO, None) is not None


def current(param: nn.Parameter) -> nn.Parameter:
    """The Parameter the model trains now in place of `param` (itself if it never moved)."""
    while is_moved(param):
        param = getattr(param, _MOVED_TO)
    return param


def mark_nonlocal(param: nn.Parameter) -> None:
    setattr(param, _NONLOCAL, True)


def is_nonlocal(param: torch.Tensor) -> bool:
    return getattr(param, _NONLOCAL, False)


def left_this_rank(param: torch.Tensor) -> bool:
    """Whether partitioning or sharding took `param` out of this rank's model."""
    return is_nonlocal(param) or is_moved(param)


def grad32(param: nn.Parameter) -> torch.Tensor | None:
    """The fp32 gradient accumulated for a bf16/fp16 parameter (None if none)."""
    return getattr(param, _GRAD32, None)


def set_grad32(param: nn.Parameter, grad: torch.Tensor | None) -> None:
    setattr(param, _GRAD32, grad)


def applied_grad(param: nn.Parameter) -> torch.Tensor | None:
    """A parameter's averaged gradient, in fp32 when it was accumulated in fp32."""
    main = grad32(param)
    return main if main is not None else param.grad


def refresh(module: nn.Module) -> None:
    """Gives the module new Parameter objects (same storage). An optimizer built from the module
    before it was wrapped still holds the old ones: smp.DistributedOptimizer follows them to the
    new ones (marked moved), and an optimizer left unwrapped is caught at its first step."""
    fresh: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in fresh:
                fresh[id(p)] = nn.Parameter(p.data, requires_grad=p.requires_grad)
                mark_replaced(p)
                mark_moved(p, fresh[id(p)])
            m._parameters[name] = fresh[id(p)]
