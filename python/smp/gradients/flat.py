"""Flat gradients: ZeRO-1 state and fp32 masters (smp.optim.flat_state). Each param group's
parameters are laid end to end in one buffer; the optimizer steps this rank's chunk of it (all of
it without sharding), in fp32, and the gradient averaging works in the flat fp32 gradient buffer,
or keeps only this rank's chunk of the gradients (sharded gradients, ZeRO-2)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from smp import params as param_facts
from smp.data_parallel.grad_sync import GradSync
from smp.gradients.state import GradientState
from smp.optim import grad_norm
from smp.optim.flat_state import Comm, FlatState, fuse_where_unset


class FlatGradients(GradientState):
    """The flat state is built once, before the first backward after adoption or when first needed
    (a state_dict, a checkpoint), for the parameters requiring grad then (`fix_trained` makes that
    set final); the optimizer's groups then hold the flat chunks (its `params()` are the fp32
    masters), and `sync` (the gradient averaging) fills their gradient buffers."""

    def __init__(
        self,
        *args,
        sync: GradSync | None,
        sharded: bool,
        shard_grads: bool,
        fix_trained: Callable[[], None],
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.sharded = sharded
        self._sync, self._shard_grads, self._fix_trained = sync, shard_grads, fix_trained
        self._flat: FlatState | None = None

    @property
    def flat(self) -> FlatState:
        if self._flat is None:
            self._build()
        return self._flat

    def step_starting(self) -> None:
        self.flat  # noqa: B018  (built now: its buffers take this step's gradients)

    def _build(self) -> None:
        self._fix_trained()
        optimizer, groups = self.optimizer, self.groups
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if p.requires_grad]
        whole = Comm.of(None, [groups.rank])
        comm = Comm.of(groups.rdp, groups.rdp_ranks) if self.sharded else whole
        # Expert parameters differ across an ep group: cut across the replicas holding the same.
        experts = None
        if groups.ep_size > 1:
            experts = Comm.of(groups.ep_replica, groups.ep_replica_ranks) if self.sharded else whole
        self._flat = FlatState(optimizer, comm, self._shard_grads, experts, param_facts.is_expert)
        if self._flat.groups:
            fuse_where_unset(optimizer, self._flat.groups[0].master.device)
        if self._sync is None:
            return
        for flat in self._flat.groups:
            if self._shard_grads:
                self._sync.use_sharded_grads(flat.params, flat.offsets, flat.lo, flat.master.grad)
            else:
                self._sync.use_flat_grads(flat.grads, flat.params, flat.offsets)

    def _unscale(self, scale: float, check: bool) -> bool:
        return self.flat.load_grads(scale, check)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.flat.zero_grad()  # its gradient buffers are kept across steps: set_to_none does not apply

    def clip(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        grad_norm.check_norm_type(norm_type, "clip_master_grads")
        # Sharded: each rank's chunk is its own; unsharded master copies: count on one replica.
        first = grad_norm.first_holder(self.groups.rdp_rank, self.groups.ep_size)
        counts, sharded = self._counts, self.sharded
        squares = self.flat.squared_norm(lambda p: counts(p) and (sharded or first(p)))
        return grad_norm.clip(squares, max_norm, self.flat.scale_grads)

    def _after_step(self) -> None:
        self.flat.publish()

    def full_state(self, inner: dict) -> dict:
        return self.flat.full_state(inner)

    def chunk_state(self, full: dict) -> dict:
        return self.flat.chunk_state(full)

    def shard_id(self) -> dict[str, int]:
        return {"rank": self.groups.rdp_rank, "size": self.groups.rdp_size}
