"""This rank's programs per (train/eval mode, input signature): planned once, built on first use.

The first call plans the module (smp.engine.plan) and builds the first signature's program in
both train/eval modes, while every parameter still exists. A later signature's program is built
from that plan (smp.engine.build) when it first arrives, and kept in a least-recently-used cache
(smp.engine.signatures).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Hashable, Sequence

import torch
from torch import nn

from smp import recompute
from smp.config import Config
from smp.engine import signatures
from smp.engine.build import Program, build
from smp.engine.plan import Flags, Plan, make_plan
from smp.groups import ParallelGroups
from smp.passes.regions import Region
from smp.pipeline.messages import Messages, ordered_path
from smp.pipeline.wire import Wire
from smp.services.activation_meter import SavedActivationMeter

_TRAINING = operator.attrgetter("training")


class Programs:
    def __init__(
        self,
        module: nn.Module,
        config: Config,
        groups: ParallelGroups,
        trace_execution_times: bool,
        device: torch.device,
    ):
        self._module, self._config, self._groups = module, config, groups
        # The modules whose train/eval flags pick a program, listed once: walking the tree at every
        # forward cost more than anything else smp does per microbatch on the host.
        self._modules = list(module.modules())
        self._trace_execution_times = trace_execution_times
        self.cache = signatures.SignatureCache(config.signature_warn_after, config.signature_cache_size)
        self._plan: Plan | None = None  # what every later signature's program follows
        self._modes: frozenset[Flags] = frozenset()  # the train/eval flags planned
        self._meter: SavedActivationMeter | None = None  # made once planned
        self._tracking = False  # whether the stages count saved activations on it
        self.building = False  # whether the module is being captured now (on fake tensors)
        # The rank's pipeline messages: one for all programs (a step's microbatches may run
        # different ones).
        ordered = ordered_path(config.ordered_messages, device) if groups.pp_size > 1 else False
        stage_ranks = config.schedule().stage_ranks
        wire = Wire(groups.pp, list(groups.pp_ranks), stage_ranks, groups.pp_rank, device, ordered)
        self.messages = Messages(wire)

    def plan(
        self,
        args: tuple,
        kwargs: dict,
        batch_size: int | None,
        signature: Hashable,
        checkpointing: Sequence[tuple[Region, bool]],
        offloader: recompute.ActivationOffloader | None,
    ) -> tuple[Plan, Program]:
        """Plans the module on these inputs and builds their programs in both modes; returns the plan
        and the program of the current mode."""

        def first() -> tuple[Plan, dict[Flags, Program]]:
            plan, pipes = make_plan(
                self._module,
                args,
                kwargs,
                self._config,
                self._groups,
                batch_size,
                self._trace_execution_times,
                checkpointing,
                offloader,
            )
            programs = {
                flags: build(
                    plan, flags, args, kwargs, batch_size, self._config, self._groups, pipe, self.messages
                )
                for flags, pipe in pipes.items()
            }
            return plan, programs

        with self._building():
            (plan, programs), seconds = signatures.timed(first)
        self._plan = plan
        self._meter = SavedActivationMeter(self._module.parameters)
        self._modes = frozenset(programs)
        for flags, program in programs.items():
            self.cache.put(flags, signature, program, seconds / len(programs))
        self.track_saved_activations(self._tracking)
        return plan, programs[self._flags()]

    def get(
        self, args: tuple, kwargs: dict, batch_size: int | None, signature: Hashable, frozen: tuple[str, ...]
    ) -> Program:
        """The program for the modules' train/eval modes and these inputs' signature, built now
        when the signature is new. `frozen`: parameters whose requires_grad differs from the
        trained set (a forward-only step with them frozen bakes that into its graphs, which are
        kept apart from the training ones)."""
        flags = self._flags()
        key = (flags, frozen) if frozen else flags
        if flags not in self._modes:
            raise RuntimeError(
                "smp: the pipeline was captured with every module in train mode or every module in eval "
                "mode (as set when the first step ran, and its opposite); this mix of train/eval modules "
                "is neither. Set the modes before the first step, or use model.train() / model.eval()"
            )
        program = self.cache.get(key, signature)
        if program is None:
            with self._building():
                program, seconds = signatures.timed(
                    lambda: build(
                        self._plan,
                        flags,
                        args,
                        kwargs,
                        batch_size,
                        self._config,
                        self._groups,
                        messages=self.messages,
                    )
                )
            program.runtime.meter = self._meter if self._tracking else None
            self.cache.put(key, signature, program, seconds)
        return program

    def finish_step(self) -> None:
        for program in self.cache.values():
            program.runtime.finish_step()

    def track_saved_activations(self, enabled: bool) -> None:
        """Whether every program's stages (and later ones') count their saved activations."""
        self._tracking = enabled
        for program in self.cache.values():
            program.runtime.meter = self._meter if enabled else None

    def saved_activation_bytes(self) -> dict[str, int]:
        """Saved activations, live and peak; and the peak of the output gradients kept for W."""
        meter = self._meter
        if meter is None:
            return {"live": 0, "peak": 0, "kept_gradients_peak": 0}
        return {
            "live": meter.live_bytes,
            "peak": meter.peak_bytes,
            "kept_gradients_peak": meter.gradient_peak_bytes,
        }

    def _flags(self) -> Flags:
        return tuple(map(_TRAINING, self._modules))

    @contextlib.contextmanager
    def _building(self):
        self.building = True
        try:
            yield
        finally:
            self.building = False
