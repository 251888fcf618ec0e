"""Guards around optimizers in an smp script: a DistributedOptimizer holds only the model's
parameters, and a plain torch optimizer that would silently step the wrong ones (built before
wrapping and not wrapped, or holding parameters partitioning moved away) is stopped at its step."""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from smp import model as model_lib
from smp import params as param_facts

_BUILT_BEFORE_WRAP = (
    "smp: this optimizer was built from the module's parameters before smp.DistributedModel wrapped it, "
    "and is not wrapped in smp.DistributedOptimizer, so it holds parameters the model no longer trains. "
    "Wrap it (smp.DistributedOptimizer follows its parameters and state to the ones the model trains):\n"
    "    model = smp.DistributedModel(MyModel())\n"
    "    optimizer = smp.DistributedOptimizer(optimizer)"
)


def check_owned(optimizer: torch.optim.Optimizer, owned: set[int]) -> None:
    """Every parameter the optimizer holds is the model's (or what the model made of it)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(param_facts.current(p)) not in owned and not param_facts.left_this_rank(p):
                raise ValueError(
                    "smp.DistributedOptimizer: the optimizer holds a parameter of shape "
                    f"{tuple(p.shape)} that is not part of the DistributedModel; build it from "
                    "model.parameters()"
                )


_checked: weakref.WeakSet = weakref.WeakSet()  # optimizers found right once partitioned
wrapped: weakref.WeakSet = weakref.WeakSet()  # optimizers a DistributedOptimizer wraps


def _check_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Global step pre-hook: catches optimizers that would silently train the wrong parameters."""
    if optimizer in _checked:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(param_facts.is_replaced(p) for p in params):
        raise RuntimeError(_BUILT_BEFORE_WRAP)
    moved = any(param_facts.left_this_rank(p) for p in params)
    if moved and optimizer not in wrapped:
        raise RuntimeError(
            "smp: this optimizer holds parameters that pipeline partitioning moved to other ranks or that "
            "tensor parallelism sharded; wrap it: optimizer = smp.DistributedOptimizer(optimizer)"
        )
    model = model_lib.current()
    if model is not None and model.partitioned:
        _checked.add(optimizer)


register_optimizer_step_pre_hook(_check_step)
