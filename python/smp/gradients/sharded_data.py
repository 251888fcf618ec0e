"""Sharded data parallelism's gradients (FSDP2): each parameter is a DTensor shard of fp32 master
weights whose gradient FSDP2 reduce-scattered; the optimizer steps the shards. SMP v1's
sdp_gradient_clipping clips them before every step (the norm is kept: DeepSpeed's
`_global_grad_norm`), and DeepSpeed's optimizer names answer (smp.sharded_data.deepspeed_names)."""

from __future__ import annotations

import torch

from smp.gradients.state import GradientState
from smp.optim import grad_norm
from smp.sharded_data import ShardedModel, deepspeed_names
from smp.sharded_data import tensors as sharded_tensors


class ShardedDataGradients(GradientState):
    def __init__(self, *args, model: ShardedModel, **kwargs):
        super().__init__(*args, **kwargs)
        self.model = model

    def _applied_grads(self) -> list[torch.Tensor]:
        return [sharded_tensors.local(p.grad) for p in self.params() if p.grad is not None]

    def clip(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        grad_norm.check_norm_type(norm_type, "clip_master_grads")
        return self.model.clip_grad_norm(max_norm, norm_type)

    def _before_step(self) -> None:
        self.model.clip_before_step()

    def attribute(self, name: str):
        if name not in deepspeed_names.OPTIMIZER_NAMES:
            raise AttributeError(name)
        return deepspeed_names.optimizer_attribute(name, self.optimizer, self.model)
