"""The engine behind one smp.DistributedModel: the step lifecycle, each microbatch's forward
and backward on this rank's part, and gradient synchronization.

With pipeline_parallel_degree == tensor_parallel_degree == 1 the module runs whole on
every rank and ranks average gradients. Otherwise the first forward inside @smp.step
parallelizes the module (smp.engine.parallelize) with that microbatch as the example
inputs; later forwards run this rank's stage and exchange activations.

Optimizers attach through `attach_optimizer` (smp.engine.protocol.GradientConsumer) and
ask the engine what they need through its public methods.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp import hf, passes, recompute
from smp import params as param_facts
from smp.config import Config
from smp.data_parallel import replicas
from smp.data_parallel.grad_sync import GradSync
from smp.engine import model_state, recapture, signatures
from smp.engine.parallelize import Parallelized, parallelize, place_whole, rank_device, training_flags
from smp.engine.protocol import GradientConsumer
from smp.finite_check import FiniteCheck
from smp.groups import ParallelGroups
from smp.pipeline.rank_runtime import RankRuntime
from smp.services.activation_meter import SavedActivationMeter
from smp.services.microbatch import Microbatch
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
        self.module = module
        self.config = config
        self.groups = groups
        self.dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None
        if self.dtype is not None:
            module.to(self.dtype)  # half-precision parameters and activations; fp32 masters in the optimizer
        _refresh_parameters(module)
        self._trace_execution_times = trace_execution_times
        self._average_microbatches = average_grads_across_microbatches
        self._bucket_cap_mb = bucket_cap_mb
        self._broadcast_buffers = broadcast_buffers
        # The full state_dict's keys, in order (tied tensors appear under each name).
        self.state_keys = list(module.state_dict(keep_vars=True).keys())
        self._call_defaults = hf.call_defaults(module)
        self.parallelized: Parallelized | None = None
        # Captured stage runtimes per (train/eval flags, input signature), once partitioned.
        self._signatures = signatures.SignatureCache(config.signature_warn_after, config.signature_cache_size)
        self._modes: frozenset[tuple[bool, ...]] = frozenset()  # the train/eval flags captured
        self._grad_sync: GradSync | None = None
        # requires_grad of every parameter when the gradient handling was set up for them; whether
        # that set is final; and, if it has changed since, what changed (an error at the next backward).
        self._trained: dict[str, bool] = {}
        self._trained_final = False
        self._trained_changed: str | None = None
        self._changed_names: tuple[str, ...] = ()  # keys the graphs captured while it differs
        self._shared_groups: dict[int, dist.ProcessGroup] = {}
        self._consumers: list[GradientConsumer] = []
        self._post_partition_hooks: list[Callable] = []
        self._meter: SavedActivationMeter | None = None
        self._track_activations = False
        self._failed_step: str | None = None
        self._backward_ran = False
        self._tracing = False
        # Gradient accumulation: steps with a backward per optimizer step, and those done so far.
        self._passes_per_step = backward_passes_per_step
        self._passes_done = 0
        self._post_step_hooks: list[Callable] = []
        # Activation checkpointing: the requests, in order.
        self._checkpointing: list[recompute.CheckpointRequest] = []
        self._offloader = (
            recompute.ActivationOffloader(config.activation_loading_horizon, module.parameters)
            if config.offload_activations and torch.cuda.is_available()
            else None
        )
        self._steps = 0  # steps started
        # NaN/inf report (not in fp16, where they are the loss scaler's overflow signal).
        checks = (config.check_finite or config.debug) and not config.fp16
        self.schedule = config.schedule()
        stages = self.schedule.rank_stages(groups.pp_rank)
        self._finite = FiniteCheck(stages, groups.rank) if checks else None
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
        return self.parallelized is not None

    @property
    def tracing(self) -> bool:
        """Whether the module is being captured now (its forward runs on fake tensors)."""
        return self._tracing

    @property
    def shard_specs(self) -> Mapping[int, passes.ShardSpec]:
        """id(local shard) -> how it was cut (empty before partitioning or without TP)."""
        return self.parallelized.shard_specs if self.parallelized is not None else {}

    @property
    def grad_sync(self) -> GradSync | None:
        """The gradient averaging (None before the model is placed); read it, e.g. to time it."""
        return self._grad_sync

    @property
    def partition_plan(self) -> passes.PartitionPlan | None:
        return self.parallelized.plan if self.parallelized is not None else None

    # --- the step lifecycle (called by smp.step) ---------------------------------------

    def start_step(self) -> None:
        if self._failed_step is not None:
            raise RuntimeError(
                f"smp: an earlier step failed part-way through the pipeline ({self._failed_step[:200]}); "
                "its activations may still be in flight between stages, so this pipeline cannot run "
                "another step: restart the job (from a checkpoint)"
            )
        if self._steps == 0:
            self._check_offloading()
        self._check_trained_parameters()
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
        for runtime in self._signatures.values():
            runtime.finish_step()
        if self._offloader is not None:
            self._offloader.finish_step()
        if self._grad_sync is not None:
            self._grad_sync.finish_step()
        if self._finite is not None:
            self._check_finite()
        if self._backward_ran:
            self._trained_final = True
            self._passes_done = (self._passes_done + 1) % self._passes_per_step
            if self._passes_done == 0:  # the accumulation window is complete
                for consumer in self._consumers:
                    consumer.gradients_ready()
        hooks, self._post_step_hooks = self._post_step_hooks, []
        for hook in hooks:
            hook(self.optimizer)

    def _check_trained_parameters(self) -> None:
        """Which parameters train is final once smp has built state for it: a captured model's
        stage graphs at its first step (of any kind), a whole model's gradient averaging at its
        first step that runs backward, sharded or mixed-precision optimizer state when built (as
        DDP fixes it when it wraps a model). Until then the averaging follows requires_grad; a
        change later is an error at the next backward (forward-only steps may run with anything
        frozen, on graphs captured apart), not gradients left out or never averaged."""
        self._trained_changed, self._changed_names = None, ()
        if not self._trained:
            return
        now = _requires_grad(self.module)
        if now == self._trained:
            return
        if not self._trained_final:
            self._grad_sync.follow_requires_grad(list(self.module.parameters()))
            self._trained = now
            return
        changed = [name for name, flag in now.items() if self._trained.get(name) != flag]
        self._changed_names = tuple(changed)
        listed = ", ".join(f"{name!r} ({self._trained.get(name)} -> {now[name]})" for name in changed[:5])
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        self._trained_changed = (
            f"smp: requires_grad of {listed}{more} changed after smp set up which parameters train "
            "(at the first step of a pipeline or tensor-parallel model, the first training step of "
            "a whole one, or when sharded or mixed-precision optimizer state was built: gradient "
            "averaging, sums across stages, optimizer state), as DDP does when it wraps a model; "
            "training another set later is not supported. Set requires_grad before the first "
            "smp.step call; to train another set of parameters later, save a checkpoint and resume "
            "from it in a new run with the new settings"
        )

    def fix_trained_parameters(self) -> None:
        """Called by an optimizer that builds state for the parameters requiring grad now (flat
        buffers, shards): from here on that set is final."""
        self._check_trained_parameters()
        self._trained_final = True

    def _start_grad_sync(self) -> None:
        self._grad_sync.start_step(
            self.config.microbatches,
            new_window=self._passes_done == 0,
            sync=self._passes_done + 1 == self._passes_per_step,
        )

    def _check_finite(self) -> None:
        if self._backward_ran:
            named = self.module.named_parameters()
            grads = [(n, param_facts.applied_grad(p)) for n, p in named if not param_facts.is_nonlocal(p)]
            self._finite.gradients(grads)
        self._finite.raise_if_any(self._steps, None)  # on every rank: none is left waiting

    def register_post_step_hook(self, hook: Callable) -> None:
        """hook(optimizer) runs once, when the next step has finished (its gradients averaged)."""
        self._post_step_hooks.append(hook)

    def abandon_step(self, error: BaseException) -> None:
        """A step failed part-way: with pipeline stages, its messages may still be in flight."""
        if self.groups.pp_size > 1:
            self._failed_step = f"{type(error).__name__}: {error}"

    # --- one microbatch ----------------------------------------------------------------

    def forward(self, mb: Microbatch, args: tuple, kwargs: dict) -> Any:
        args, kwargs = _on_device((args, kwargs), rank_device())  # CPU batches on a GPU rank
        if self.dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self.dtype)
        if not self.captures:
            with self._saving_for(mb):
                return self.module(*args, **kwargs)
        kwargs = self._call_defaults | kwargs
        if self.groups.tp_size > 1:
            args, kwargs = tp_inputs.combine(
                args, kwargs, mb.batch_size, self.config.prescaled_batch, not self.partitioned, self.groups
            )
        signature = signatures.of(args, kwargs)
        if not self.partitioned:
            self._partition(args, kwargs, mb.batch_size, signature)
        mb.runtime = self._runtime(args, kwargs, mb.batch_size, signature)
        # Each of this rank's stages is its own action: the microbatch pauses between them.
        pending = mb.runtime.forward(mb.index, args, kwargs, mb.pause, lambda: self._saving_for(mb))
        if self._finite is not None:
            self._finite.activations(mb.index, mb.runtime.produced_by_stage(mb.index))
        mb.pause()
        return pending.wait()

    def backward(self, mb: Microbatch, tensors: list[torch.Tensor], grad_tensors: list) -> None:
        if self._trained_changed is not None:
            raise ValueError(self._trained_changed)
        scale = 1.0 / self.config.microbatches if self._average_microbatches else 1.0
        if self._consumers:
            scale *= self._consumers[0].loss_scale  # fp16 loss scaling; the optimizer divides it out
        self._backward_ran = True
        if self._finite is not None:
            self._finite.loss(mb.index, tensors)
        grads = []
        for t, g in zip(tensors, grad_tensors, strict=True):
            if g is None:
                if t.numel() != 1:
                    raise ValueError(
                        f"smp: model.backward got a tensor of shape {tuple(t.shape)} without grad_tensors; "
                        "reduce it to a scalar loss or pass grad_tensors"
                    )
                g = torch.ones_like(t)
            grads.append(g * scale if scale != 1.0 else g)
        if self._offloader is not None:
            self._offloader.before_backward(mb.index)
        if self.captures:
            mb.runtime.backward(mb.index, tensors, grads, self._defers_weights, mb.pause)
            return
        roots = [(t, g) for t, g in zip(tensors, grads, strict=True) if t.requires_grad]
        if roots:
            torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])

    @property
    def _defers_weights(self) -> bool:
        return self.schedule.splits_backward

    def backward_weights(self, mb: Microbatch, stage: int) -> None:
        """A split-backward schedule's W action: microbatch mb's deferred weight gradients on
        `stage` (nothing if its backward did not defer them: no model.backward, or a model that
        runs whole)."""
        if mb.runtime is not None and self._defers_weights:
            mb.runtime.backward_weights(mb.index, stage)

    # --- parallelization -----------------------------------------------------------------

    def _partition(self, args: tuple, kwargs: dict, batch_size: int | None, signature) -> None:
        self._tracing = True
        try:
            parallelized, seconds = signatures.timed(
                lambda: parallelize(
                    self.module,
                    args,
                    kwargs,
                    self.config,
                    self.groups,
                    batch_size,
                    self._trace_execution_times,
                    recompute.regions(self._checkpointing),
                    self._offloader,
                )
            )
        finally:
            self._tracing = False
        self._install(parallelized)
        self._modes = frozenset(parallelized.runtimes)
        for flags, runtime in parallelized.runtimes.items():  # the first signature, in both modes
            self._signatures.put(flags, signature, runtime, seconds / len(parallelized.runtimes))
        # From here on the signature cache alone holds them, so its bound covers them too.
        self.parallelized = dataclasses.replace(parallelized, runtimes={})
        self._start_grad_sync()  # this step is under way
        self._meter = SavedActivationMeter(self.module.parameters())
        self.track_saved_activations(self._track_activations)
        if self.config.debug and self.groups.rank == 0:
            print(self.parallelized.plan.report(), flush=True)
            if parallelized.tp_coverage is not None:
                print(parallelized.tp_coverage, flush=True)
        if (
            self.config.debug
            and parallelized.recompute_report
            and self.groups.tp_rank == self.groups.rdp_rank == 0
        ):
            print(parallelized.recompute_report, flush=True)
        self._run_post_partition_hooks()

    def _install(self, parallelized: Parallelized) -> None:
        self.parallelized = parallelized
        self._grad_sync = GradSync(
            list(self.module.parameters()),
            parallelized.grad_group,
            list(parallelized.shared),
            self._bucket_cap_mb,
            self.dtype is not None,
            parallelized.stage_reads,
        )
        self._shared_groups = {id(p): group for _, p, group in parallelized.shared}
        self._trained = _requires_grad(self.module)
        # A captured model's stage graphs and optimizer state are built for the set at partition.
        self._trained_final = self.captures
        for runtime in parallelized.runtimes.values():
            self._prepare(runtime)

    def _prepare(self, runtime: RankRuntime) -> None:
        """What the schedule asks of a new rank runtime (every signature's): the message path,
        and for the split-backward schedules the rewrite that lets weight gradients wait for W."""
        if self.groups.pp_size > 1:
            slots = self.schedule.slots()
            runtime.order_messages(self.config.ordered_messages, slots)
        if self._defers_weights:
            runtime.defer_weight_gradients()

    def _runtime(self, args: tuple, kwargs: dict, batch_size: int | None, signature) -> RankRuntime:
        """The stage runtime for the modules' train/eval modes and these inputs' signature,
        captured now (following the first partition) when the signature is new."""
        flags = training_flags(self.module)
        # Graphs captured while requires_grad differs from the trained set (a forward-only step
        # with parameters frozen) bake that in: they are kept apart from the training ones.
        key = (flags, self._changed_names) if self._changed_names else flags
        if flags not in self._modes:
            raise RuntimeError(
                "smp: the pipeline was captured with every module in train mode or every module in eval "
                "mode (as set when the first step ran, and its opposite); this mix of train/eval modules "
                "is neither. Set the modes before the first step, or use model.train() / model.eval()"
            )
        runtime = self._signatures.get(key, signature)
        if runtime is None:
            runtime, seconds = signatures.timed(
                lambda: self._capture_signature(flags, args, kwargs, batch_size)
            )
            self._signatures.put(key, signature, runtime, seconds)
        return runtime

    def _capture_signature(self, flags, args: tuple, kwargs: dict, batch_size: int | None) -> RankRuntime:
        self._tracing = True
        try:
            runtime = recapture.capture_signature(
                self.module,
                self.parallelized.recipe,
                flags,
                args,
                kwargs,
                batch_size,
                self.config,
                self.groups,
            )
        finally:
            self._tracing = False
        runtime.meter = self._meter if self._track_activations else None
        self._prepare(runtime)
        return runtime

    @property
    def signature_cache(self) -> signatures.SignatureCache:
        """The captured input signatures (how many seen, cached, evicted; the advice text)."""
        return self._signatures

    # --- activation checkpointing ----------------------------------------------------------

    def set_activation_checkpointing(self, request: recompute.CheckpointRequest) -> None:
        """Recomputes the request's regions in backward (before the first step only)."""
        if self._steps > 0:
            raise ValueError(
                f"smp.set_activation_checkpointing({request.paths[0] or 'the whole model'}): called after "
                "the first step, when the model is already partitioned and running; call it after "
                "smp.DistributedModel(...) and before the first @smp.step call"
            )
        self._checkpointing.append(request)
        if not self.captures:  # the module runs whole: its forwards are wrapped now
            recompute.apply_eager(request, self._offloader)

    def _saving_for(self, mb: Microbatch):
        """Around a microbatch's forward: checkpointed regions offload their inputs for it."""
        if self._offloader is None:
            return contextlib.nullcontext()
        return self._offloader.forward_of(mb.index)

    def _check_offloading(self) -> None:
        if not self.config.offload_activations:
            return
        if not self._checkpointing:
            warnings.warn(
                "smp: offload_activations is on but no module is checkpointed, so there is nothing to "
                "offload; call smp.set_activation_checkpointing(module) before the first step",
                stacklevel=3,
            )
        elif self._offloader is None:
            warnings.warn(
                "smp: offload_activations has no effect here: activations are CPU tensors, already in "
                "host memory",
                stacklevel=3,
            )

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
        for runtime in self._signatures.values():
            runtime.meter = self._meter if enabled else None

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


def _requires_grad(module: nn.Module) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in module.named_parameters()}


def _on_device(tree, device: torch.device):
    """CPU tensors moved to `device` (smp.step accepts CPU batches on a GPU rank and has checked
    that no tensor is on another accelerator): the capture and the stages then see the rank's
    device, as the module is there (a tensor made inside from x.device follows)."""
    if device.type == "cpu":
        return tree

    def move(x):
        return x.to(device) if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x

    return torch.utils._pytree.tree_map(move, tree)


def _cast_floating(tree, dtype: torch.dtype):
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return torch.utils._pytree.tree_map(cast, tree)


def _refresh_parameters(module: nn.Module) -> None:
    """Gives the module new Parameter objects (same storage). An optimizer built from the module
    before it was wrapped still holds the old ones: smp.DistributedOptimizer follows them to the
    new ones (marked moved), and an optimizer left unwrapped is caught at its first step."""
    fresh: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in fresh:
                fresh[id(p)] = nn.Parameter(p.data, requires_grad=p.requires_grad)
                param_facts.mark_replaced(p)
                param_facts.mark_moved(p, fresh[id(p)])
            m._parameters[name] = fresh[id(p)]
