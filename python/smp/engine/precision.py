"""The model's parameters and buffers in the precision the config asks for, before anything else."""

from __future__ import annotations

import torch
from torch import nn

from smp.config import Config


def model_dtype(config: Config) -> torch.dtype | None:
    """The half precision the model trains in (bf16 or fp16), or None for fp32."""
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None


def cast_model(module: nn.Module, config: Config, captures: bool) -> None:
    """Without sharded data parallelism: half-precision parameters and activations, fp32 masters in
    the optimizer. With it: FSDP2 gathers half copies of fp32 shards, the masters, so the parameters
    stay (or become, for a model built in half precision, as SMP's scripts do) fp32; a captured
    model's floating buffers are cast, since its graphs are captured in half precision."""
    dtype = model_dtype(config)
    if dtype is None:
        return
    if config.sharded_data_parallel_degree <= 1:
        module.to(dtype)
        return
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
    if captures:
        for owner in module.modules():
            for name, t in owner._buffers.items():
                if t is not None and t.is_floating_point():
                    owner._buffers[name] = t.to(dtype)
