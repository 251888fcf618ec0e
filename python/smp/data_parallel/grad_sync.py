"""Gradient synchronization after a step's backwards.

Data parallelism: ranks holding the same stage average their gradients, in
buckets that are launched while later microbatches still run backward (a bucket
starts once each of its parameters has accumulated every microbatch's gradient).
Buckets launch strictly in order, so every replica issues the same collectives.

Shared parameters: a parameter replicated on several stages has its gradients
summed over those stages, so every replica applies the same update. Two stages of one rank
("zero_bubble_v") read one tensor: its gradient accumulates once per microbatch per stage there,
and its bucket waits for all of them.

Mixed precision (fp32_accumulate): each microbatch's low-precision gradient is added
into an fp32 buffer (smp.params.grad32) as soon as autograd produces it, and the
buckets average those fp32 buffers; `param.grad` then gets the result in the
parameter's dtype, for code that reads it.

Flat gradients (use_flat_grads, from smp.optim.flat_state in fp32): parameters whose grads
are views of one flat buffer are bucketed by ranges of that buffer, which are averaged
in place: no bucket is allocated, and nothing is copied in or out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist

from smp import faults
from smp import params as param_facts
from smp.services import timeline


@dataclasses.dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    # With flat gradients: the range of the flat buffer holding the params' grads (all-reduced in
    # place), and each param's view of it.
    flat: torch.Tensor | None = None
    views: list[torch.Tensor] | None = None


class GradSync:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        dp_group: dist.ProcessGroup | None,
        shared: list[tuple[str, torch.nn.Parameter, dist.ProcessGroup]],
        bucket_cap_mb: float = 25,
        fp32_accumulate: bool = False,
        stage_reads: Mapping[int, int] | None = None,
    ):
        self._all_params = params
        # id(param) -> how many of this rank's stages read it, where more than one: the gradient
        # accumulations per microbatch its bucket waits for.
        self._stage_reads = dict(stage_reads or {})
        self._params = [p for p in params if p.requires_grad]
        self._fp32 = fp32_accumulate
        self._dp_group = dp_group
        self._dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self._shared = shared
        self._cap_bytes = int(bucket_cap_mb * 2**20)
        self._flat_grads: list[tuple[torch.Tensor, list[torch.nn.Parameter], list[int]]] = []
        self._rebucket()
        self._hooks = self._hook_params()
        self._expected = 0
        self._sync = True
        self._counts: dict[int, int] = {}  # id(param) -> gradients accumulated, for bucketed ones
        self._pending: list[int] = []
        self._launched: list[tuple[_Bucket, torch.Tensor, dist.Work]] = []
        recorder = timeline.recorder()
        self._timed = timeline.Pending(recorder) if recorder is not None else None  # buckets in flight

    def follow_requires_grad(self, params: list[torch.nn.Parameter]) -> None:
        """Averages those of `params` (the model's parameters now, added ones included) that
        require grad now (between steps: nothing is in flight)."""
        for hook in self._hooks:
            hook.remove()
        self._all_params = params
        self._params = [p for p in params if p.requires_grad]
        self._hooks = self._hook_params()
        self._buckets_stale = True

    def use_flat_grads(
        self, grads: torch.Tensor, params: list[torch.nn.Parameter], offsets: list[int]
    ) -> None:
        """From the next step on, averages these parameters' gradients in place in `grads`, where
        each one's grad is the view at its offset (or is copied there first, if it was replaced).
        If this GradSync does not average every one of them, they stay in the copying buckets."""
        if all(id(p) in self._bucket_of for p in params):
            self._flat_grads.append((grads, params, offsets))
            self._buckets_stale = True

    def start_step(self, expected_backwards: int, new_window: bool = True, sync: bool = True) -> None:
        """Gradient accumulation over several steps (backward_passes_per_step): a step that does not
        start a window keeps adding to the gradients so far; only a `sync` step (the window's last)
        averages them, so tied parameters' sums and replicas' averages count each pass once."""
        if self._buckets_stale:  # between steps: no bucket is in flight
            self._rebucket()
        self._expected = expected_backwards
        self._sync = sync
        if self._fp32 and new_window:
            for p in self._params:
                param_facts.set_grad32(p, None)
        self._counts = {}
        self._pending = [0] * len(self._buckets)
        self._launched = []

    def finish_step(self, backward_ran: bool) -> None:
        """The step's end: waits for the buckets and sums shared parameters' gradients, if a
        backward ran (every rank runs model.backward in a training step) and the step syncs."""
        if not backward_ran or not self._sync:
            return  # a forward-only step, or one that only accumulates
        while len(self._launched) < len(self._buckets):
            self._launch(len(self._launched))
        if self._timed is not None:
            self._timed.poll()
        for i, (bucket, flat, work) in enumerate(self._launched):
            with faults.waiting(self._bucket_op(i), faults.group_of("data-parallel", self._dp_group)):
                work.wait()
            flat.div_(self._dp_size)
            if bucket.flat is not None:
                continue  # averaged in place
            offset = 0
            for p in bucket.params:
                n = p.numel()
                self._set_grad(p, flat[offset : offset + n].view_as(p))
                offset += n
        self._launched = []
        if self._timed is not None:
            self._timed.close()
        if self._fp32:
            for p in self._params:
                main = param_facts.grad32(p)
                if main is not None and not self._bucket_of:
                    p.grad = main.to(p.dtype)
        for name, p, group in self._shared:
            grad = self._grad(p)
            with faults.waiting(
                f"summing the gradient of {name!r}", faults.group_of("shared-parameter", group)
            ):
                dist.all_reduce(grad, group=group)
            self._set_grad(p, grad)

    def _set_grad(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        if self._fp32:
            param_facts.set_grad32(p, grad.clone())
            p.grad = grad.to(p.dtype)
        elif p.grad is None:
            p.grad = grad.clone()
        else:
            p.grad.copy_(grad)

    def _hook_params(self) -> list:
        """A hook on each parameter's gradient accumulation, where there is something to do as each
        arrives: averaging over replicas (buckets), fp32 accumulation. With neither (one replica in
        fp32) a Python call per parameter per microbatch is pure cost; a shared parameter's copies
        are summed at the step's end either way, from what their grads hold then."""
        if self._dp_size == 1 and not self._fp32:
            return []
        return [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self._fp32:
            main = param_facts.grad32(p)
            param_facts.set_grad32(p, p.grad.float() if main is None else main.add_(p.grad))
            p.grad = None
        key = id(p)
        if not self._sync or key not in self._bucket_of:
            return  # nothing to launch for it (one replica, or a step that only accumulates)
        self._counts[key] = self._counts.get(key, 0) + 1
        if self._counts[key] != self._expected * self._stage_reads.get(key, 1):
            return
        index = self._bucket_of[key]
        self._pending[index] += 1
        # Launch every complete bucket whose predecessors have launched.
        while len(self._launched) < len(self._buckets):
            nxt = len(self._launched)
            if self._pending[nxt] < len(self._buckets[nxt].params):
                break
            self._launch(nxt)

    def _launch(self, index: int) -> None:
        bucket = self._buckets[index]
        if bucket.flat is None:
            flat = torch.cat([self._grad(p).reshape(-1) for p in bucket.params])
        else:
            for p, view in zip(bucket.params, bucket.views, strict=True):
                attach_grad(p, view)
            flat = bucket.flat
        timed = self._timed is not None and self._timed.recording  # off: one test
        launched = timeline.now() if timed else 0
        with faults.waiting(self._bucket_op(index), faults.group_of("data-parallel", self._dp_group)):
            work = dist.all_reduce(flat, group=self._dp_group, async_op=True)
        self._launched.append((bucket, flat, work))
        if timed:
            self._timed.poll()
            nbytes = flat.numel() * flat.element_size()
            self._timed.add(work, "bucket", launched, bucket=index, params=len(bucket.params), bytes=nbytes)

    def _bucket_op(self, index: int) -> str:
        return f"gradient all-reduce of bucket {index + 1} of {len(self._buckets)}"

    def _grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        grad = param_facts.grad32(p) if self._fp32 else p.grad
        if grad is None:
            return torch.zeros_like(p, dtype=torch.float32 if self._fp32 else p.dtype)
        return grad

    def _rebucket(self) -> None:
        """Buckets in launch order: the flat gradients' ranges, last parameters first (the backward
        produces their gradients first), then the other parameters' buckets."""
        self._buckets_stale = False
        if self._dp_size == 1:
            self._buckets, self._bucket_of = [], {}
            return
        buckets = []
        for grads, params, offsets in reversed(self._flat_grads):
            offset_of = {id(p): off for p, off in zip(params, offsets, strict=True)}
            for group in _buckets(params[::-1], self._cap_bytes):
                lo, hi = offset_of[id(group[-1])], offset_of[id(group[0])] + group[0].numel()
                views = [grads[offset_of[id(p)] : offset_of[id(p)] + p.numel()].view_as(p) for p in group]
                buckets.append(_Bucket(group, grads[lo:hi], views))
        in_flat = {id(p) for b in buckets for p in b.params}
        rest = [p for p in self._params[::-1] if id(p) not in in_flat]
        buckets += [_Bucket(group) for group in _buckets(rest, self._cap_bytes)]
        self._buckets = buckets
        self._bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b.params}


def attach_grad(p: torch.nn.Parameter, view: torch.Tensor) -> None:
    """Makes `view` p's grad, holding p's current gradient (zero if none): autograd then
    accumulates into it in place."""
    if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
        return
    if p.grad is None:
        view.zero_()
    else:
        view.copy_(p.grad)
    p.grad = view


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
