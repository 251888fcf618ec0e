"""Gradient synchronization after a step's backwards.

Data parallelism: ranks holding the same stage average their gradients, in
buckets that are launched while later microbatches still run backward (a bucket
starts once each of its parameters has accumulated every microbatch's gradient).
Buckets launch strictly in order, so every replica issues the same collectives.

Shared parameters: a parameter replicated on several stages has its gradients
summed over those stages, so every replica applies the same update.

Mixed precision (fp32_accumulate): each microbatch's low-precision gradient is added
into an fp32 buffer (`param._smp_grad32`) as soon as autograd produces it, and the
buckets average those fp32 buffers; `param.grad` then gets the result in the
parameter's dtype, for code that reads it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GradSync:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        dp_group: dist.ProcessGroup | None,
        shared: list[tuple[str, torch.nn.Parameter, dist.ProcessGroup]],
        bucket_cap_mb: float = 25,
        fp32_accumulate: bool = False,
    ):
        self._params = [p for p in params if p.requires_grad]
        self._fp32 = fp32_accumulate
        self._dp_group = dp_group
        self._dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self._shared = shared
        self._buckets = _buckets(self._params[::-1], int(bucket_cap_mb * 2**20)) if self._dp_size > 1 else []
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]
        self._expected = 0
        self._counts: dict[int, int] = {}
        self._pending: list[int] = []
        self._launched: list[tuple[list[torch.nn.Parameter], torch.Tensor, dist.Work]] = []

    def start_step(self, expected_backwards: int) -> None:
        self._expected = expected_backwards
        if self._fp32:
            for p in self._params:
                p._smp_grad32 = None
        self._counts = {}
        self._pending = [0] * len(self._buckets)
        self._launched = []

    def finish_step(self) -> None:
        if not self._counts:
            return  # no gradient was accumulated: a forward-only step
        while len(self._launched) < len(self._buckets):
            self._launch(len(self._launched))
        for bucket, flat, work in self._launched:
            work.wait()
            flat.div_(self._dp_size)
            offset = 0
            for p in bucket:
                n = p.numel()
                self._set_grad(p, flat[offset : offset + n].view_as(p))
                offset += n
        self._launched = []
        if self._fp32:
            for p in self._params:
                if p._smp_grad32 is not None and not self._bucket_of:
                    p.grad = p._smp_grad32.to(p.dtype)
        for _, p, group in self._shared:
            grad = self._grad(p)
            dist.all_reduce(grad, group=group)
            self._set_grad(p, grad)

    def _set_grad(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        if self._fp32:
            p._smp_grad32 = grad.clone()
            p.grad = grad.to(p.dtype)
        elif p.grad is None:
            p.grad = grad.clone()
        else:
            p.grad.copy_(grad)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self._fp32:
            main = getattr(p, "_smp_grad32", None)
            p._smp_grad32 = p.grad.float() if main is None else main.add_(p.grad)
            p.grad = None
        key = id(p)
        self._counts[key] = self._counts.get(key, 0) + 1
        if self._counts[key] != self._expected or key not in self._bucket_of:
            return
        index = self._bucket_of[key]
        self._pending[index] += 1
        # Launch every complete bucket whose predecessors have launched.
        while len(self._launched) < len(self._buckets):
            nxt = len(self._launched)
            if self._pending[nxt] < len(self._buckets[nxt]):
                break
            self._launch(nxt)

    def _launch(self, index: int) -> None:
        bucket = self._buckets[index]
        flat = torch.cat([self._grad(p).reshape(-1) for p in bucket])
        work = dist.all_reduce(flat, group=self._dp_group, async_op=True)
        self._launched.append((bucket, flat, work))

    def _grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        grad = getattr(p, "_smp_grad32", None) if self._fp32 else p.grad
        if grad is None:
            return torch.zeros_like(p, dtype=torch.float32 if self._fp32 else p.dtype)
        return grad


def _buckets(params: list[torch.nn.Parameter], cap_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype and device, about cap_bytes each."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if (
            not buckets
            or size + nbytes > cap_bytes
            or (buckets[-1][0].dtype, buckets[-1][0].device) != (p.dtype, p.device)
        ):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets
