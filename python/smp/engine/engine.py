"""The engine behind one smp.DistributedModel: the step lifecycle, each microbatch's forward
and backward on this rank's part, and gradient synchronization.

With pipeline_parallel_degree == tensor_parallel_degree == 1 the module runs whole on every
rank and ranks average gradients. Otherwise the first forward inside @smp.step plans the module
(smp.engine.plan) with that microbatch as the example inputs, and each input signature gets this
rank's program (smp.engine.programs, smp.engine.build), whose stages run the microbatch and
exchange activations. The executor (smp.engine.executor) drives the step.

Optimizers attach through `attach_optimizer` (smp.engine.protocol.GradientConsumer) and ask the
engine what they need through its public methods.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp import hf, params, passes, recompute
from smp.config import Config
from smp.data_parallel import replicas
from smp.data_parallel.grad_sync import GradSync
from smp.engine import inputs, signatures
from smp.engine.build import recompute_report
from smp.engine.plan import Plan, place_whole, rank_device
from smp.engine.programs import Programs
from smp.engine.protocol import GradientConsumer
from smp.engine.trained import TrainedSet
from smp.finite_check import FiniteCheck
from smp.groups import ParallelGroups
from smp.services.activation_meter import SavedActivationMeter
from smp.services.microbatch import Microbatch
from smp.state import model_state
from smp.tensor_parallel import inputs as tp_inputs


class Engine:
    def __init__(
        self,
        module: nn.Module,
        config: Config,
        groups: ParallelGroups,
        *,
        trace_execution_times: bool,
        average_grads_across_microbatches: bool,
        bucket_cap_mb: float,
        broadcast_buffers: bool,
        backward_passes_per_step: int = 1,
    ):
        self.module, self.config, self.groups = module, config, groups
        self.schedule = config.schedule()
        self.dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None
        if self.dtype is not None:
            module.to(self.dtype)  # half-precision parameters and activations; fp32 masters in the optimizer
        params.refresh(module)
        self._average_microbatches = average_grads_across_microbatches
        self._bucket_cap_mb = bucket_cap_mb
        self._broadcast_buffers = broadcast_buffers
        self.state_keys = list(module.state_dict(keep_vars=True).keys())  # tied tensors under each name
        self._call_defaults = hf.call_defaults(module)
        self.plan: Plan | None = None
        self._programs = Programs(module, config, groups, trace_execution_times)
        self._grad_sync: GradSync | None = None
        self._trained = TrainedSet(module)
        self._shared_groups: dict[int, dist.ProcessGroup] = {}
        self._consumers: list[GradientConsumer] = []
        self._post_partition_hooks: list[Callable] = []
        self._post_step_hooks: list[Callable] = []
        self._meter: SavedActivationMeter | None = None
        self._track_activations = False
        self._failed_step: str | None = None
        self._backward_ran = False
        # Gradient accumulation: steps with a backward per optimizer step, and those done so far.
        self._passes_per_step = backward_passes_per_step
        self._passes_done = 0
        self._checkpointing = recompute.Checkpointing(
            module, config.offload_activations, config.activation_loading_horizon, self.captures
        )
        self._steps = 0  # steps started
        # NaN/inf report (not in fp16, where they are the loss scaler's overflow signal).
        checks = (config.check_finite or config.debug) and not config.fp16
        self._finite = FiniteCheck(self.schedule.rank_stages(groups.pp_rank), groups.rank) if checks else None
        if not self.captures:
            self._install(place_whole(module, config, groups))
        for layer in recompute.hf_flags.take(module):
            self.set_activation_checkpointing(recompute.request(module, layer, True, False, "each"))

    # --- what the model is -----------------------------------------------------------

    @property
    def captures(self) -> bool:
        """Whether the model runs as a captured graph (pipeline stages or tensor-parallel layers)."""
        return self.groups.pp_size > 1 or self.groups.tp_size > 1

    @property
    def steps_run(self) -> int:
        """How many @smp.step calls have started (training or evaluation)."""
        return self._steps

    @property
    def partitioned(self) -> bool:
        return self.plan is not None

    @property
    def tracing(self) -> bool:
        """Whether the module is being captured now (its forward runs on fake tensors)."""
        return self._programs.building

    @property
    def shard_specs(self) -> Mapping[int, passes.ShardSpec]:
        """id(local shard) -> how it was cut (empty before partitioning or without TP)."""
        return self.plan.shard_specs if self.plan is not None else {}

    @property
    def grad_sync(self) -> GradSync | None:
        """The gradient averaging (None before the model is placed); read it, e.g. to time it."""
        return self._grad_sync

    @property
    def partition_plan(self) -> passes.PartitionPlan | None:
        return self.plan.partition if self.plan is not None else None

    @property
    def signature_cache(self) -> signatures.SignatureCache:
        """The captured input signatures (how many seen, cached, evicted; the advice text)."""
        return self._programs.cache

    # --- the step lifecycle (called by the executor) -----------------------------------

    def start_step(self) -> None:
        if self._failed_step is not None:
            raise RuntimeError(
                f"smp: an earlier step failed part-way through the pipeline ({self._failed_step[:200]}); "
                "its activations may still be in flight between stages, so this pipeline cannot run "
                "another step: restart the job (from a checkpoint)"
            )
        if self._steps == 0:
            self._checkpointing.check_first_step()
        self._trained.check(lambda: self._grad_sync.follow_requires_grad(list(self.module.parameters())))
        if self._grad_sync is not None:
            self._start_grad_sync()
        self._backward_ran = False
        self._steps += 1
        if self._finite is not None:
            self._finite.start_step()
        if self._broadcast_buffers and self.partitioned:
            # As DDP: replicas use the first replica's buffers (BatchNorm statistics) every step.
            replicas.broadcast_over(list(self.module.buffers()), self.groups.dp, self.groups.dp_ranks)

    def finish_step(self) -> None:
        self._programs.finish_step()
        self._checkpointing.finish_step()
        if self._grad_sync is not None:
            self._grad_sync.finish_step()
        if self._finite is not None:
            if self._backward_ran:
                named = self.module.named_parameters()
                grads = [(n, params.applied_grad(p)) for n, p in named if not params.is_nonlocal(p)]
                self._finite.gradients(grads)
            self._finite.raise_if_any(self._steps, None)  # on every rank: none is left waiting
        if self._backward_ran:
            self._trained.make_final()
            self._passes_done = (self._passes_done + 1) % self._passes_per_step
            if self._passes_done == 0:  # the accumulation window is complete
                for consumer in self._consumers:
                    consumer.gradients_ready()
        hooks, self._post_step_hooks = self._post_step_hooks, []
        for hook in hooks:
            hook(self.optimizer)

    def fix_trained_parameters(self) -> None:
        """Called by an optimizer that builds state for the parameters requiring grad now (flat
        buffers, shards): from here on that set is final."""
        self._trained.check(lambda: self._grad_sync.follow_requires_grad(list(self.module.parameters())))
        self._trained.make_final()

    def _start_grad_sync(self) -> None:
        self._grad_sync.start_step(
            self.config.microbatches,
            new_window=self._passes_done == 0,
            sync=self._passes_done + 1 == self._passes_per_step,
        )

    def register_post_step_hook(self, hook: Callable) -> None:
        """hook(optimizer) runs once, when the next step has finished (its gradients averaged)."""
        self._post_step_hooks.append(hook)

    def abandon_step(self, error: BaseException) -> None:
        """A step failed part-way: with pipeline stages, its messages may still be in flight."""
        if self.groups.pp_size > 1:
            self._failed_step = f"{type(error).__name__}: {error}"

    # --- one microbatch ----------------------------------------------------------------

    def forward(self, mb: Microbatch, args: tuple, kwargs: dict) -> Any:
        args, kwargs = inputs.on_device((args, kwargs), rank_device())  # CPU batches on a GPU rank
        if self.dtype is not None:
            args, kwargs = inputs.cast_floating((args, kwargs), self.dtype)
        if not self.captures:
            with self._checkpointing.saving_for(mb.index):
                return self.module(*args, **kwargs)
        kwargs = self._call_defaults | kwargs
        if self.groups.tp_size > 1:
            args, kwargs = tp_inputs.combine(
                args, kwargs, mb.batch_size, self.config.prescaled_batch, not self.partitioned, self.groups
            )
        signature = signatures.of(args, kwargs)
        if not self.partitioned:
            self._partition(args, kwargs, mb.batch_size, signature)
        program = self._programs.get(args, kwargs, mb.batch_size, signature, self._trained.changed_names)
        mb.runtime = program.runtime
        # Each of this rank's stages is its own action: the microbatch pauses between them.
        saving = lambda: self._checkpointing.saving_for(mb.index)  # noqa: E731
        pending = mb.runtime.forward(mb.index, args, kwargs, mb.pause, saving)
        if self._finite is not None:
            self._finite.activations(mb.index, mb.runtime.produced_by_stage(mb.index))
        mb.pause()
        return pending.wait()

    def backward(self, mb: Microbatch, tensors: list[torch.Tensor], grad_tensors: list) -> None:
        self._trained.raise_if_changed()
        scale = 1.0 / self.config.microbatches if self._average_microbatches else 1.0
        if self._consumers:
            scale *= self._consumers[0].loss_scale  # fp16 loss scaling; the optimizer divides it out
        self._backward_ran = True
        if self._finite is not None:
            self._finite.loss(mb.index, tensors)
        grads = inputs.output_gradients(tensors, grad_tensors, scale)
        self._checkpointing.before_backward(mb.index)
        if self.captures:
            mb.runtime.backward(mb.index, tensors, grads, self.schedule.splits_backward, mb.pause)
            return
        roots = [(t, g) for t, g in zip(tensors, grads, strict=True) if t.requires_grad]
        if roots:
            torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])

    def backward_weights(self, mb: Microbatch, stage: int) -> None:
        """A split-backward schedule's W action: microbatch mb's deferred weight gradients on
        `stage` (nothing if its backward did not defer them: no model.backward, or a model that
        runs whole)."""
        if mb.runtime is not None and self.schedule.splits_backward:
            mb.runtime.backward_weights(mb.index, stage)

    # --- parallelization -----------------------------------------------------------------

    def _partition(self, args: tuple, kwargs: dict, batch_size: int | None, signature) -> None:
        checkpointing = self._checkpointing
        plan, program = self._programs.plan(
            args, kwargs, batch_size, signature, checkpointing.regions(), checkpointing.offloader
        )
        self._install(plan)
        self._start_grad_sync()  # this step is under way
        self._meter = SavedActivationMeter(self.module.parameters())
        self.track_saved_activations(self._track_activations)
        if self.config.debug and self.groups.rank == 0:
            print(plan.partition.report(), flush=True)
            if plan.tp_coverage is not None:
                print(plan.tp_coverage, flush=True)
        report = recompute_report(plan, program)
        if self.config.debug and report and self.groups.tp_rank == self.groups.rdp_rank == 0:
            print(report, flush=True)
        self._run_post_partition_hooks()

    def _install(self, plan: Plan) -> None:
        self.plan = plan
        self._grad_sync = GradSync(
            list(self.module.parameters()),
            plan.grad_group,
            list(plan.shared),
            self._bucket_cap_mb,
            self.dtype is not None,
            plan.stage_reads,
        )
        self._shared_groups = {id(p): group for _, p, group in plan.shared}
        # A captured model's stage graphs and optimizer state are built for the set at partition.
        self._trained.take(final=self.captures)

    # --- activation checkpointing ----------------------------------------------------------

    def set_activation_checkpointing(self, request: recompute.CheckpointRequest) -> None:
        """Recomputes the request's regions in backward (before the first step only)."""
        self._checkpointing.add(request, started=self._steps > 0)

    # --- for optimizers and checkpoints -------------------------------------------------

    def attach_optimizer(self, consumer: GradientConsumer) -> None:
        self._consumers.append(consumer)

    @property
    def optimizer(self) -> GradientConsumer | None:
        """The first optimizer attached (SMP v1 has one per model), or None."""
        return self._consumers[0] if self._consumers else None

    def use_flat_grads(self, grads: torch.Tensor, params: list[nn.Parameter], offsets: list[int]) -> None:
        """An optimizer's flat gradient buffer, which the gradient averaging then works in."""
        if self._grad_sync is not None:
            self._grad_sync.use_flat_grads(grads, params, offsets)

    def counts_in_norm(self, param: torch.Tensor) -> bool:
        """Whether this rank counts `param` in a global norm over the model-parallel ranks: shards
        always; replicated parameters on tp rank 0; a parameter shared by stages on its first one."""
        if id(param) not in self.shard_specs and self.groups.tp_rank != 0:
            return False
        group = self._shared_groups.get(id(param))
        return group is None or dist.get_global_rank(group, 0) == dist.get_rank()

    def register_post_partition_hook(self, hook: Callable) -> None:
        """hook(model, optimizer) runs once partitioned (at once if it already is)."""
        self._post_partition_hooks.append(hook)
        if self.partitioned:
            self._run_post_partition_hooks()

    def _run_post_partition_hooks(self) -> None:
        hooks, self._post_partition_hooks = self._post_partition_hooks, []
        for hook in hooks:
            hook(self.optimizer)

    # --- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        return model_state.full_state_dict(self.module, self.state_keys, self.shard_specs, self.groups)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool) -> None:
        model_state.load_full_state_dict(
            self.module, state_dict, self.state_keys, self.shard_specs, self.groups, strict
        )

    def local_part(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return model_state.local_part(param, full, self.shard_specs, self.groups)

    def state_places(self) -> model_state.StatePlaces:
        """Where this rank's tensors sit in the original model (a collective over the pipeline group)."""
        return model_state.state_places(self.module, self.state_keys, self.shard_specs, self.groups)

    # --- saved activations ---------------------------------------------------------------

    def track_saved_activations(self, enabled: bool) -> None:
        self._track_activations = enabled
        self._programs.meter_with(self._meter if enabled else None)

    def saved_activation_bytes(self) -> dict[str, int]:
        """Saved activations, live and peak; and the peak of the output gradients zero_bubble's
        W keeps (0 under the other schedules)."""
        meter = self._meter
        if meter is None:
            return {"live": 0, "peak": 0, "kept_gradients_peak": 0}
        return {
            "live": meter.live_bytes,
            "peak": meter.peak_bytes,
            "kept_gradients_peak": meter.gradient_peak_bytes,
        }
