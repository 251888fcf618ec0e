"""smp.DistributedOptimizer: SMP v1's optimizer facade over a torch optimizer.

It attaches to the DistributedModel's engine once; when the model is partitioned the engine hands
back the optimizer's gradient regime (smp.gradients: plain gradients, flat fp32 masters and
ZeRO-1 chunks, or FSDP2's shards), and everything below (the step, skipped steps, clipping, state)
goes through that object. This module keeps SMP v1's names, its arguments and guards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smp import model as model_lib
from smp import optimizer_guards as guards
from smp import parallel_state
from smp.gradients import GradientState
from smp.optim import loss_scale
from smp.state import layout_free, snapshot


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
        guards.check_owned(optimizer, {id(p) for p in model.get_module().parameters()})
        guards.wrapped.add(optimizer)
        self.optimizer = optimizer
        self._gradients: GradientState | None = None  # the regime, once the model is partitioned
        self._deferred: list = []  # state_dicts loaded before that
        fp16 = parallel_state.state().config.fp16
        self._scaler = loss_scale.from_smp_args(
            fp16, static_loss_scale, dynamic_loss_scale, dynamic_loss_args, dynamic_loss_kwargs
        )
        model.engine.attach_optimizer(self, optimizer, self._scaler)  # (receive() comes back)

    def receive(self, gradients: GradientState) -> None:
        """The engine's answer to attach_optimizer, once the model is partitioned: the gradient
        regime every call below goes through (state loaded before it is loaded now)."""
        self._gradients = gradients
        for state_dict in self._deferred:
            self.load_state_dict(state_dict)
        self._deferred = []

    @property
    def loss_scale(self) -> float:
        return self._scaler.scale

    @property
    def overflow(self) -> bool:
        """Whether the last step() was skipped because some rank's gradients had an inf or nan
        (SMP v1's attribute; scripts skip their LR scheduler's step on it)."""
        return self._gradients is not None and self._gradients.skipped

    @property
    def flat_state(self):
        """The flat parameter buffers and ZeRO-1 chunks (None before the model is partitioned, or
        when neither shard_optimizer_state nor bf16/fp16 is on); read it, e.g. to time it."""
        return None if self._gradients is None else self._gradients.flat

    def step(self, closure=None):
        if self._gradients is None or not self._gradients.gradients_seen:
            raise RuntimeError(
                "smp: optimizer.step() was called before any @smp.step function ran the model's "
                "backward; call your @smp.step function (forward and model.backward) first, then "
                "optimizer.step()"
            )
        snapshot.wait()  # a background save may still be copying the parameters and state
        return self._gradients.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._gradients is None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            self._gradients.zero_grad(set_to_none)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients about to be applied by their global L2 norm over every stage,
        tensor-parallel shard and optimizer shard (a replicated parameter counts once);
        returns that norm. A collective: call it on every rank."""
        if self._gradients is None:
            raise RuntimeError(
                "smp: clip_master_grads() before any @smp.step function ran; there are no gradients "
                "to clip yet: call it after the step function, before optimizer.step()"
            )
        return self._gradients.clip(max_norm, norm_type)

    # --- state ---------------------------------------------------------------------------

    def state_dict(self):
        """The whole model's optimizer state, as SMP's: with pipeline stages or tensor parallelism,
        every model-parallel rank's rank_state_dict(), gathered over the model-parallel group (a
        collective: call it on every rank, or on every rank with rdp_rank() == 0); load_state_dict
        then takes this rank's part, on the same layout. Without them, rank_state_dict()."""
        state = self.rank_state_dict()
        layout = self._model_parallel_layout()
        if layout is None:
            return state
        parts: list = [None] * parallel_state.mp_size()
        dist.all_gather_object(parts, state, group=parallel_state.get_mp_process_group())
        return {_MP_STATES: parts, _MP_LAYOUT: layout}

    def rank_state_dict(self):
        """The optimizer state of this rank's parameters, per parameter and whole (with
        shard_optimizer_state, gathered from the reduced-data-parallel group: a collective)."""
        inner = self.optimizer.state_dict()
        state = inner if self._gradients is None else self._gradients.full_state(inner)
        return state | self._scaler_state()

    def local_state_dict(self, gather_if_shard: bool = True):
        """This rank's own part: with shard_optimizer_state, the state of its chunk only.
        gather_if_shard (what transformers passes) is accepted: a rank's chunk is never gathered here."""
        state = self.optimizer.state_dict()
        shard = None if self._gradients is None else self._gradients.shard_id()
        if shard is not None:
            state = state | {"smp_shard": shard}
        return state | self._scaler_state()

    def load_state_dict(self, state_dict) -> None:
        """Accepts what state_dict() or local_state_dict() returned. Before the model is partitioned
        (pipeline or tensor parallelism, before the first step) loading waits for partitioning, as
        in SMP: the state belongs to the parameters this rank will keep."""
        if self._gradients is None:
            self._deferred.append(state_dict)
            return
        state = dict(state_dict)
        if _MP_STATES in state:  # the whole model's, from state_dict(): this rank's part
            layout = self._model_parallel_layout()
            if layout is None or tuple(state[_MP_LAYOUT]) != layout:
                raise ValueError(
                    f"smp: this optimizer state was gathered with (pipeline, tensor) parallel degrees "
                    f"{tuple(state[_MP_LAYOUT])}, but this run has {layout or (1, 1)}; load it on that layout"
                )
            state = dict(state[_MP_STATES][parallel_state.mp_rank()])
        if "smp_loss_scaler" in state:
            self._scaler.load_state_dict(state.pop("smp_loss_scaler"))
        shard, mine = state.pop("smp_shard", None), self._gradients.shard_id()
        if shard is not None and shard != mine:
            raise ValueError(
                f"smp: this local optimizer state is the chunk of rdp rank {shard['rank']} of "
                f"{shard['size']}, but this is {_describe_chunk(mine)}; load it on that rank, or save and "
                "load the full state_dict()"
            )
        if shard is None:
            state = self._gradients.chunk_state(state)
        self.optimizer.load_state_dict(state)

    def checkpoint_state(self, places) -> tuple[dict, dict]:
        """(the tensors this rank writes to a layout-free checkpoint, under the model's parameter
        names in global coordinates; the plain values and hyperparameters, the same on every rank
        after merging). `places` is the model's StatePlaces."""
        tensors, values = self._gradients.checkpoint_state(places)
        meta = {"param_groups": layout_free.hyperparameters(self.optimizer), "values": values}
        return tensors, meta | self._scaler_state()

    def checkpoint_destinations(self, places, stored):
        """(what this rank reads from a layout-free checkpoint whose tensors have the shapes and
        dtypes in `stored`; a function that installs it, given the checkpoint's metadata)."""
        items, install_state = self._gradients.checkpoint_destinations(places, stored)

        def install(meta: dict) -> None:
            layout_free.load_hyperparameters(self.optimizer, meta["param_groups"])
            if "smp_loss_scaler" in meta:
                self._scaler.load_state_dict(meta["smp_loss_scaler"])
            install_state(meta["values"])

        return items, install

    def _model_parallel_layout(self) -> tuple[int, int] | None:
        """(pp, tp) where this rank holds a part of the model (pipeline or tensor parallelism,
        partitioned), else None."""
        if self._gradients is None:
            return None
        groups = self._gradients.groups
        layout = (groups.pp_size, groups.tp_size)
        return layout if layout != (1, 1) else None

    def _scaler_state(self) -> dict:
        if not self._scaler.dynamic and self._scaler.scale == 1.0:
            return {}
        return {"smp_loss_scaler": self._scaler.state_dict()}

    # --- the wrapped optimizer's surface -------------------------------------------------

    def add_param_group(self, param_group) -> None:
        if self.flat_state is not None:
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
        if name in ("optimizer", "_gradients"):
            raise AttributeError(name)
        if self._gradients is not None:  # (SMP v1's sdp answered DeepSpeed's optimizer names)
            try:
                return self._gradients.attribute(name)
            except AttributeError:
                pass
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"


_MP_STATES = "smp_model_parallel_states"  # state_dict(): each model-parallel rank's, by mp_rank
_MP_LAYOUT = "smp_model_parallel_layout"


def _describe_chunk(mine: dict[str, int] | None) -> str:
    return "a rank keeping whole state" if mine is None else f"rdp rank {mine['rank']} of {mine['size']}"
