"""SMP v1 names that real scripts and transformers' Trainer use beyond the documented API.

- `smp.state`: the process's SMP state; scripts and transformers read `smp.state.cfg.<key>`
  (fp16, bf16, prescaled_batch, shard_optimizer_state, sharded_data_parallel_degree, ...),
  and `smp.state.model` / `smp.state.optimizer`.
- `smp.is_tracing()`: True while the DistributedModel captures the model (the first step).
"""

from __future__ import annotations

from smp import model as model_lib
from smp import parallel_state
from smp.config import Config


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


def is_tracing() -> bool:
    """Whether the DistributedModel is capturing the model now (model code runs on fake tensors)."""
    model = model_lib.current()
    return model is not None and model.engine.programs.building
