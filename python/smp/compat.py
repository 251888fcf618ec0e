"""SMP v1 names that real scripts and transformers' Trainer use beyond the documented API.

- `smp.state`: the process's SMP state; scripts and transformers read `smp.state.cfg.<key>`
  (fp16, bf16, prescaled_batch, shard_optimizer_state, sharded_data_parallel_degree, ...),
  and `smp.state.model` / `smp.state.optimizer`.
- `smp.model_creation(tensor_parallelism=False, dtype=None, **tp_config)`: the context the
  notebooks build their model in: tensor-parallel marks, delayed initialization when the
  config asks for it, and the parameters' dtype.
- `smp.is_tracing()`: True while the DistributedModel captures the model (the first step).
"""

from __future__ import annotations

import contextlib

import torch

from smp import model as model_lib
from smp import parallel_state
from smp.config import Config
from smp.engine.delayed_init import delay_param_initialization
from smp.tensor_parallel.marks import tensor_parallelism


class State:
    """`smp.state`: read-only views of smp's process state, under SMP v1's names."""

    @property
    def initialized(self) -> bool:
        return parallel_state.is_initialized()

    @property
    def cfg(self) -> Config:
        """The validated config (every SMP v1 key as an attribute, e.g. `smp.state.cfg.fp16`)."""
        return parallel_state.state().config

    @property
    def model(self):
        """The DistributedModel, or None before one is made."""
        return model_lib.current()

    @property
    def optimizer(self):
        """The DistributedOptimizer over the model, or None."""
        model = model_lib.current()
        return model.engine.optimizer if model is not None else None

    def __repr__(self) -> str:
        return f"smp.state(initialized={self.initialized})"


state = State()


@contextlib.contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None, **tp_config):
    """Build the model inside this block (SMP v1's `smp.model_creation`).

    tensor_parallelism: modules built here may be sharded (as `smp.tensor_parallelism()`);
    SMP's tp_config keywords (fused kernels, attention options for its own transformer
    classes) are accepted and have no effect, as with `smp.tensor_parallelism`. With the
    config's `delayed_parameter_initialization`, parameters are created on the meta device
    (as `smp.delay_param_initialization()`). dtype: floating-point tensors created inside get
    this dtype; smp then trains in the config's fp16/bf16 choice whatever the dtype was.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"smp.model_creation: dtype must be a floating-point torch.dtype, got {dtype!r}")
    delayed = parallel_state.state().config.delayed_parameter_initialization
    previous = torch.get_default_dtype()
    with _tensor_parallelism(tensor_parallelism, tp_config), delay_param_initialization(delayed):
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


def _tensor_parallelism(enabled: bool, tp_config: dict):
    return tensor_parallelism(**tp_config) if enabled else contextlib.nullcontext()


def is_tracing() -> bool:
    """Whether the DistributedModel is capturing the model now (model code runs on fake tensors)."""
    model = model_lib.current()
    return model is not None and model.engine.programs.building
