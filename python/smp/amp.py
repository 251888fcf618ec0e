"""smp.amp.GradScaler: torch's GradScaler for training with @smp.step.

Use it as with torch: `model.backward(scaler.scale(loss))` inside the step,
`scaler.step(optimizer)` and `scaler.update()` after it. The difference is that an
inf or nan found on any rank (another stage, another shard) counts on every rank, so
all of them skip the same steps and keep the same scale.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GradScaler(torch.amp.GradScaler):
    def __init__(self, device: str | None = None, **kwargs):
        super().__init__(device or ("cuda" if torch.cuda.is_available() else "cpu"), **kwargs)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # One flag per rank, whatever devices its gradients were on.
            flag = torch.stack([t.float().max() for t in per_device.values()]).max() if per_device else None
            flag = torch.zeros((), device=found_inf.device) if flag is None else flag
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            for t in per_device.values():
                t.fill_(flag.item())
            if not per_device:
                found_inf.fill_(flag.item())
                per_device[found_inf.device] = found_inf
        return per_device
