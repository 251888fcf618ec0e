"""smp.DistributedModel: SMP v1's call surface over an unmodified nn.Module.

The work happens in the model's engine (smp.engine.Engine): parallelizing the module at
the first step, running each microbatch's forward and backward, averaging gradients.
This class keeps SMP's names and guards, and delegates.
"""

from __future__ import annotations

import torch
from torch import nn

from smp import hf, inert, parallel_state, recompute
from smp.engine import Engine
from smp.services import microbatch
from smp.state import model_state, snapshot


class DistributedModel(nn.Module):
    """SMP v1's DistributedModel (one per process).

    Effective arguments: trace_execution_times (partition by measured op times instead
    of FLOPs), average_grads_across_microbatches, bucket_cap_mb (data-parallel
    buckets), broadcast_buffers (replicas take the first replica's buffers every step).
    Accepted for SMP scripts, without effect (smp.inert.MODEL_ARGUMENTS: a value other than SMP's
    default warns once, saying why): trace_device (the capture runs on fake tensors where the
    first microbatch's tensors are), trace_memory_usage, overlapping_allreduce (buckets
    always start during backward), find_unused_parameters (unused parameters are always
    handled), gradient_as_bucket_view. backward_passes_per_step=N accumulates gradients over N
    steps (transformers passes its gradient_accumulation_steps): the steps between two optimizer
    steps add to the gradients without averaging them across ranks, and the N-th averages the sum
    (call optimizer.step() and zero_grad() every N steps; scale the loss by 1/N as for any
    accumulation).

    `model.get_module()` is the wrapped module. `model.module` nests as SMP v1's did, whose
    `.module` was its data-parallel wrapper (with fp16, the fp16 wrapper around that): scripts
    reach the module as `model.module.module` (fp16: `model.module.module.module`). The wrappers
    (`Nesting`) hold the module without copying anything; their `named_parameters()` carry
    SMP's `module.` prefix, and calling one calls the DistributedModel.
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
        st = parallel_state.state()
        if st.model is not None:
            raise RuntimeError(
                "smp: a DistributedModel already exists in this process; SMP allows one per script: "
                "wrap the whole model once (put several networks in one nn.Module)"
            )
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
            raise ValueError(
                f"smp.DistributedModel: backward_passes_per_step must be a positive integer, got "
                f"{backward_passes_per_step!r}"
            )
        if backward_passes_per_step < 1:
            raise ValueError(
                f"smp.DistributedModel: backward_passes_per_step={backward_passes_per_step} must be >= 1 "
                "(the number of steps whose gradients one optimizer step applies)"
            )
        inert.warn_model_arguments(
            {
                "trace_device": trace_device,
                "trace_memory_usage": trace_memory_usage,
                "overlapping_allreduce": overlapping_allreduce,
                "find_unused_parameters": find_unused_parameters,
                "gradient_as_bucket_view": gradient_as_bucket_view,
            }
        )
        super().__init__()
        self._modules["module"] = module  # its names in this one's: "module.<name>" (the property below)
        self.engine = Engine(
            module,
            st.config,
            parallel_state.parallel_groups(),
            trace_execution_times=trace_execution_times,
            average_grads_across_microbatches=average_grads_across_microbatches,
            bucket_cap_mb=bucket_cap_mb,
            broadcast_buffers=broadcast_buffers,
            backward_passes_per_step=backward_passes_per_step,
        )
        st.model = self

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
        return self.engine.forward(mb, args, kwargs)

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
        self.engine.backward(mb, tensors, list(grad_tensors))

    # --- partitioning --------------------------------------------------------

    @property
    def partitioned(self) -> bool:
        return self.engine.partitioned

    @property
    def partition_plan(self):
        plan = self.engine.plan
        return plan.partition if plan is not None else None

    def partition_report(self) -> str:
        if self.partition_plan is None:
            return "smp partition: not partitioned (pipeline_parallel_degree == 1 or no step has run yet)"
        return self.partition_plan.report()

    def register_post_partition_hook(self, hook) -> None:
        """hook(model, optimizer) runs once the model is partitioned (at once if it already is);
        optimizer is the DistributedOptimizer over this model, or None."""
        self.engine.register_post_partition_hook(lambda optimizer: hook(self, optimizer))

    def register_post_step_hook(self, hook) -> None:
        """hook(model, optimizer) runs once, after the next @smp.step call has finished (its
        gradients averaged), before the script's optimizer.step(). transformers loads its
        optimizer state this way when resuming."""
        self.engine.register_post_step_hook(lambda optimizer: hook(self, optimizer))

    def get_module(self) -> nn.Module:
        """The wrapped module (after partitioning, holding this rank's part)."""
        return self._modules["module"]

    @property
    def module(self) -> nn.Module:
        """SMP v1's `.module`: its data-parallel wrapper around the module (and with fp16 its fp16
        wrapper around that), whose `.module` is the next level (see the class doc)."""
        if "_nesting" not in self.__dict__:  # (made once; not a submodule)
            nested = Nesting(self.get_module(), self)
            self.__dict__["_nesting"] = Nesting(nested, self) if self.engine.config.fp16 else nested
        return self.__dict__["_nesting"]

    # --- this rank's part ----------------------------------------------------

    def local_parameters(self):
        return self.get_module().parameters()

    def local_named_parameters(self):
        return self.get_module().named_parameters()

    def local_buffers(self):
        return self.get_module().buffers()

    def local_named_buffers(self):
        return self.get_module().named_buffers()

    def local_modules(self):
        """Modules holding a parameter or buffer on this rank."""
        return [m for _, m in self.local_named_modules()]

    def local_named_modules(self):
        """(name, module) of the modules holding a parameter or buffer on this rank."""
        return [
            (name, m)
            for name, m in self.get_module().named_modules()
            if next(m.parameters(recurse=False), None) is not None
            or next(m.buffers(recurse=False), None) is not None
        ]

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's part, marked partial (in the dict's torch metadata, which torch.save keeps), so
        that load_state_dict called before the first step knows to wait for partitioning."""
        state = self.get_module().state_dict()
        state._metadata.setdefault("", {})[_PARTIAL] = True
        return state

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The full model's state_dict (original keys, full shapes). With pipeline stages or
        tensor-parallel layers it is a collective over the pipeline and tensor-parallel groups:
        call it on every rank (or on every rank with rdp_rank() == 0). Under sharded data parallelism
        it gathers the shards over the sdp group: call it on every rank."""
        if self.engine.holds_whole_state:
            return self.get_module().state_dict(*args, **kwargs)
        return self.engine.state.full()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a full (unsharded) state_dict: each rank takes the entries of its stage, cut to its
        tensor-parallel shard. A partial one (from local_state_dict(), or marked `_smp_is_partial:
        True` as SMP did) is this rank's part. Either is applied once the model is partitioned (as
        in SMP: a model built under delayed initialization has nothing to load into before); a
        full one's keys are checked at once."""
        snapshot.wait()  # a background save may still be copying the parameters
        state_dict, partial = _split_partial_mark(state_dict)
        if partial:
            if self.engine.captures and not self.partitioned:
                self.engine.register_post_partition_hook(
                    lambda optimizer: self.get_module().load_state_dict(
                        state_dict, strict=strict, assign=assign
                    )
                )
                return None
            return self.get_module().load_state_dict(state_dict, strict=strict, assign=assign)
        if self.engine.captures and not self.partitioned:
            model_state.check_keys(state_dict, self.engine.state_keys, strict)
            self.engine.register_post_partition_hook(
                lambda optimizer: self.engine.state.load(state_dict, strict)
            )
            return None
        if self.engine.holds_whole_state:
            return self.get_module().load_state_dict(state_dict, strict=strict, assign=assign)
        self.engine.state.load(state_dict, strict)
        return None

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        """For a Hugging Face transformers model: writes the full, unsharded weights (safetensors)
        and the model's config to `save_directory`, so `AutoModel.from_pretrained(save_directory)`
        loads it in a plain process without smp. A collective: call it on every rank; global rank
        0 writes. Keyword arguments go to transformers' `save_pretrained`."""
        if not callable(getattr(self.get_module(), "save_pretrained", None)):
            raise TypeError(
                f"smp: save_pretrained needs a Hugging Face transformers PreTrainedModel; the wrapped "
                f"module is a {type(self.get_module()).__name__}. Save its full weights with "
                "smp.save(model.state_dict(), f, partial=False) instead"
            )
        full = self.state_dict()  # a collective over the stages and shards
        if parallel_state.rank() == 0:
            hf.save_pretrained(self.get_module(), full, save_directory, **kwargs)
        torch.distributed.barrier()

    def _local_part(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return self.engine.state.local_part(param, full)

    # --- gradient norm ------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips all gradients by their global L2 norm over every stage and tensor-parallel shard
        (a replicated parameter counts once); returns the norm. A collective on every rank. With a
        DistributedOptimizer it clips the gradients that optimizer is about to apply."""
        return self.engine.clip_grad_norm(max_norm, norm_type)

    # --- tensor parallelism (SMP v1 names) -----------------------------------------------------

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        """Whether `param` is this rank's shard of a tensor-parallel parameter."""
        return id(param) in self.engine.shard_specs

    def is_distributed_buffer(self, buffer: torch.Tensor) -> bool:
        return False  # buffers stay replicated

    def is_scaled_batch_parameter(self, param: torch.Tensor) -> bool:
        return self.is_distributed_parameter(param)

    def distributed_modules(self) -> list[nn.Module]:
        """Modules whose parameters are sharded over the tensor-parallel group."""
        owners = {
            path.rsplit(".", 1)[0] if "." in path else ""
            for path, p in self.get_module().named_parameters(remove_duplicate=False)
            if self.is_distributed_parameter(p)
        }
        return [self.get_module().get_submodule(path) for path in sorted(owners)]

    def tensor_parallel_report(self):
        """How much of the modules marked for tensor parallelism was sharded: bytes of matrix
        parameters sharded and replicated, and the largest replicated ones with the reason each
        stayed whole (print it). None before the first step or without tensor parallelism."""
        plan = self.engine.plan
        return plan.tp_coverage if plan is not None else None

    def default_reducer_named_parameters(self):
        """Parameters whose gradients are averaged over the data-parallel group."""
        return [
            (n, p) for n, p in self.get_module().named_parameters() if not self.is_distributed_parameter(p)
        ]

    def scaled_batch_reducer_named_parameters(self):
        """Tensor-parallel shards: gradients averaged over the reduced-data-parallel group."""
        return [(n, p) for n, p in self.get_module().named_parameters() if self.is_distributed_parameter(p)]

    # --- saved activations ---------------------------------------------------------------------

    def track_saved_activations(self, enabled: bool = True) -> None:
        """Counts bytes saved for backward by this rank's stage (see saved_activation_bytes)."""
        self.engine.programs.track_saved_activations(enabled)

    def saved_activation_bytes(self) -> dict[str, int]:
        return self.engine.programs.saved_activation_bytes()


_PARTIAL = "smp_partial"  # metadata mark of a local_state_dict()
_SMP_PARTIAL_KEY = "_smp_is_partial"  # SMP v1's key (transformers sets it to False on full dicts)


def _split_partial_mark(state_dict):
    """(the state without SMP's marker key, whether it is one rank's part)."""
    partial = bool(getattr(state_dict, "_metadata", {}).get("", {}).get(_PARTIAL, False))
    if _SMP_PARTIAL_KEY in state_dict:
        state_dict = state_dict.copy()  # (an OrderedDict's copy keeps _metadata)
        partial = bool(state_dict.pop(_SMP_PARTIAL_KEY))
    return state_dict, partial


def set_activation_checkpointing(
    module: nn.Module,
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
    strategy: str = "each",
) -> None:
    """SMP v1's activation checkpointing: `module`'s forward keeps only its inputs and is recomputed
    in backward. Call it after smp.DistributedModel(...) and before the first step, on modules of
    the wrapped model (`model.get_module().layers`).

    On an nn.Sequential or nn.ModuleList, `strategy` groups its layers: "each" (a region per
    layer), "group_N" (N consecutive layers per region) or "contiguous" (each pipeline stage's run
    of layers as one region). A region never crosses a pipeline stage: it is split at the boundary
    (`debug` says so). `preserve_rng_state` makes dropout draw the same mask in the recompute.
    `pack_args_as_tuple` is accepted for SMP scripts: smp recomputes the captured graph's ops, so how
    the module's arguments are packed does not matter.
    """
    model = current()
    if model is None:
        raise ValueError(
            "smp.set_activation_checkpointing: no smp.DistributedModel exists yet; call smp.init(...), "
            "wrap the model with smp.DistributedModel(model), then checkpoint modules of "
            "model.get_module()"
        )
    req = recompute.request(model.get_module(), module, preserve_rng_state, pack_args_as_tuple, strategy)
    model.engine.set_activation_checkpointing(req)


class Nesting(nn.Module):
    """One level of SMP v1's nesting of a DistributedModel's `.module` (its data-parallel and fp16
    wrappers): `.module` is the level below, calling it calls the DistributedModel."""

    def __init__(self, inner: nn.Module, owner: DistributedModel):
        super().__init__()
        self.module = inner
        object.__setattr__(self, "_owner", owner)  # (not a submodule: no cycle in the tree)

    def forward(self, *args, **kwargs):
        return self._owner(*args, **kwargs)


def current() -> DistributedModel | None:
    """The process's DistributedModel, if smp is initialized and one was made."""
    return parallel_state.state().model if parallel_state.is_initialized() else None
