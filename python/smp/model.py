"""smp.DistributedModel: wraps an unmodified nn.Module for pipeline, tensor and data parallelism.

With pipeline_parallel_degree == tensor_parallel_degree == 1 the module runs whole on
every rank and ranks average gradients. Otherwise the first model call inside
@smp.step captures the forward as a graph, partitions it into pp stages, shards the
marked layers over the tensor-parallel group (smp.passes), and this rank keeps only
its stage's parameters (its shards of the distributed ones); later calls run the
stage and exchange activations.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp import activation_meter, core, delayed_init, grad_norm, hf, microbatch, passes, tp_inputs
from smp._backend import BACKEND_NAME
from smp.grad_sync import GradSync
from smp.partitioning import module_partitions
from smp.pipeline import StageRuntime
from smp.topology import CommGroup
from smp.tp_marks import marked_modules


def current() -> DistributedModel | None:
    return core.state().model if core.is_initialized() else None


def start_step() -> None:
    if current() is not None:
        current()._start_step()


def finish_step() -> None:
    if current() is not None:
        current()._finish_step()


def abandon_step(error: BaseException) -> None:
    """A step failed part-way: with pipeline stages, its messages may still be in flight."""
    model = current()
    if model is not None and core.pp_size() > 1:
        model._failed_step = f"{type(error).__name__}: {error}"


class DistributedModel(nn.Module):
    """SMP v1's DistributedModel (one per process).

    Effective arguments: trace_execution_times (partition by measured op times instead
    of FLOPs), average_grads_across_microbatches, bucket_cap_mb (data-parallel
    buckets), broadcast_buffers (replicas take the first replica's buffers every step).
    Accepted for SMP scripts, without effect: trace_device (the capture runs where the
    first microbatch's tensors are), trace_memory_usage, overlapping_allreduce (buckets
    always start during backward), find_unused_parameters (unused parameters are always
    handled), gradient_as_bucket_view. backward_passes_per_step must be 1.
    """

    def __init__(
        self,
        module: nn.Module,
        trace_device: str = "gpu",
        trace_execution_times: bool = False,
        trace_memory_usage: bool = False,
        overlapping_allreduce: bool = True,
        backward_passes_per_step: int = 1,
        average_grads_across_microbatches: bool = True,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = False,
    ):
        if not isinstance(module, nn.Module) or isinstance(module, DistributedModel):
            raise TypeError(f"smp.DistributedModel wraps a plain nn.Module once, got {type(module).__name__}")
        st = core.state()
        if st.model is not None:
            raise RuntimeError(
                "smp: a DistributedModel already exists in this process; SMP allows one per script: "
                "wrap the whole model once (put several networks in one nn.Module)"
            )
        if backward_passes_per_step != 1:
            raise ValueError(
                f"smp.DistributedModel: backward_passes_per_step={backward_passes_per_step} is not "
                "supported; use 1 and raise `microbatches` to accumulate gradients over more samples per step"
            )
        super().__init__()
        self._config = st.config
        self._dtype = _half_dtype(st.config)
        if self._dtype is not None:
            module.to(self._dtype)  # half-precision parameters and activations; fp32 masters in the optimizer
        self.module = module
        self._broadcast_buffers = broadcast_buffers
        self._trace_execution_times = trace_execution_times
        self._average_microbatches = average_grads_across_microbatches
        self._bucket_cap_mb = bucket_cap_mb
        _refresh_parameters(module)
        # The full state_dict's keys, in order (tied tensors appear under each name).
        self._keys = list(module.state_dict(keep_vars=True).keys())
        self._call_defaults = hf.call_defaults(module)
        self._runtimes: dict[tuple[bool, ...], StageRuntime] = {}
        self._grad_sync: GradSync | None = None
        self._shared_params: dict[int, dist.ProcessGroup] = {}  # id -> group of the stages sharing it
        self._tp_specs: dict[int, passes.ShardSpec] = {}  # id(local shard) -> how it was cut
        self._meter: activation_meter.SavedActivationMeter | None = None
        self._track_activations = False
        self.partition_plan: passes.PartitionPlan | None = None
        self.partitioned = False
        self._failed_step: str | None = None
        self._optimizers: list[Any] = []  # DistributedOptimizers over this model
        self._backward_ran = False
        self._post_partition_hooks: list[Any] = []
        st.model = self
        if not self._captures():
            self._place_whole()

    # --- calls inside smp.step ----------------------------------------------

    def forward(self, *args, **kwargs):
        mb = microbatch.current()
        if mb is None:
            raise RuntimeError(
                "smp: the DistributedModel can only be called inside a function decorated with @smp.step; "
                "move `model(...)` and `model.backward(loss)` into the step function"
            )
        mb.forward_calls += 1
        if mb.forward_calls > 1:
            raise RuntimeError(
                "smp: the DistributedModel was called twice in one step function; call it once per step "
                "(concatenate the inputs into one call)"
            )
        if self._dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self._dtype)
        if not self._captures():
            return self.module(*args, **kwargs)
        kwargs = self._call_defaults | kwargs
        if core.tp_size() > 1:
            prescaled = self._config.prescaled_batch
            args, kwargs = tp_inputs.combine(args, kwargs, mb.batch_size, prescaled, not self.partitioned)
        if not self.partitioned:
            self._partition(args, kwargs)
            self._run_post_partition_hooks()
        mb.runtime = self._runtime()
        pending = mb.runtime.forward(mb.index, args, kwargs)
        mb.pause()
        return pending.wait()

    def backward(self, tensors, grad_tensors=None) -> None:
        """Replaces loss.backward() inside @smp.step: runs this rank's part of the backward."""
        mb = microbatch.current()
        if mb is None:
            raise RuntimeError(
                "smp: model.backward(loss) can only be called inside a function decorated with @smp.step"
            )
        if mb.forward_calls == 0:
            raise RuntimeError("smp: model.backward(loss) was called before the model's forward in this step")
        mb.backward_calls += 1
        if mb.backward_calls > 1:
            raise RuntimeError("smp: model.backward was called twice in one step function; call it once")
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if grad_tensors is None:
            grad_tensors = [None] * len(tensors)
        elif isinstance(grad_tensors, torch.Tensor):
            grad_tensors = [grad_tensors]
        scale = 1.0 / self._config.microbatches if self._average_microbatches else 1.0
        if self._optimizers:
            scale *= self._optimizers[0].loss_scale  # fp16 loss scaling; the optimizer divides it out
        self._backward_ran = True
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
        if not self._captures():
            roots = [(t, g) for t, g in zip(tensors, grads, strict=True) if t.requires_grad]
            if roots:
                torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
        else:
            mb.runtime.backward(mb.index, tensors, grads)

    def _start_step(self) -> None:
        if self._failed_step is not None:
            raise RuntimeError(
                f"smp: an earlier step failed part-way through the pipeline ({self._failed_step[:200]}); "
                "its activations may still be in flight between stages, so this pipeline cannot run "
                "another step: restart the job (from a checkpoint)"
            )
        if self._grad_sync is not None:
            self._grad_sync.start_step(self._config.microbatches)
        self._backward_ran = False
        if self._broadcast_buffers and self.partitioned:
            # As DDP: replicas use the first replica's buffers (BatchNorm statistics) every step.
            self._broadcast_from_first_replica(list(self.module.buffers()))

    def _finish_step(self) -> None:
        for runtime in self._runtimes.values():
            runtime.finish_step()
        if self._grad_sync is not None:
            self._grad_sync.finish_step()
        if self._backward_ran:
            for optimizer in self._optimizers:
                optimizer._gradients_ready()

    # --- placement ------------------------------------------------------------

    def _place_whole(self) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if delayed_init.is_delayed(self.module):
            self._materialize(device or torch.device("cpu"))
        if device is not None:
            self.module.to(device)
        tensors = list(self.module.parameters()) + list(self.module.buffers())
        dp_group = self._broadcast_from_first_replica(tensors)
        fp32 = self._dtype is not None
        self._grad_sync = GradSync(list(self.module.parameters()), dp_group, [], self._bucket_cap_mb, fp32)
        self.partitioned = True

    def _captures(self) -> bool:
        """Whether the model runs as a captured graph (pipeline stages or tensor-parallel layers)."""
        return core.pp_size() > 1 or core.tp_size() > 1

    def _partition(self, args: tuple, kwargs: dict) -> None:
        """Captures, partitions, shards and splits the model; frees what this rank's stage does not use.

        The graph is captured twice, in the current train/eval mode and in the opposite one,
        while every parameter still exists: switching modes later picks the other graph.
        """
        cfg = self._config
        stage = core.pp_rank()
        device = _input_device(args, kwargs)
        delayed = delayed_init.is_delayed(self.module)
        if delayed:  # capture on meta tensors; only this rank's part is ever allocated
            if self._trace_execution_times:
                raise ValueError(
                    "smp: trace_execution_times needs real parameters; it cannot be combined with "
                    "smp.delay_param_initialization()"
                )
            args, kwargs = delayed_init.to_meta((args, kwargs))
        else:
            self.module.to(device)
        captured = self._capture(args, kwargs, device if delayed else None)
        plan = self._plan(captured, args, kwargs)
        modes = {_training_flags(self.module): (captured, plan)}
        with _opposite_mode(self.module) as flags:
            other = self._capture(args, kwargs, device if delayed else None)
            modes[flags] = (other, passes.follow_partition(other.graph_module, plan))
        if core.tp_size() > 1:
            modes = self._shard(modes, args, kwargs)
            plan = modes[_training_flags(self.module)][1]
        pipes = {flags: passes.split(c, p) for flags, (c, p) in modes.items()}
        plans = [p for _, p in modes.values()]
        self._keep_local(captured.graph_module, pipes.values(), plans, stage)
        if delayed:
            replaced = self._materialize(device)
            for graph_module in [c.graph_module for c, _ in modes.values()] + [
                s.module for pipe in pipes.values() for s in pipe.stages if s.module is not None
            ]:
                delayed_init.replace_in(graph_module, replaced)
        shared = self._shared_groups(captured.graph_module, plans, stage)
        self._synchronize_replicas(shared)
        self._meter = activation_meter.SavedActivationMeter(self.module.parameters())
        self._runtimes = {
            flags: StageRuntime(
                pipe, stage, core.get_pp_process_group(), core.get_pp_group(), cfg.microbatches, device
            )
            for flags, pipe in pipes.items()
        }
        self.track_saved_activations(self._track_activations)
        self.partition_plan = plan
        self.partitioned = True
        if cfg.debug and core.rank() == 0:
            print(plan.report(), flush=True)

    def _capture(self, args: tuple, kwargs: dict, retarget: torch.device | None):
        captured = passes.capture(self.module, args, kwargs)
        if retarget is not None:
            delayed_init.retarget(captured.graph_module, retarget)
        return captured

    def _materialize(self, device: torch.device) -> dict[int, torch.Tensor]:
        """Delayed initialization: allocates and initializes this rank's part; replicated tensors
        then come from the tensor-parallel group's first rank, so the group agrees on them."""
        full_shapes = {}
        for p in self.module.parameters():
            spec = self._tp_specs.get(id(p))
            if spec is not None:
                shape = list(p.shape)
                shape[spec.dim] *= core.tp_size()
                full_shapes[id(p)] = torch.Size(shape)
        replaced = delayed_init.materialize(
            self.module, full_shapes, device, self._config.tensor_parallel_seed, core.tp_rank()
        )
        self._tp_specs = {id(replaced[k]) if k in replaced else k: v for k, v in self._tp_specs.items()}
        if core.tp_size() > 1:
            replicated = [p for p in self.module.parameters() if id(p) not in self._tp_specs]
            self._broadcast_over(
                replicated + list(self.module.buffers()), core.get_tp_process_group(), core.get_tp_group()
            )
        return replaced

    def _shard(self, modes: dict, args: tuple, kwargs: dict) -> dict:
        """Runs the tensor-parallel pass on each captured mode (sharing shards and decisions) and
        puts the shards in the module; returns the modes with plans covering the new nodes."""
        group = core.get_tp_process_group()
        combined = None
        if not self._config.prescaled_batch:
            combined = microbatch.current().batch_size * core.tp_size()
        marked = marked_modules(self.module)
        result = None
        sharded = {}
        for flags, (captured, plan) in modes.items():
            result = passes.tensor_parallel(
                captured.graph_module,
                group,
                marked,
                scatter_batch=combined,
                shards=result.shards if result else None,
                replicated=result.replicated if result else None,
            )
            new_plan = passes.plan_from_assignment(
                captured.graph_module,
                _stages_after_rewrite(captured.graph_module, plan.node_stage),
                plan.num_stages,
                self._config.colocate_shared_parameters,
            )
            sharded[flags] = (captured, new_plan)
        for key, reason in result.replicated.items():
            warnings.warn(f"smp tensor parallelism: {key} stays replicated: {reason}", stacklevel=3)
        self._install_shards(result)
        return sharded

    def _install_shards(self, result) -> None:
        """Puts each sharded parameter's local shard in the module in place of the full one, whose
        storage is freed (a DistributedOptimizer built on the full one follows `_smp_moved_to`)."""
        for owner in self.module.modules():
            for name, p in list(owner._parameters.items()):
                if p is not None and id(p) in result.shards:
                    owner._parameters[name] = result.shards[id(p)]
                    if getattr(p, "_smp_moved_to", None) is None:
                        p._smp_moved_to = result.shards[id(p)]
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        named = self.module.named_parameters(remove_duplicate=False)
        self._tp_specs = {id(p): result.specs[path] for path, p in named if path in result.specs}

    def _synchronize_replicas(self, shared) -> None:
        """Replicas start equal (as DDP): replicated tensors from the data-parallel group's first
        rank, shards from the reduced-data-parallel group's. Gradients are then averaged over the
        reduced-data-parallel group: the ranks of a tensor-parallel group run one batch (prescaled,
        or their batches combined) and so already hold identical gradients of every replicated
        parameter, which makes that average equal to SMP's data-parallel one, at less traffic."""
        params = list(self.module.parameters())
        distributed = [p for p in params if id(p) in self._tp_specs]
        replicated = [p for p in params if id(p) not in self._tp_specs]
        self._broadcast_from_first_replica(replicated + list(self.module.buffers()))
        rdp_group = self._broadcast_over(distributed, core.get_rdp_process_group(), core.get_rdp_group())
        for _, p, group in shared:
            dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)
        self._grad_sync = GradSync(params, rdp_group, shared, self._bucket_cap_mb, self._dtype is not None)
        self._shared_params = {id(p): group for _, p, group in shared}
        self._grad_sync.start_step(self._config.microbatches)

    def _plan(self, captured, args: tuple, kwargs: dict) -> passes.PartitionPlan:
        cfg = self._config
        gm, num_stages = captured.graph_module, core.pp_size()
        seconds = None
        if self._trace_execution_times and num_stages > 1:
            seconds = passes.cost.measure_seconds(gm, captured.flatten_inputs(args, kwargs))
        passes.cost.annotate(gm, seconds)
        if num_stages == 1:
            every = {n.name: 0 for n in gm.graph.nodes if n.op in passes.partition.COMPUTE_OPS}
            return passes.plan_from_assignment(gm, every, 1)
        if cfg.auto_partition:
            plan = passes.auto_partition(gm, num_stages, cfg.memory_weight, cfg.colocate_shared_parameters)
        else:
            plan = passes.manual_partition(
                gm,
                num_stages,
                module_partitions(self.module),
                cfg.default_partition,
                cfg.colocate_shared_parameters,
            )
        # Measured times differ between ranks: everyone adopts global rank 0's assignment.
        agreed = [plan.node_stage]
        dist.broadcast_object_list(agreed, src=0)
        if agreed[0] != plan.node_stage:
            plan = passes.partition.plan_from_assignment(
                gm, agreed[0], num_stages, cfg.colocate_shared_parameters
            )
        return plan

    def _runtime(self) -> StageRuntime:
        flags = _training_flags(self.module)
        if flags not in self._runtimes:
            raise RuntimeError(
                "smp: the pipeline was captured with every module in train mode or every module in eval "
                "mode (as set when the first step ran, and its opposite); this mix of train/eval modules "
                "is neither. Set the modes before the first step, or use model.train() / model.eval()"
            )
        return self._runtimes[flags]

    def _keep_local(self, gm, pipes, plans, stage: int) -> None:
        """Frees every parameter and buffer that this rank's stage does not use in any mode (stage 0
        also keeps the ones no stage uses)."""
        params = dict(gm.named_parameters(remove_duplicate=False))
        keep: set[int] = set()
        used: set[int] = set()
        for pipe, plan in zip(pipes, plans, strict=True):
            for s in pipe.stages:
                ids = {id(t) for t in _attr_tensors(s.module)}
                used |= ids
                if s.index == stage:
                    keep |= ids | {id(params[name]) for name in plan.stage_parameters[stage]}
        for owner in self.module.modules():
            for table in (owner._parameters, owner._buffers):
                for name, t in list(table.items()):
                    if t is None or id(t) in keep or (stage == 0 and id(t) not in used):
                        continue
                    if isinstance(t, nn.Parameter):
                        t._smp_nonlocal = True
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                    table[name] = None
        for pipe in pipes:
            for s in pipe.stages:
                if s.index != stage:
                    s.module = None

    def _shared_groups(self, gm, plans, stage: int):
        """Process groups joining the replicas of each shared parameter (created on every rank, in order)."""
        sharing: dict[str, set[int]] = {}
        for plan in plans:
            for name, stages in plan.shared_parameters.items():
                sharing.setdefault(name, set()).update(stages)
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        pp_groups = core.state().topology.all_groups(CommGroup.PP_GROUP)
        for stages in sorted({tuple(sorted(s)) for s in sharing.values()}):
            for ranks in pp_groups:
                members = [ranks[s] for s in stages]
                group = dist.new_group(members, backend=BACKEND_NAME)
                if core.rank() in members:
                    groups[stages] = group
        shared = []
        params = dict(gm.named_parameters(remove_duplicate=False))
        for name, stages in sorted(sharing.items()):
            if stage in stages and params[name].requires_grad:
                shared.append((name, params[name], groups[tuple(sorted(stages))]))
        return shared

    def _broadcast_from_first_replica(self, tensors: list[torch.Tensor]) -> dist.ProcessGroup | None:
        """Makes data-parallel replicas start equal (as DDP does); returns the group if it has >1 rank."""
        return self._broadcast_over(tensors, core.get_dp_process_group(), core.get_dp_group())

    @staticmethod
    def _broadcast_over(tensors, group, ranks) -> dist.ProcessGroup | None:
        if len(ranks) == 1:
            return None
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t.data, src=ranks[0], group=group)
        return group

    # --- introspection and state ----------------------------------------------

    def register_post_partition_hook(self, hook) -> None:
        """hook(model, optimizer) runs once the model is partitioned (at once if it already is);
        optimizer is the DistributedOptimizer over this model, or None."""
        self._post_partition_hooks.append(hook)
        if self.partitioned:
            self._run_post_partition_hooks()

    def _run_post_partition_hooks(self) -> None:
        hooks, self._post_partition_hooks = self._post_partition_hooks, []
        for hook in hooks:
            hook(self, self._optimizers[0] if self._optimizers else None)

    def local_parameters(self):
        return self.module.parameters()

    def local_named_parameters(self):
        return self.module.named_parameters()

    def local_buffers(self):
        return self.module.buffers()

    def local_named_buffers(self):
        return self.module.named_buffers()

    def local_modules(self):
        """Modules holding a parameter or buffer on this rank."""
        return [
            m
            for m in self.module.modules()
            if next(m.parameters(recurse=False), None) is not None
            or next(m.buffers(recurse=False), None) is not None
        ]

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The full model's state_dict (original keys, full shapes). With pipeline stages or
        tensor-parallel layers it is a collective over the pipeline and tensor-parallel groups:
        call it on every rank (or on every rank with rdp_rank() == 0)."""
        if not self._captures() or not self.partitioned:
            return self.module.state_dict(*args, **kwargs)
        local = self._unsharded_local_state()
        if core.pp_size() == 1:
            return {k: local[k] for k in self._keys}
        parts: list[Any] = [None] * core.pp_size()
        dist.all_gather_object(parts, local, group=core.get_pp_process_group())
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
        missing = [k for k in self._keys if k not in merged]
        if missing:
            raise RuntimeError(f"smp: state_dict is missing {missing[:5]} after gathering the stages")
        return {k: merged[k] for k in self._keys}

    def _unsharded_local_state(self) -> dict[str, torch.Tensor]:
        """This stage's state on CPU, each tensor-parallel shard gathered into the full tensor."""
        group = core.get_tp_process_group()
        state = {}
        for key, t in self.module.state_dict(keep_vars=True).items():
            spec = self._tp_specs.get(id(t))  # keep_vars: the Parameter objects themselves
            t = t.detach()
            if spec is not None:
                parts = [torch.empty_like(t) for _ in range(core.tp_size())]
                dist.all_gather(parts, t.contiguous(), group=group)
                t = spec.full(parts)
            state[key] = t.cpu()
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a full (unsharded) state_dict; after partitioning each rank takes the entries of its
        stage, cut to its tensor-parallel shard."""
        if not self.partitioned or not self._captures():
            return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        unknown = [k for k in state_dict if k not in self._keys]
        missing = [k for k in self._keys if k not in state_dict]
        if strict and (unknown or missing):
            raise RuntimeError(
                f"smp: load_state_dict: unexpected keys {unknown[:5]}, missing keys {missing[:5]} "
                "(pass strict=False to load a subset)"
            )
        with torch.no_grad():
            for key, t in self.module.named_parameters(remove_duplicate=False):
                if key in state_dict:
                    t.copy_(self._local_part(t, state_dict[key]))
            for key, t in self.module.named_buffers(remove_duplicate=False):
                if key in state_dict:
                    t.copy_(state_dict[key])
        return None

    def _local_part(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        spec = self._tp_specs.get(id(param))
        return full if spec is None else spec.local(full, core.tp_rank(), core.tp_size())

    # --- gradient norm ------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips all gradients by their global L2 norm over every stage and tensor-parallel shard
        (a replicated parameter counts once); returns the norm. A collective on every rank. With a
        DistributedOptimizer it clips the gradients that optimizer is about to apply."""
        if self._optimizers:
            return self._optimizers[0].clip_master_grads(max_norm, norm_type)
        grad_norm.check_norm_type(norm_type, "clip_grad_norm_")
        return grad_norm.clip_whole(self.module.parameters(), self._counts_in_norm, max_norm)

    def _counts_in_norm(self, param: torch.Tensor) -> bool:
        """Whether this rank counts `param` in a global norm over the model-parallel ranks: shards
        always; replicated parameters on tp rank 0; a parameter shared by stages on its first one."""
        if id(param) not in self._tp_specs and core.tp_rank() != 0:
            return False
        group = self._shared_params.get(id(param))
        return group is None or dist.get_global_rank(group, 0) == dist.get_rank()

    # --- tensor parallelism (SMP v1 names) -----------------------------------------------------

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        """Whether `param` is this rank's shard of a tensor-parallel parameter."""
        return id(param) in self._tp_specs

    def is_distributed_buffer(self, buffer: torch.Tensor) -> bool:
        return False  # buffers stay replicated

    def is_scaled_batch_parameter(self, param: torch.Tensor) -> bool:
        return self.is_distributed_parameter(param)

    def distributed_modules(self) -> list[nn.Module]:
        """Modules whose parameters are sharded over the tensor-parallel group."""
        owners = {
            path.rsplit(".", 1)[0] if "." in path else ""
            for path, p in self.module.named_parameters(remove_duplicate=False)
            if id(p) in self._tp_specs
        }
        return [self.module.get_submodule(path) for path in sorted(owners)]

    def default_reducer_named_parameters(self):
        """Parameters whose gradients are averaged over the data-parallel group."""
        return [(n, p) for n, p in self.module.named_parameters() if id(p) not in self._tp_specs]

    def scaled_batch_reducer_named_parameters(self):
        """Tensor-parallel shards: gradients averaged over the reduced-data-parallel group."""
        return [(n, p) for n, p in self.module.named_parameters() if id(p) in self._tp_specs]

    def track_saved_activations(self, enabled: bool = True) -> None:
        """Counts bytes saved for backward by this rank's stage (see saved_activation_bytes)."""
        self._track_activations = enabled
        for runtime in self._runtimes.values():
            runtime.meter = self._meter if enabled else None

    def saved_activation_bytes(self) -> dict[str, int]:
        meter = self._meter
        return {"live": meter.live_bytes if meter else 0, "peak": meter.peak_bytes if meter else 0}

    def partition_report(self) -> str:
        if self.partition_plan is None:
            return "smp partition: not partitioned (pipeline_parallel_degree == 1 or no step has run yet)"
        return self.partition_plan.report()


def _stages_after_rewrite(gm: torch.fx.GraphModule, before: dict[str, int]) -> dict[str, int]:
    """Stages for a rewritten graph: each node runs where the original node it serves ran
    (`smp_tp_origin`); nodes serving the output run on the latest stage of their inputs."""
    stages: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op not in passes.partition.COMPUTE_OPS:
            continue
        origin = node.meta.get("smp_tp_origin", node.name)
        inputs = [stages[n.name] for n in node.all_input_nodes if n.name in stages]
        stages[node.name] = before[origin] if origin in before else max(inputs, default=0)
    return stages


def _attr_tensors(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    return [functools.reduce(getattr, n.target.split("."), gm) for n in gm.graph.nodes if n.op == "get_attr"]


def _refresh_parameters(module: nn.Module) -> None:
    """Gives the module new Parameter objects (same storage): an optimizer built from the module
    before it was wrapped still holds the old ones, which is how that mistake is caught."""
    fresh: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in fresh:
                fresh[id(p)] = nn.Parameter(p.data, requires_grad=p.requires_grad)
                p._smp_replaced = True
            m._parameters[name] = fresh[id(p)]


def _half_dtype(config) -> torch.dtype | None:
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None


def _cast_floating(tree, dtype: torch.dtype):
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return torch.utils._pytree.tree_map(cast, tree)


def _training_flags(module: nn.Module) -> tuple[bool, ...]:
    return tuple(m.training for m in module.modules())


@contextlib.contextmanager
def _opposite_mode(module: nn.Module):
    """Every module in the opposite of the root's train/eval mode; yields those flags, then restores."""
    before = [(m, m.training) for m in module.modules()]
    module.train(not module.training)
    try:
        yield _training_flags(module)
    finally:
        for m, training in before:
            m.training = training


def _input_device(args: tuple, kwargs: dict) -> torch.device:
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
