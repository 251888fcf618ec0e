"""smp.DistributedOptimizer: a torch optimizer over the DistributedModel's (local) parameters,
with optional sharded state (ZeRO-1), fp32 master weights, loss scaling and global clipping."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from smp import model as model_lib
from smp import parallel_state
from smp import params as param_facts
from smp.optim import grad_norm
from smp.optim.flat_state import FlatState, fuse_where_unset
from smp.optim.loss_scale import LossScaler, any_rank
from smp.sharded_data import deepspeed_names
from smp.sharded_data import tensors as sharded_tensors
from smp.state import layout_free

_BUILT_BEFORE_WRAP = (
    "smp: this optimizer was built from the module's parameters before smp.DistributedModel wrapped it, "
    "and is not wrapped in smp.DistributedOptimizer, so it holds parameters the model no longer trains. "
    "Wrap it (smp.DistributedOptimizer follows its parameters and state to the ones the model trains):\n"
    "    model = smp.DistributedModel(MyModel())\n"
    "    optimizer = smp.DistributedOptimizer(optimizer)"
)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer` (built from `model.parameters()` of the DistributedModel).

    After the model is partitioned, each rank's optimizer steps only its own parameters:
    its stage's, and its shards of tensor-parallel ones. With `shard_optimizer_state`
    each reduced-data-parallel rank also keeps the optimizer state of only a 1/rdp chunk
    of them (ZeRO-1, see smp.optim.flat_state); with `bf16`/`fp16` it keeps fp32 master
    weights. fp16 training scales the loss: `static_loss_scale`, or `dynamic_loss_scale`
    with SMP's `dynamic_loss_args` dict (init_scale 2**32, scale_factor 2, scale_window 1000,
    min_scale 1, delayed_shift 1, consecutive_hysteresis False; its keys may also come as
    keywords); a step in which any rank saw an inf or nan is skipped on every rank, and
    `overflow` tells whether the last step was. As in SMP, the loss-scaling arguments apply
    only when the config has `fp16` (scripts pass them in bf16 and fp32 runs too: there they
    are checked and have no effect), and `static_loss_scale=None` means 1. It is a torch
    Optimizer (LR schedulers accept it) whose param_groups and state are the wrapped optimizer's.
    """

    # Optimizer.__init__ is not called: all state lives in the wrapped optimizer.

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        static_loss_scale: float | None = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict | None = None,
        **dynamic_loss_kwargs,
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
        owned = {id(p) for p in model.get_module().parameters()}
        # Built before wrapping, as in SMP's MNIST example: follow the parameters to the model's.
        _follow_moves(optimizer, model.engine.state.local_part)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in owned and not param_facts.left_this_rank(p):
                    raise ValueError(
                        "smp.DistributedOptimizer: the optimizer holds a parameter of shape "
                        f"{tuple(p.shape)} "
                        "that is not part of the DistributedModel; build it from model.parameters()"
                    )
        _wrapped.add(optimizer)
        self.optimizer = optimizer
        self._engine = model.engine
        self._localized = False
        self._flat: FlatState | None = None
        self._scaler = _loss_scaler(
            model.engine.config.fp16,
            static_loss_scale,
            dynamic_loss_scale,
            dynamic_loss_args,
            dynamic_loss_kwargs,
        )
        self._overflow = False  # the coming step must be skipped
        self._skipped = False  # the last step was skipped
        self._engine.attach_optimizer(self)
        if not self._engine.partitioned:  # partitioned by its first step: see step_starting
            self._engine.register_post_partition_hook(lambda optimizer: self.step_starting())

    @property
    def loss_scale(self) -> float:
        return self._scaler.scale

    @property
    def overflow(self) -> bool:
        """Whether the last step() was skipped because some rank's gradients had an inf or nan
        (SMP v1's attribute; scripts skip their LR scheduler's step on it)."""
        return self._skipped

    @property
    def flat_state(self) -> FlatState | None:
        """The flat parameter buffers and ZeRO-1 chunks (None until the first step, or when neither
        shard_optimizer_state nor bf16/fp16 is on); read it, e.g. to time it."""
        return self._flat

    @property
    def sharded(self) -> bool:
        """Whether each reduced-data-parallel rank keeps only its chunk of the optimizer state."""
        return bool(self._engine.config.shard_optimizer_state) and self._engine.groups.rdp_size > 1

    def step(self, closure=None):
        if self._engine.steps_run == 0:
            raise RuntimeError(
                "smp: optimizer.step() was called before any @smp.step function ran the model; call "
                "your @smp.step function (forward and model.backward) first, then optimizer.step()"
            )
        self._localize()
        self._skipped = self._overflow
        if self._overflow:  # every rank agrees: skip, and lower the scale
            self._overflow = False
            self._scaler.update(True)
            self.zero_grad()
            return None
        if self._engine.sharded_data is not None:
            self._engine.sharded_data.clip_before_step()  # SMP v1's sdp_gradient_clipping
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
        if (sharded := self._engine.sharded_data) is not None:  # FSDP2's fp32 sharded gradients
            return sharded.clip_grad_norm(max_norm, norm_type)
        counts = self._engine.counts_in_norm
        first_replica = self._engine.groups.rdp_rank == 0
        if self._flat is not None:
            flat = self._flat
            # Sharded: each rank's chunk is its own; unsharded master copies: count on one replica.
            mine = self.sharded or first_replica
            return grad_norm.clip(flat.squared_norm(lambda p: counts(p) and mine), max_norm, flat.scale_grads)
        return grad_norm.clip_whole(self._params(), counts, max_norm, first_replica)

    def state_dict(self):
        """The whole model's optimizer state, as SMP's: with pipeline stages or tensor parallelism,
        every model-parallel rank's rank_state_dict(), gathered over the model-parallel group (a
        collective: call it on every rank, or on every rank with rdp_rank() == 0); load_state_dict
        then takes this rank's part, on the same layout. Without them, rank_state_dict()."""
        state = self.rank_state_dict()
        groups = self._engine.groups
        if not self._engine.captures or not self._engine.partitioned:
            return state
        parts: list = [None] * parallel_state.mp_size()
        dist.all_gather_object(parts, state, group=parallel_state.get_mp_process_group())
        return {_MP_STATES: parts, _MP_LAYOUT: (groups.pp_size, groups.tp_size)}

    def rank_state_dict(self):
        """The optimizer state of this rank's parameters, per parameter and whole (with
        shard_optimizer_state, gathered from the reduced-data-parallel group: a collective)."""
        self._localize()
        inner = self.optimizer.state_dict()
        state = self._flat.full_state(inner) if self._flat is not None else inner
        return state | self._scaler_state()

    def local_state_dict(self, gather_if_shard: bool = True):
        """This rank's own part: with shard_optimizer_state, the state of its chunk only.
        gather_if_shard (what transformers passes) is accepted: a rank's chunk is never gathered here."""
        self._localize()
        state = self.optimizer.state_dict()
        if self._flat is not None:
            state = state | {"smp_shard": self._shard_id()}
        return state | self._scaler_state()

    def load_state_dict(self, state_dict) -> None:
        """Accepts what state_dict() or local_state_dict() returned. Before the model is partitioned
        (pipeline or tensor parallelism, before the first step) loading waits for partitioning, as
        in SMP: the state belongs to the parameters this rank will keep."""
        if not self._engine.partitioned:
            self._engine.register_post_partition_hook(lambda optimizer: self.load_state_dict(state_dict))
            return
        self._localize()
        state = dict(state_dict)
        if _MP_STATES in state:  # the whole model's, from state_dict(): this rank's part
            groups = self._engine.groups
            layout = (groups.pp_size, groups.tp_size)
            if tuple(state[_MP_LAYOUT]) != layout or not self._engine.captures:
                raise ValueError(
                    f"smp: this optimizer state was gathered with (pipeline, tensor) parallel degrees "
                    f"{tuple(state[_MP_LAYOUT])}, but this run has {layout}; load it on that layout"
                )
            state = dict(state[_MP_STATES][parallel_state.mp_rank()])
        if "smp_loss_scaler" in state:
            self._scaler.load_state_dict(state.pop("smp_loss_scaler"))
        shard = state.pop("smp_shard", None)
        if shard is not None:
            mine = self._shard_id()
            if shard != mine:
                raise ValueError(
                    f"smp: this local optimizer state is the chunk of rdp rank {shard['rank']} of "
                    f"{shard['size']}, but this is rdp rank {mine['rank']} of {mine['size']}; load "
                    "it on that rank, or save and load the full state_dict()"
                )
        elif self._flat is not None:
            state = self._flat.chunk_state(state)
        self.optimizer.load_state_dict(state)

    def checkpoint_state(self, places) -> tuple[dict, dict]:
        """(the tensors this rank writes to a layout-free checkpoint, under the model's parameter
        names in global coordinates; the plain values and hyperparameters, the same on every rank
        after merging). `places` is the model's StatePlaces."""
        self._localize()
        tensors, values = layout_free.export(self.optimizer, self._flat, places, self.sharded)
        meta = {"param_groups": layout_free.hyperparameters(self.optimizer), "values": values}
        return tensors, meta | self._scaler_state()

    def checkpoint_destinations(self, places, stored):
        """(what this rank reads from a layout-free checkpoint whose tensors have the shapes and
        dtypes in `stored`; a function that installs it, given the checkpoint's metadata)."""
        self._localize()
        items, install_state = layout_free.destinations(self.optimizer, self._flat, places, stored)

        def install(meta: dict) -> None:
            layout_free.load_hyperparameters(self.optimizer, meta["param_groups"])
            if "smp_loss_scaler" in meta:
                self._scaler.load_state_dict(meta["smp_loss_scaler"])
            install_state(meta["values"])

        return items, install

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
        if name in deepspeed_names.OPTIMIZER_NAMES:  # SMP v1's sdp answered DeepSpeed's names
            return deepspeed_names.optimizer_attribute(name, self.optimizer, self._engine.sharded_data)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    # --- called by the engine (smp.engine.protocol.GradientConsumer) ----------------------

    def step_starting(self) -> None:
        """Before a step's backward: the flat state is built then (once), so that its gradient
        buffers take the first step's gradients, and no buffer of the gradient averaging's own is
        held beside them (4 more bytes per parameter in the first steps)."""
        self._localize()

    def gradients_ready(self) -> None:
        """After a step's backward and gradient averaging: unscale, check for overflow on every
        rank, and give the master chunks their gradients."""
        self._localize()
        scale = self._scaler.scale
        checks = self._scaler.dynamic or scale != 1.0 or self._engine.config.fp16
        overflow = False
        if self._flat is not None:
            overflow = self._flat.load_grads(scale, checks)
        elif scale != 1.0 or checks:  # else nothing to do per parameter
            for p in self._params():
                grad = None if p.grad is None else sharded_tensors.local(p.grad)  # (sdp: the shard)
                if grad is not None and scale != 1.0:
                    grad.div_(scale)
                if checks and grad is not None:
                    overflow = overflow or not bool(torch.isfinite(grad).all())
        self._overflow = any_rank(overflow) if checks else False

    # --- internals ----------------------------------------------------------------------

    def _params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _shard_id(self) -> dict[str, int]:
        groups = self._engine.groups
        return {"rank": groups.rdp_rank, "size": groups.rdp_size}

    def _localize(self) -> None:
        """Once, after partitioning: holds this rank's tensor-parallel shards in place of the full
        parameters, drops the parameters partitioning moved to other stages, and sets up the flat
        master state when the config shards optimizer state or trains in bf16/fp16 (not under
        sharded data parallelism: FSDP2's fp32 shards are the masters)."""
        if self._localized or not self._engine.partitioned:
            return
        _follow_moves(self.optimizer, self._engine.state.local_part)
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if not param_facts.is_nonlocal(p)]
        cfg, groups = self._engine.config, self._engine.groups
        if (cfg.shard_optimizer_state or cfg.bf16 or cfg.fp16) and self._engine.sharded_data is None:
            self._engine.fix_trained_parameters()  # the flat state holds those requiring grad now
            for group in self.optimizer.param_groups:
                group["params"] = [p for p in group["params"] if p.requires_grad]
            ranks = list(groups.rdp_ranks) if self.sharded else [groups.rank]
            shard_grads = self.sharded and self._engine.shards_gradients()
            self._flat = FlatState(self.optimizer, groups.rdp, ranks, shard_grads)
            if self._flat.groups:
                fuse_where_unset(self.optimizer, self._flat.groups[0].master.device)
            for flat in self._flat.groups:
                if shard_grads:
                    self._engine.use_sharded_grads(flat.params, flat.offsets, flat.lo, flat.master.grad)
                else:
                    self._engine.use_flat_grads(flat.grads, flat.params, flat.offsets)
        self._localized = True

    def _scaler_state(self) -> dict:
        if not self._scaler.dynamic and self._scaler.scale == 1.0:
            return {}
        return {"smp_loss_scaler": self._scaler.state_dict()}


_MP_STATES = "smp_model_parallel_states"  # state_dict(): each model-parallel rank's, by mp_rank
_MP_LAYOUT = "smp_model_parallel_layout"


def _follow_moves(optimizer: torch.optim.Optimizer, local_part) -> None:
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


def _loss_scaler(fp16: bool, static_scale, dynamic: bool, args: dict | None, kwargs: dict) -> LossScaler:
    """SMP's loss scaling: the arguments are checked always, and used only in fp16 training."""
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


_checked: weakref.WeakSet = weakref.WeakSet()  # optimizers found right once partitioned
_wrapped: weakref.WeakSet = weakref.WeakSet()  # optimizers a DistributedOptimizer wraps


def _check_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Global step pre-hook: catches optimizers that would silently train the wrong parameters."""
    if optimizer in _checked:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(param_facts.is_replaced(p) for p in params):
        raise RuntimeError(_BUILT_BEFORE_WRAP)
    moved = any(param_facts.left_this_rank(p) for p in params)
    if moved and optimizer not in _wrapped:
        raise RuntimeError(
            "smp: this optimizer holds parameters that pipeline partitioning moved to other ranks or that "
            "tensor parallelism sharded; wrap it: optimizer = smp.DistributedOptimizer(optimizer)"
        )
    model = model_lib.current()
    if model is not None and model.partitioned:
        _checked.add(optimizer)


register_optimizer_step_pre_hook(_check_step)
