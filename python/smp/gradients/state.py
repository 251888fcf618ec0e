"""What every gradient regime does alike: the optimizer's parameters followed to the ones the model
trains, fp16 loss scaling and the skipped step, clipping by the global norm, the step itself, and
the optimizer's state as the whole model's (state_dict) or this rank's part (checkpoints).

A regime (plain.py, flat.py, sharded_data.py) says where the gradients the step applies live and
how to read them; the engine makes one, once, when a model with an optimizer is partitioned
(smp.gradients.choose), and the DistributedOptimizer then only talks to it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from smp import params as param_facts
from smp.groups import ParallelGroups
from smp.optim import grad_norm
from smp.optim.loss_scale import LossScaler, any_rank
from smp.state import layout_free


class GradientState:
    """The gradients one optimizer steps, and the step. `counts(p)`: whether this rank counts `p` in
    a global norm; `local_part(p, full)`: this rank's part of a whole value of `p`."""

    flat = None  # the flat ZeRO-1 state (flat.py), if any
    sharded = False  # whether each replica keeps a chunk of the optimizer state of its own

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: LossScaler,
        groups: ParallelGroups,
        counts: Callable[[torch.Tensor], bool],
        local_part: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        fp16: bool,
    ):
        self.optimizer, self.scaler, self.groups = optimizer, scaler, groups
        self._counts, self._local_part, self._fp16 = counts, local_part, fp16
        self.overflow = False  # the coming step must be skipped (an inf or nan on some rank)
        self.skipped = False  # the last step was skipped
        self.gradients_seen = False  # a step's backward has given gradients to step
        follow_moves(optimizer, local_part)
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if not param_facts.is_nonlocal(p)]

    # --- the step's gradients ------------------------------------------------------------

    def step_starting(self) -> None:
        """Before a step's backward (the engine calls it): where a regime builds state of its own
        for the parameters training then, it does so now, once."""

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def gradients_ready(self) -> None:
        """After a step's backward and averaging: unscale and check for inf/nan on every rank."""
        self.gradients_seen = True
        checks = self.scaler.dynamic or self.scaler.scale != 1.0 or self._fp16
        overflow = self._unscale(self.scaler.scale, checks)
        self.overflow = any_rank(overflow) if checks else False

    def _unscale(self, scale: float, check: bool) -> bool:
        """Divides the gradients the step applies by `scale`; with `check`, whether this rank's
        hold an inf or nan."""
        overflow = False
        if scale == 1.0 and not check:
            return False
        for grad in self._applied_grads():
            if scale != 1.0:
                grad.div_(scale)
            if check:
                overflow = overflow or not bool(torch.isfinite(grad).all())
        return overflow

    def _applied_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params() if p.grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def clip(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients about to be applied by their global L2 norm (every stage, shard and
        chunk; a replicated parameter counted once); returns it. A collective on every rank."""
        grad_norm.check_norm_type(norm_type, "clip_master_grads")
        first_replica = grad_norm.first_holder(self.groups.rdp_rank, self.groups.ep_size)
        return grad_norm.clip_whole(self.params(), self._counts, max_norm, first_replica)

    def step(self, closure=None):
        """The optimizer's step, or, after an overflow, a skipped one (on every rank alike)."""
        self.skipped = self.overflow
        if self.overflow:
            self.overflow = False
            self.scaler.update(True)
            self.zero_grad()
            return None
        self._before_step()
        result = self.optimizer.step(closure)
        self._after_step()
        self.scaler.update(False)
        return result

    def _before_step(self) -> None:
        pass

    def _after_step(self) -> None:
        pass

    def params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    # --- state -------------------------------------------------------------------------

    def full_state(self, inner: dict) -> dict:
        """The wrapped optimizer's state_dict as per-parameter whole values of this rank's part."""
        return inner

    def chunk_state(self, full: dict) -> dict:
        """The inverse of full_state: what the wrapped optimizer loads."""
        return full

    def shard_id(self) -> dict[str, int] | None:
        """Which chunk this rank's own optimizer state is (None: it is whole)."""
        return None

    def checkpoint_state(self, places) -> tuple[dict, dict]:
        """(the tensors this rank writes to a layout-free checkpoint; the plain values)."""
        return layout_free.export(self.optimizer, self.flat, places, self.sharded)

    def checkpoint_destinations(self, places, stored):
        return layout_free.destinations(self.optimizer, self.flat, places, stored)

    def attribute(self, name: str):
        """An attribute of another library's optimizer that SMP v1 answered (DeepSpeed's, under
        sharded data parallelism): none here."""
        raise AttributeError(name)


def follow_moves(optimizer: torch.optim.Optimizer, local_part) -> None:
    """Points the optimizer's param groups at the Parameters the model trains now (a parameter
    replaced at wrapping, its tensor-parallel shard, its materialized copy), and moves any state
    with them; a per-element state tensor of the whole parameter is cut to the new one's part."""
    for group in optimizer.param_groups:
        group["params"] = list(dict.fromkeys(param_facts.current(p) for p in group["params"]))
    for old in [p for p in optimizer.state if param_facts.is_moved(p)]:
        new, state = param_facts.current(old), optimizer.state.pop(old)
        if param_facts.is_nonlocal(new):
            continue
        optimizer.state[new] = {
            k: local_part(new, v) if isinstance(v, torch.Tensor) and v.dim() and v.shape != new.shape else v
            for k, v in state.items()
        }
