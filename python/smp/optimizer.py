"""smp.DistributedOptimizer: a torch optimizer over the DistributedModel's (local) parameters."""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from smp import model as model_lib

_BUILT_BEFORE_WRAP = (
    "smp: this optimizer was built from the module's parameters before smp.DistributedModel wrapped it, "
    "so it holds parameters the model no longer trains. Build it afterwards:\n"
    "    model = smp.DistributedModel(MyModel())\n"
    "    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters()))"
)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer` (built from `model.parameters()` of the DistributedModel).

    After the model is partitioned, each rank's optimizer steps only the parameters of
    its stage; the others were freed. It is a torch Optimizer (LR schedulers accept it)
    whose param_groups and state are the wrapped optimizer's.
    """

    # Optimizer.__init__ is not called: all state lives in the wrapped optimizer.

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        **dynamic_loss_args,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"smp.DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        model = model_lib.current()
        if model is None:
            raise RuntimeError(
                "smp.DistributedOptimizer: create smp.DistributedModel first and build the optimizer from "
                "model.parameters()"
            )
        owned = {id(p) for p in model.module.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if getattr(p, "_smp_replaced", False):
                    raise ValueError(_BUILT_BEFORE_WRAP)
                if id(p) not in owned and not getattr(p, "_smp_nonlocal", False):
                    raise ValueError(
                        "smp.DistributedOptimizer: the optimizer holds a parameter of shape "
                        f"{tuple(p.shape)} "
                        "that is not part of the DistributedModel; build it from model.parameters()"
                    )
        optimizer._smp_distributed = True
        self.optimizer = optimizer
        self._model = model
        self._localized = False

    def step(self, closure=None):
        self._localize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        self._localize()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._localize()
        self.optimizer.load_state_dict(state_dict)

    def local_state_dict(self):
        return self.state_dict()

    def add_param_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)

    def __getattr__(self, name):
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    def _localize(self) -> None:
        """Once, after partitioning: holds this rank's tensor-parallel shards in place of the full
        parameters, and drops the parameters partitioning moved to other stages."""
        if self._localized or not self._model.partitioned:
            return
        for group in self.optimizer.param_groups:
            local = (getattr(p, "_smp_sharded_as", p) for p in group["params"])
            group["params"] = list(dict.fromkeys(p for p in local if not getattr(p, "_smp_nonlocal", False)))
        self._localized = True


_checked: weakref.WeakSet = weakref.WeakSet()


def _check_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Global step pre-hook: catches optimizers that would silently train the wrong parameters."""
    if optimizer in _checked:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(getattr(p, "_smp_replaced", False) for p in params):
        raise RuntimeError(_BUILT_BEFORE_WRAP)
    moved = any(getattr(p, "_smp_nonlocal", False) or hasattr(p, "_smp_sharded_as") for p in params)
    if moved and not getattr(optimizer, "_smp_distributed", False):
        raise RuntimeError(
            "smp: this optimizer holds parameters that pipeline partitioning moved to other ranks or that "
            "tensor parallelism sharded; wrap it: optimizer = smp.DistributedOptimizer(optimizer)"
        )
    model = model_lib.current()
    if model is not None and model.partitioned:
        _checked.add(optimizer)


register_optimizer_step_pre_hook(_check_step)
