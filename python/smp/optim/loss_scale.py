"""Loss scaling for fp16 training, with SMP v1's (apex's) static and dynamic semantics.

model.backward multiplies the loss gradient by `scale`; the optimizer divides the
gradients by it, and when any rank saw an inf or nan every rank skips that step.
Dynamic scaling halves the scale (by scale_factor, not below min_scale) after an
overflow, once `delayed_shift` consecutive overflows have been seen, and doubles it
after `scale_window` steps without one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smp import faults

DEFAULTS = {
    "init_scale": 2.0**32,
    "scale_factor": 2.0,
    "scale_window": 1000,
    "min_scale": 1.0,
    "delayed_shift": 1,
    "consecutive_hysteresis": False,
}


class LossScaler:
    def __init__(self, static_loss_scale: float = 1.0, dynamic: bool = False, **args):
        unknown = sorted(set(args) - set(DEFAULTS))
        if unknown:
            raise TypeError(
                f"smp.DistributedOptimizer: unknown dynamic_loss_args {unknown}; known: {sorted(DEFAULTS)}"
            )
        if static_loss_scale <= 0:
            raise ValueError(
                f"smp.DistributedOptimizer: static_loss_scale must be > 0, got {static_loss_scale}"
            )
        self.dynamic = dynamic
        self.args = DEFAULTS | args
        self.scale = float(self.args["init_scale"]) if dynamic else float(static_loss_scale)
        self._good_steps = 0
        self._hysteresis = int(self.args["delayed_shift"])

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self._hysteresis <= 1:
                self.scale = max(self.scale / self.args["scale_factor"], float(self.args["min_scale"]))
            else:
                self._hysteresis -= 1
            self._good_steps = 0
            return
        if self.args["consecutive_hysteresis"]:
            self._hysteresis = int(self.args["delayed_shift"])
        self._good_steps += 1
        if self._good_steps % int(self.args["scale_window"]) == 0:
            self.scale *= self.args["scale_factor"]
            self._hysteresis = int(self.args["delayed_shift"])

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis": self._hysteresis}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis = int(state["hysteresis"])


def from_smp_args(fp16: bool, static_scale, dynamic: bool, args: dict | None, kwargs: dict) -> LossScaler:
    """SMP v1's loss-scaling arguments of DistributedOptimizer: checked always, used only in fp16
    training (a scaler of 1 otherwise)."""
    if args is not None and not isinstance(args, dict):
        raise TypeError(
            f"smp.DistributedOptimizer: dynamic_loss_args must be a dict such as "
            f"{{'scale_window': 1000, 'min_scale': 1, 'delayed_shift': 2}}, got {type(args).__name__}"
        )
    both = sorted(set(args or {}) & set(kwargs))
    if both:
        raise TypeError(f"smp.DistributedOptimizer: {both} given both in dynamic_loss_args and as keywords")
    scaler = LossScaler(1.0 if static_scale is None else static_scale, dynamic, **(args or {}), **kwargs)
    return scaler if fp16 else LossScaler(1.0, False)


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank if `flag` is true on any rank of the world."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device or torch.device("cpu"))
    with faults.waiting(
        "the optimizer's overflow check (any rank's inf/nan)", faults.group_of("world", None)
    ):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
