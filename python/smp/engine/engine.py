"""The engine behind one smp.DistributedModel: the step lifecycle, each microbatch's forward
and backward on this rank's part, and gradient synchronization.

With pipeline_parallel_degree == tensor_parallel_degree == 1 the module runs whole on every
rank and ranks average gradients. Otherwise the first forward inside @smp.step plans the module
(smp.engine.plan) with that microbatch as the example inputs, and each input signature gets this
rank's program (smp.engine.programs, smp.engine.build), whose stages run the microbatch and
exchange activations. The executor (smp.engine.executor) drives the step.

An optimizer attaches once (`attach_optimizer`); once the model is partitioned the engine, which
owns the gradient averaging, chooses the optimizer's gradient regime (smp.gradients) and hands it
over (`receive`): from then on the optimizer talks to that object alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

import smp.passes as passes
from smp import gradients, hf, params, recompute
from smp.config import Config
from smp.data_parallel import replicas
from smp.data_parallel.grad_sync import GradSync
from smp.engine import compiled, first_stage, inputs, precision, signatures
from smp.engine.accumulation import Accumulation
from smp.engine.build import debug_report
from smp.engine.plan import Plan, place_sharded, place_whole, rank_device
from smp.engine.programs import Programs
from smp.engine.trained import TrainedSet
from smp.finite_check import FiniteCheck
from smp.groups import ParallelGroups
from smp.optim import grad_norm
from smp.services.microbatch import Microbatch
from smp.sharded_data import ShardedModel
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
        # Whether the model runs as a captured graph (pipeline stages, tensor-parallel layers or
        # a cut sequence).
        self.captures = groups.pp_size > 1 or groups.tp_size > 1 or groups.cp_size > 1
        self._device = rank_device()  # where its part runs (smp.init chose the GPU)
        # Whether CPU batches move to the device. Read once: torch.device.type builds its string
        # through an ostringstream, which cost 10-20 us as a step's first allocation on a CPU rank.
        self._moves_inputs = self._device.type != "cpu"
        self.schedule = config.schedule()
        self.dtype = precision.model_dtype(config)
        precision.cast_model(module, config, self.captures)
        params.refresh(module)
        self._average_microbatches = average_grads_across_microbatches
        self._bucket_cap_mb = bucket_cap_mb
        self._broadcast_buffers = broadcast_buffers
        self.state_keys = list(module.state_dict(keep_vars=True).keys())  # tied tensors under each name
        self._call_defaults = hf.call_defaults(module)
        self.plan: Plan | None = None
        self.programs = Programs(module, config, groups, trace_execution_times, self._device)
        self.grad_sync: GradSync | None = None  # the gradient averaging, once the model is placed
        # Sharded data parallelism (FSDP2 shards the parameters and averages the gradients).
        self.sharded_data: ShardedModel | None = None
        self._trained = TrainedSet(module)
        self._optimizer = None  # the DistributedOptimizer attached (SMP v1 has one per model)
        self._attached: tuple | None = None  # (its torch optimizer, its loss scaler)
        self.gradients: gradients.GradientState | None = None  # its regime, once partitioned
        self._post_partition_hooks: list[Callable] = []  # each runs once, when partitioned
        self._post_step_hooks: list[Callable] = []  # each runs once, at the next step's end
        self._failed_step: str | None = None
        self._backward_ran = False
        self._accumulation = Accumulation(backward_passes_per_step)
        self._checkpointing = recompute.Checkpointing(
            module, config.offload_activations, config.activation_loading_horizon, self.captures
        )
        self.steps_run = 0  # @smp.step calls started (training or evaluation)
        # NaN/inf report (not in fp16, where they are the loss scaler's overflow signal).
        checks = (config.check_finite or config.debug) and not config.fp16
        self._finite = FiniteCheck(self.schedule.rank_stages(groups.pp_rank), groups.rank) if checks else None
        self._whole = module  # what a forward calls when the model runs whole
        # Whether a step averages gradients, and replicas take the first one's buffers (_install).
        self._syncs = self._broadcasts = False
        if config.sharded_data_parallel_degree > 1 and not self.captures:
            options = config.compile  # each layer's forward compiled, FSDP2's hooks outside
            compile_layer = None if options is None else lambda m: compiled.compile_forward(m, options)
            self._install(place_sharded(module, config, groups, compile_layer))
        elif not self.captures:
            self._install(place_whole(module, config, groups))
            if config.compile is not None:  # smp's hooks (gradient buckets) stay outside the graph
                self._whole = compiled.compile_stage(module, config.compile)
        for layer in recompute.hf_flags.take(module):
            self.set_activation_checkpointing(recompute.request(module, layer, True, False, "each"))

    # --- what the model is -----------------------------------------------------------

    @property
    def partitioned(self) -> bool:
        return self.plan is not None

    @property
    def shard_specs(self) -> Mapping[int, passes.ShardSpec]:
        """id(local shard) -> how it was cut (without TP: empty; before partitioning: smp.nn's
        modules', which shard themselves as they are built)."""
        if self.plan is not None:
            return self.plan.shard_specs
        return passes.module_specs(self.module, self.groups.tp_size)

    @property
    def signature_cache(self) -> signatures.SignatureCache:
        """The captured input signatures (how many seen, cached, evicted; the advice text)."""
        return self.programs.cache

    # --- the step lifecycle (called by the executor) -----------------------------------

    def start_step(self) -> None:
        if self._failed_step is not None:
            raise RuntimeError(
                f"smp: an earlier step failed part-way through the pipeline ({self._failed_step[:200]}); "
                "its activations may still be in flight between stages, so this pipeline cannot run "
                "another step: restart the job (from a checkpoint)"
            )
        if self.steps_run == 0:
            self._checkpointing.check_first_step()
        self._check_trained()
        if self.gradients is not None:
            self.gradients.step_starting()
        if self._syncs:
            self._start_grad_sync()
        self._backward_ran = False
        self.steps_run += 1
        if self._finite is not None:
            self._finite.start_step()
        if self._broadcasts:
            # As DDP: replicas use the first replica's buffers (BatchNorm statistics) every step.
            replicas.broadcast_over(self._buffers.now(), self.groups.dp, self.groups.dp_ranks)

    def finish_step(self) -> None:
        if self.captures:
            self.programs.finish_step()
        self._checkpointing.finish_step()
        if self._syncs:
            self.grad_sync.finish_step(self._backward_ran, publish=self.gradients is None)
        if self.sharded_data is not None and self._backward_ran and self._accumulation.last_of_window:
            self.sharded_data.finish_backward()  # (once per window: the sums add across steps)
        if self._finite is not None:
            named = self.module.named_parameters() if self._backward_ran else ()
            grads = [(n, params.applied_grad(p)) for n, p in named if not params.is_nonlocal(p)]
            self._finite.end_step(self.steps_run, grads if self._backward_ran else None)
        if self._backward_ran:
            self._trained.make_final()
            if self._accumulation.backward_done() and self.gradients is not None:
                self.gradients.gradients_ready()
        if self._post_step_hooks:
            _run_once(self._post_step_hooks, self.optimizer)

    def _check_trained(self) -> None:
        if self.grad_sync is not None:  # (FSDP2 reads requires_grad each backward itself)
            self._trained.check(self._follow_requires_grad)

    def _follow_requires_grad(self) -> None:
        self.grad_sync.follow_requires_grad(list(self.module.parameters()))

    def _start_grad_sync(self) -> None:
        window = self._accumulation
        self.grad_sync.start_step(self.config.microbatches, window.new_window, window.last_of_window)

    def register_post_step_hook(self, hook: Callable) -> None:
        """hook(optimizer) runs once, when the next step has finished (its gradients averaged)."""
        self._post_step_hooks.append(hook)

    def abandon_step(self, error: BaseException) -> None:
        """A step failed part-way: with pipeline stages, its messages may still be in flight."""
        if self.groups.pp_size > 1:
            self._failed_step = f"{type(error).__name__}: {error}"

    def step_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A step's arguments at pp > 1: the first stage's on every stage (smp.engine.first_stage)."""
        return first_stage.arguments(args, kwargs, self.groups, self._device)

    # --- one microbatch ----------------------------------------------------------------

    def forward(self, mb: Microbatch, args: tuple, kwargs: dict) -> Any:
        if self._moves_inputs:  # CPU batches on a GPU rank
            args, kwargs = inputs.on_device((args, kwargs), self._device)
        if self.dtype is not None:
            args, kwargs = inputs.cast_floating((args, kwargs), self.dtype)
        if not self.captures:
            if self._checkpointing.offloader is None:  # (no context entered per step)
                outputs = self._whole(*args, **kwargs)
            else:
                with self._checkpointing.saving_for(mb.index):
                    outputs = self._whole(*args, **kwargs)
            return inputs.guarded(outputs, mb) if mb.guard_backward else outputs
        kwargs = self._call_defaults | kwargs
        if self.groups.tp_size > 1:
            args, kwargs = tp_inputs.combine(
                args, kwargs, mb.batch_size, self.config.prescaled_batch, not self.partitioned, self.groups
            )
        signature = signatures.of(args, kwargs)
        if not self.partitioned:
            self._partition(args, kwargs, mb.batch_size, signature)
        program = self.programs.get(args, kwargs, mb.batch_size, signature, self._trained.changed_names)
        mb.runtime = program.runtime
        # Each of this rank's stages is its own action: the microbatch pauses between them.
        saving = lambda: self._checkpointing.saving_for(mb.index)  # noqa: E731
        pending = mb.runtime.forward(mb.index, args, kwargs, mb.pause, saving)
        if self._finite is not None:
            self._finite.activations(mb.index, mb.runtime.produced_by_stage(mb.index))
        mb.pause()
        outputs = pending.wait()
        return inputs.guarded(outputs, mb) if mb.guard_backward else outputs

    def backward(self, mb: Microbatch, tensors: list[torch.Tensor], grad_tensors: list) -> None:
        self._trained.raise_if_changed()
        scale = 1.0 / self.config.microbatches if self._average_microbatches else 1.0
        if self.gradients is not None:
            scale *= self.gradients.loss_scale  # fp16 loss scaling; the optimizer divides it out
        self._backward_ran = True
        if self._finite is not None:
            self._finite.loss(mb.index, tensors)
        grads = inputs.output_gradients(tensors, grad_tensors, scale, implicit_ones=not self.captures)
        self._checkpointing.before_backward(mb.index)
        if self.captures:
            mb.runtime.backward(mb.index, tensors, grads, self.schedule.splits_backward, mb.pause)
            mb.action_done()  # its sends go out now, not when the step function returns
            return
        roots = [(t, g) for t, g in zip(tensors, grads, strict=True) if t.requires_grad]
        if roots:
            torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])

    @property
    def ordered_messages(self) -> bool:
        """Whether the pipeline's messages take the ordered path (smp.pipeline.messages)."""
        return self.programs.messages.ordered

    def transfers(self, microbatches: list[Microbatch]) -> Callable[[Any], None]:
        """What runs one transfer of the executor's actions in a step of these microbatches
        (smp.pipeline.messages)."""
        return functools.partial(self.programs.messages.run, microbatches=microbatches)

    def backward_weights(self, mb: Microbatch, stage: int) -> None:
        """A split-backward schedule's W action: microbatch mb's deferred weight gradients on
        `stage` (nothing if its backward did not defer them: no model.backward, or a model that
        runs whole)."""
        if mb.runtime is not None and self.schedule.splits_backward:
            mb.runtime.backward_weights(mb.index, stage)

    # --- parallelization -----------------------------------------------------------------

    def _partition(self, args: tuple, kwargs: dict, batch_size: int | None, signature) -> None:
        checkpointing = self._checkpointing
        plan, program = self.programs.plan(
            args, kwargs, batch_size, signature, checkpointing.regions(), checkpointing.offloader
        )
        self._install(plan)
        if self._attached is not None:  # before the post-partition hooks (a resume loads its state)
            self._adopt()
            self.gradients.step_starting()  # (this step is under way)
        if self.grad_sync is not None:
            self._start_grad_sync()  # this step is under way
        if self.config.debug:
            debug_report(plan, program, self.groups)
        _run_once(self._post_partition_hooks, self.optimizer)

    def _install(self, plan: Plan) -> None:
        self.plan = plan
        self._buffers = replicas.BufferSlots(self.module)
        self._broadcasts = self._broadcast_buffers and len(self.groups.dp_ranks) > 1
        if plan.sharded_data is not None:  # FSDP2 averages the gradients
            self.sharded_data = plan.sharded_data
            self._trained.take(final=self.captures)
            return
        experts = plan.experts  # expert parallelism: expert gradients combined over their replicas
        self.grad_sync = GradSync(
            list(self.module.parameters()),
            plan.grad_group,
            list(plan.shared),
            self._bucket_cap_mb,
            self.dtype is not None,
            plan.stage_reads,
            expert_ids=frozenset(map(id, experts.params)) if experts else frozenset(),
            expert_group=experts.replica_group if experts else None,
        )
        self._syncs = not self.grad_sync.idle
        # A captured model's stage graphs and optimizer state are built for the set at partition.
        self._trained.take(final=self.captures)

    # --- activation checkpointing ----------------------------------------------------------

    def set_activation_checkpointing(self, request: recompute.CheckpointRequest) -> None:
        """Recomputes the request's regions in backward (before the first step only)."""
        self._checkpointing.add(request, started=self.steps_run > 0)

    # --- for optimizers and checkpoints -------------------------------------------------

    def attach_optimizer(self, optimizer, inner: torch.optim.Optimizer, scaler) -> None:
        """`optimizer` (a DistributedOptimizer over `inner`, scaling fp16 losses with `scaler`) gets
        its gradient regime by `optimizer.receive(...)` once the model is partitioned."""
        self._optimizer, self._attached = optimizer, (inner, scaler)
        if self.partitioned:
            self._adopt()

    @property
    def optimizer(self):
        """The DistributedOptimizer attached, or None."""
        return self._optimizer

    def _adopt(self) -> None:
        """Chooses the attached optimizer's gradient regime, once (smp.gradients), and hands it over."""
        inner, scaler = self._attached
        self.gradients = gradients.choose(
            inner,
            scaler,
            self.config,
            self.groups,
            self._counts_in_norm,
            self.state.local_part,
            self.grad_sync,
            self.sharded_data,
            self._shards_gradients(),
            self._fix_trained,
        )
        self._optimizer.receive(self.gradients)

    def _fix_trained(self) -> None:
        """From now on the set of parameters that train is final (a regime built state for it)."""
        self._check_trained()
        self._trained.make_final()

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips every gradient by the global norm (a collective): those the optimizer applies, or
        without one the parameters' own."""
        if self.gradients is not None:
            return self.gradients.clip(max_norm, norm_type)
        grad_norm.check_norm_type(norm_type, "clip_grad_norm_")
        if self.sharded_data is not None:
            return self.sharded_data.clip_grad_norm(max_norm, norm_type)
        first_replica = grad_norm.first_holder(self.groups.rdp_rank, self.groups.ep_size)
        return grad_norm.clip_whole(self.module.parameters(), self._counts_in_norm, max_norm, first_replica)

    def _shards_gradients(self) -> bool:
        """Whether sharded optimizer state keeps only its chunk of the gradients (config
        "shard_gradients"; null: where that saves memory, i.e. one microbatch and no accumulation
        over steps)."""
        wanted, sync = self.config.shard_gradients, self.grad_sync
        if sync is None or wanted is False:
            return False
        if wanted is None:
            return sync.can_shard(self.config.microbatches, self._accumulation.windowed)
        return True  # GradSync.use_sharded_grads says why not, where it cannot

    def _counts_in_norm(self, param: torch.Tensor) -> bool:
        """Whether this rank counts `param` in a global norm over the model-parallel ranks."""
        if self.plan is None:
            return self.groups.tp_rank == 0
        return self.plan.counts_in_norm(param, self.groups.tp_rank)

    def register_post_partition_hook(self, hook: Callable) -> None:
        """hook(model, optimizer) runs once partitioned (at once if it already is)."""
        self._post_partition_hooks.append(hook)
        if self.partitioned:
            _run_once(self._post_partition_hooks, self.optimizer)

    # --- state ---------------------------------------------------------------------------

    @property
    def holds_whole_state(self) -> bool:
        """Whether the module's own state_dict is the whole model's (not partitioned into stages
        or shards, nor sharded over the sdp group, nor its experts divided over the ep group)."""
        split = self.sharded_data is not None or self.plan is not None and self.plan.experts is not None
        return not split and not (self.captures and (self.partitioned or self.shard_specs))

    @property
    def state(self) -> model_state.ModelState:
        """The model's state as the original module's, in the layout of now (state dicts, checkpoints)."""
        experts = self.plan.experts if self.plan is not None else None
        return model_state.ModelState(self.module, self.state_keys, self.shard_specs, self.groups, experts)


def _run_once(hooks: list[Callable], optimizer) -> None:
    """Runs hook(optimizer) for each hook and forgets them."""
    pending = list(hooks)
    hooks.clear()
    for hook in pending:
        hook(optimizer)
