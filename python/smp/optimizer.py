"""smp.DistributedOptimizer: a torch optimizer over the DistributedModel's (local) parameters,
with optional sharded state (ZeRO-1), fp32 master weights, loss scaling and global clipping."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from smp import core, grad_norm
from smp import model as model_lib
from smp.flat_state import FlatState
from smp.loss_scale import LossScaler, any_rank

_BUILT_BEFORE_WRAP = (
    "smp: this optimizer was built from the module's parameters before smp.DistributedModel wrapped it, "
    "so it holds parameters the model no longer trains. Build it afterwards:\n"
    "    model = smp.DistributedModel(MyModel())\n"
    "    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters()))"
)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer` (built from `model.parameters()` of the DistributedModel).

    After the model is partitioned, each rank's optimizer steps only its own parameters:
    its stage's, and its shards of tensor-parallel ones. With `shard_optimizer_state`
    each reduced-data-parallel rank also keeps the optimizer state of only a 1/rdp chunk
    of them (ZeRO-1, see smp.flat_state); with `bf16`/`fp16` it keeps fp32 master
    weights. fp16 training scales the loss: `static_loss_scale`, or `dynamic_loss_scale`
    with SMP's `dynamic_loss_args` (init_scale 2**32, scale_factor 2, scale_window 1000,
    min_scale 1, delayed_shift 1, consecutive_hysteresis False); a step in which any rank
    saw an inf or nan is skipped on every rank. It is a torch Optimizer (LR schedulers
    accept it) whose param_groups and state are the wrapped optimizer's.
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
                moved = getattr(p, "_smp_nonlocal", False) or hasattr(p, "_smp_moved_to")
                if id(p) not in owned and not moved:
                    raise ValueError(
                        "smp.DistributedOptimizer: the optimizer holds a parameter of shape "
                        f"{tuple(p.shape)} "
                        "that is not part of the DistributedModel; build it from model.parameters()"
                    )
        optimizer._smp_distributed = True
        self.optimizer = optimizer
        self._model = model
        self._localized = False
        self._flat: FlatState | None = None
        self._scaler = LossScaler(static_loss_scale, dynamic_loss_scale, **dynamic_loss_args)
        self._overflow = False
        model._optimizers.append(self)

    @property
    def loss_scale(self) -> float:
        return self._scaler.scale

    def step(self, closure=None):
        self._localize()
        if self._overflow:  # every rank agrees: skip, and lower the scale
            self._overflow = False
            self._scaler.update(True)
            self.zero_grad()
            return None
        result = self.optimizer.step(closure)
        if self._flat is not None:
            self._flat.publish()
        self._scaler.update(False)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._flat is None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            return
        self._flat.zero_grad()  # its gradient buffers are kept across steps: set_to_none does not apply

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients about to be applied by their global L2 norm over every stage,
        tensor-parallel shard and optimizer shard (a replicated parameter counts once);
        returns that norm. A collective: call it on every rank."""
        grad_norm.check_norm_type(norm_type, "clip_master_grads")
        self._localize()
        counts = self._model._counts_in_norm
        if self._flat is not None:
            flat = self._flat
            return grad_norm.clip(
                flat.squared_norm(lambda p: counts(p) and self._flat_counts_rdp()), max_norm, flat.scale_grads
            )
        return grad_norm.clip_whole(self._params(), counts, max_norm)

    def state_dict(self):
        """The optimizer state of this rank's parameters, per parameter and whole (with
        shard_optimizer_state, gathered from the reduced-data-parallel group: a collective)."""
        self._localize()
        inner = self.optimizer.state_dict()
        state = self._flat.full_state(inner) if self._flat is not None else inner
        return state | self._scaler_state()

    def local_state_dict(self):
        """This rank's own part: with shard_optimizer_state, the state of its chunk only."""
        self._localize()
        state = self.optimizer.state_dict()
        if self._flat is not None:
            state = state | {"smp_shard": {"rank": core.rdp_rank(), "size": core.rdp_size()}}
        return state | self._scaler_state()

    def load_state_dict(self, state_dict) -> None:
        """Accepts what state_dict() or local_state_dict() returned."""
        self._localize()
        state = dict(state_dict)
        if "smp_loss_scaler" in state:
            self._scaler.load_state_dict(state.pop("smp_loss_scaler"))
        shard = state.pop("smp_shard", None)
        if shard is not None:
            if shard != {"rank": core.rdp_rank(), "size": core.rdp_size()}:
                raise ValueError(
                    f"smp: this local optimizer state is the chunk of rdp rank {shard['rank']} of "
                    f"{shard['size']}, but this is rdp rank {core.rdp_rank()} of {core.rdp_size()}; load "
                    "it on that rank, or save and load the full state_dict()"
                )
        elif self._flat is not None:
            state = self._flat.chunk_state(state)
        self.optimizer.load_state_dict(state)

    def add_param_group(self, param_group) -> None:
        if self._flat is not None:
            raise RuntimeError("smp: add_param_group after the first step is not supported with flat state")
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

    # --- called by the model --------------------------------------------------------------

    def _gradients_ready(self) -> None:
        """After a step's backward and gradient averaging: unscale, check for overflow on every
        rank, and give the master chunks their gradients."""
        self._localize()
        scale = self._scaler.scale
        checks = self._scaler.dynamic or scale != 1.0 or self._model._config.fp16
        if self._flat is not None:
            overflow = self._flat.load_grads(_grad_of, scale, checks)
        else:
            overflow = False
            for p in self._params():
                if p.grad is not None and scale != 1.0:
                    p.grad.div_(scale)
                if checks and p.grad is not None:
                    overflow = overflow or not bool(torch.isfinite(p.grad).all())
        self._overflow = any_rank(overflow) if checks else False

    # --- internals ----------------------------------------------------------------------

    def _params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _flat_counts_rdp(self) -> bool:
        # Sharded: each rank's chunk is its own; unsharded master copies: count on one replica.
        return self._flat_sharded or core.rdp_rank() == 0

    def _localize(self) -> None:
        """Once, after partitioning: holds this rank's tensor-parallel shards in place of the full
        parameters, drops the parameters partitioning moved to other stages, and sets up the
        flat master state when the config shards optimizer state or trains in bf16/fp16."""
        if self._localized or not self._model.partitioned:
            return
        for group in self.optimizer.param_groups:
            local = (_current(p) for p in group["params"])
            group["params"] = list(dict.fromkeys(p for p in local if not getattr(p, "_smp_nonlocal", False)))
        cfg = self._model._config
        self._flat_sharded = bool(cfg.shard_optimizer_state) and core.rdp_size() > 1
        if cfg.shard_optimizer_state or cfg.bf16 or cfg.fp16:
            for group in self.optimizer.param_groups:
                group["params"] = [p for p in group["params"] if p.requires_grad]
            ranks = core.get_rdp_group() if self._flat_sharded else [dist.get_rank()]
            self._flat = FlatState(self.optimizer, core.get_rdp_process_group(), ranks)
            if self._model._grad_sync is not None:
                for flat in self._flat.groups:
                    if flat.grads is not None:
                        self._model._grad_sync.use_flat_grads(flat.grads, flat.params, flat.offsets)
        self._localized = True

    def _scaler_state(self) -> dict:
        if not self._scaler.dynamic and self._scaler.scale == 1.0:
            return {}
        return {"smp_loss_scaler": self._scaler.state_dict()}


def _current(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """The parameter the model now trains in place of `p` (its shard, or its materialized copy)."""
    while hasattr(p, "_smp_moved_to"):
        p = p._smp_moved_to
    return p


def _grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
    """A parameter's averaged gradient, in fp32 when it was accumulated in fp32."""
    main = getattr(p, "_smp_grad32", None)
    return main if main is not None else p.grad


_checked: weakref.WeakSet = weakref.WeakSet()


def _check_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Global step pre-hook: catches optimizers that would silently train the wrong parameters."""
    if optimizer in _checked:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(getattr(p, "_smp_replaced", False) for p in params):
        raise RuntimeError(_BUILT_BEFORE_WRAP)
    moved = any(getattr(p, "_smp_nonlocal", False) or hasattr(p, "_smp_moved_to") for p in params)
    if moved and not getattr(optimizer, "_smp_distributed", False):
        raise RuntimeError(
            "smp: this optimizer holds parameters that pipeline partitioning moved to other ranks or that "
            "tensor parallelism sharded; wrap it: optimizer = smp.DistributedOptimizer(optimizer)"
        )
    model = model_lib.current()
    if model is not None and model.partitioned:
        _checked.add(optimizer)


register_optimizer_step_pre_hook(_check_step)
