"""Gradient synchronization after a step's backwards.

Data parallelism: ranks holding the same stage average their gradients, in
buckets that are launched while later microbatches still run backward (a bucket
starts once each of its parameters has accumulated every microbatch's gradient).
Buckets launch strictly in order, so every replica issues the same collectives.

Shared parameters: a parameter replicated on several stages has its gradients
summed over those stages, so every replica applies the same update. Two stages of one rank
("zero_bubble_v") read one tensor: its gradient accumulates once per microbatch per stage there,
and its bucket waits for all of them.

Gradient buffers (issue 33): where there is something to do per gradient (replicas to average, or
low-precision parameters to accumulate in fp32), every trained parameter's gradient lives in a
flat buffer: an optimizer's (smp.optim.flat_state, laid out as its chunks need, handed over with
`use_flat_grads`), else one of this GradSync's own. A parameter in the buffer's dtype has its
`.grad` a view of it, into which autograd accumulates in place; a bf16/fp16 parameter's gradient
is added into its fp32 view as each microbatch produces it and then freed, so no low-precision
gradient is kept (its fp32 gradient is `smp.params.applied_grad(param)`; `.grad` stays None). The
buckets are ranges of those buffers, averaged in place: no bucket is allocated, and nothing is
copied in or out (DDP's `gradient_as_bucket_view`, Megatron's main-gradient buffer).

Expert parallelism: an expert's gradient already holds every ep rank's tokens' part (through the
token exchange), so expert buckets are summed over the replicas holding the same experts
(`expert_group`) and divided by the whole data-parallel degree: one process's global-batch gradient.

Sharded gradients (ZeRO-2, `use_sharded_grads`): with the optimizer state sharded, a bucket's
fp32 storage is allocated at its first gradient, averaged as soon as it is complete, and freed
once this rank's chunk of it is copied into the optimizer's chunk gradient; at most
`IN_FLIGHT` buckets are being averaged at once. With one microbatch, buckets complete one after
another during the backward, so the whole fp32 gradient never exists at once: a rank holds its
chunk (4/R bytes per parameter) and a few buckets. Every gradient is added in and freed, in fp32
too (`.grad` stays None).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist

from smp import faults
from smp import params as param_facts
from smp.data_parallel.buffers import (
    IN_FLIGHT,
    Bucket,
    Buffer,
    Shard,
    attach_grad,
    own_buffers,
    split_into_buckets,
    worth_sharding,
)
from smp.services import timeline


class GradSync:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        dp_group: dist.ProcessGroup | None,
        shared: list[tuple[str, torch.nn.Parameter, dist.ProcessGroup]],
        bucket_cap_mb: float = 25,
        fp32_accumulate: bool = False,
        stage_reads: Mapping[int, int] | None = None,
        expert_ids: frozenset[int] = frozenset(),
        expert_group: dist.ProcessGroup | None = None,
    ):
        self._all_params = params
        self._expert_ids = expert_ids
        self._expert_group = expert_group
        # id(param) -> how many of this rank's stages read it, where more than one: the gradient
        # accumulations per microbatch its bucket waits for.
        self._stage_reads = dict(stage_reads or {})
        self._params = [p for p in params if p.requires_grad]
        self._fp32 = fp32_accumulate
        self._dp_group = dp_group
        self._dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self._shared = shared
        self._cap_bytes = int(bucket_cap_mb * 2**20)
        # Gradient buffers only where a hook has work per gradient: with one replica in fp32 a
        # Python call per parameter per microbatch is pure cost, and plain .grad does.
        self._buffered = self._dp_size > 1 or self._fp32
        self._given: list[Buffer] = []  # optimizers' buffers (use_flat_grads)
        self._shards: list[Shard] = []  # optimizers' sharded groups (use_sharded_grads)
        self._sharded_ids: set[int] = set()
        self._retired = 0  # sharded buckets averaged and freed this step
        self._published = False  # low-precision .grads set by finish_step(publish=True)
        self._buffers: list[Buffer] = []  # every buffer in use: the given ones, then own ones
        self._buckets: list[Bucket] = []
        self._bucket_of: dict[int, int] = {}
        self._view: dict[int, torch.Tensor] = {}  # id(param) -> its gradient's view of a buffer
        self._low_ids: set[int] = set()  # parameters accumulated into fp32 views
        self._rebucket()
        self._hooks = self._hook_params()
        self._expected = 0
        self._sync = True
        self._counts: dict[int, int] = {}  # id(param) -> gradients accumulated, for bucketed ones
        self._pending: list[int] = []
        self._launched: list[tuple[Bucket, dist.Work | None]] = []
        recorder = timeline.recorder()
        self._timed = timeline.Pending(recorder) if recorder is not None else None  # buckets in flight

    @property
    def idle(self) -> bool:
        """Whether a step has nothing to synchronize (one replica in fp32, no parameter shared
        between stages): its start_step and finish_step would do nothing."""
        return not self._buffered and not self._shared

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
        """From now on keeps these parameters' gradients in `grads` (a parameter in its
        dtype has its grad the view at its offset; a bf16/fp16 one accumulates into that view),
        averaged there in place. Their gradients so far are copied in now. Called between steps, or
        before a step's first backward."""
        if not self._buffered:
            return  # one replica in fp32: the optimizer attaches its views itself
        buffer = Buffer(grads, list(params), list(offsets))
        if buffer.low:
            with torch.no_grad():
                for p, view in buffer.views():
                    old = self._view.get(id(p))
                    if old is not None and old.data_ptr() != view.data_ptr():
                        view.copy_(old)
                    self._view[id(p)] = view
                    param_facts.set_grad32(p, view)
        self._given.append(buffer)
        # Now, not at the next step's start: the own buffers replaced are let go before that step
        # begins, and when this comes at partitioning (an optimizer's state loaded in a
        # post-partition hook, before the step's first backward) the step averages the new buffers.
        # Either way no gradient is in flight: it is between steps, or before a backward.
        self._rebucket()
        self._attach(new_window=False)  # grads of the step under way point at the new buffers
        self._counts = {}
        self._pending = [0] * len(self._buckets)

    def can_shard(self, expected_backwards: int, windowed: bool) -> bool:
        """Whether `use_sharded_grads` would save memory without costing time (worth_sharding)."""
        return worth_sharding(
            self._dp_size,
            expected_backwards,
            windowed,
            all(p.is_cuda for p in self._params),
            4 * sum(p.numel() for p in self._params),
            self._cap_bytes,
        )

    def can_shard_at_all(self) -> bool:
        """Whether gradients can be kept sharded: there are replicas to average."""
        return self._dp_size > 1

    def use_sharded_grads(
        self, params: list[torch.nn.Parameter], offsets: list[int], lo: int, grad: torch.Tensor
    ) -> None:
        """From now on keeps these parameters' gradients as this rank's chunk [lo, lo +
        grad.numel()) of their layout only, averaged into `grad` bucket by bucket (see the module
        docstring). Called between steps, or before a step's first backward."""
        if not self.can_shard_at_all():
            raise ValueError(
                "smp: sharded gradients (shard_gradients) need replicas to average (a reduced-data-"
                'parallel degree above 1); set "shard_gradients": false or leave it null'
            )
        # A parameter shared with other stages is summed with its copies whole at the step's end:
        # it keeps a whole gradient, and gives the chunk its part after that sum.
        shared = {id(p) for _, p, _ in self._shared}
        shard = Shard(list(params), list(offsets), lo, grad, [p for p in params if id(p) in shared])
        self._shards.append(shard)
        self._sharded_ids |= {id(p) for p in params if id(p) not in shared}
        for p in params:
            if id(p) not in shared:
                param_facts.set_grad32(p, None)
                p.grad = None
        self._rebucket()
        self._attach(new_window=False)  # grads of the step under way point at the new buffers
        self._counts = {}
        self._pending = [0] * len(self._buckets)

    def start_step(self, expected_backwards: int, new_window: bool = True, sync: bool = True) -> None:
        """Gradient accumulation over several steps (backward_passes_per_step): a step that does not
        start a window keeps adding to the gradients so far; only a `sync` step (the window's last)
        averages them, so tied parameters' sums and replicas' averages count each pass once."""
        if self._buckets_stale:  # between steps: no bucket is in flight
            self._rebucket()
        self._expected = expected_backwards
        self._sync = sync
        if self._buffered:
            self._attach(new_window)
        self._counts = {}
        self._pending = [0] * len(self._buckets)
        self._launched = []
        self._retired = 0

    def finish_step(self, backward_ran: bool, publish: bool = False) -> None:
        """The step's end: waits for the buckets and sums shared parameters' gradients, if a
        backward ran (every rank runs model.backward in a training step) and the step syncs.
        `publish` (no smp.DistributedOptimizer reads the fp32 gradients): bf16/fp16 parameters get
        their averaged gradient in their own dtype as `.grad`, for a plain torch optimizer."""
        if not backward_ran or not self._sync:
            return  # a forward-only step, or one that only accumulates
        while len(self._launched) < len(self._buckets):
            self._launch(len(self._launched))
        if self._timed is not None:
            self._timed.poll()
        for i in range(self._retired, len(self._launched)):
            self._retire(i)
        self._launched = []
        if self._timed is not None:
            self._timed.close()
        for name, p, group in self._shared:
            grad = self._grad(p)
            with faults.waiting(
                f"summing the gradient of {name!r}", faults.group_of("shared-parameter", group)
            ):
                dist.all_reduce(grad, group=group)
            if id(p) not in self._view:
                p.grad = grad
        for shard in self._shards:  # after the sums: a bucket's copy of these spots held zeros
            for p in shard.whole:
                shard.take_whole(p, self._grad(p))
        if publish:
            for buffer in self._buffers:
                if buffer.low:
                    for p, view in buffer.views():
                        p.grad = view.to(p.dtype)
                    self._published = True

    def _attach(self, new_window: bool) -> None:
        """Before a step's backward: parameters in their buffer's dtype have their grads the buffer's
        views again (zero_grad(set_to_none=True) drops them), or autograd would allocate new ones;
        at a window's start the fp32 accumulators of low-precision parameters are zeroed (their
        gradients never outlive a window: the optimizer step takes them)."""
        if new_window:  # sharded gradients are per window: so are their whole-kept ones
            for shard in self._shards:
                for p in shard.whole:
                    self._view[id(p)].zero_()
        for buffer in self._buffers:
            if buffer.low:
                if self._published:  # autograd would add to them, and the hook add them again
                    for p in buffer.params:
                        p.grad = None
                if new_window:
                    buffer.grads.zero_()
            else:
                for p, view in buffer.views():
                    attach_grad(p, view)
        self._published = False

    def _hook_params(self) -> list:
        """A hook on each parameter's gradient accumulation, where there is something to do as each
        arrives: averaging over replicas (buckets), fp32 accumulation."""
        if not self._buffered:
            return []
        # Through a weak reference: a parameter holding this object (and through it every buffer)
        # in its hooks makes a cycle through C++ that the collector cannot see, so a model dropped
        # after smp.parallel_state.reset() kept its gradient buffers alive.
        on_grad = weakref.WeakMethod(self._on_grad)

        def hook(p: torch.nn.Parameter) -> None:
            method = on_grad()
            if method is not None:
                method(p)

        return [p.register_post_accumulate_grad_hook(hook) for p in self._params]

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        key = id(p)
        if key in self._sharded_ids:
            grad = p.grad
            if grad is not None:
                self._buckets[self._bucket_of[key]].sharded_view(p).add_(grad)
                p.grad = None
        elif key in self._low_ids:
            grad = p.grad
            if grad is not None:
                self._view[key].add_(grad)
                p.grad = None  # freed: the fp32 view holds it
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
        if bucket.shard is not None:
            # Bounds the buckets held: the oldest being averaged is waited for and freed first.
            while len(self._launched) - self._retired >= IN_FLIGHT:
                self._retire(self._retired)
            if bucket.storage is None:  # none of its parameters got a gradient
                bucket.sharded_view(bucket.params[0])
            flat = bucket.storage
        else:
            flat = bucket.flat
        timed = self._timed is not None and self._timed.recording  # off: one test
        launched = timeline.now() if timed else 0
        group = self._expert_group if bucket.experts else self._dp_group
        work = None  # expert buckets where ep is all of dp: only divided
        if group is not None:
            with faults.waiting(self._bucket_op(index), faults.group_of("data-parallel", group)):
                work = dist.all_reduce(flat, group=group, async_op=True)
        self._launched.append((bucket, work))
        if timed and work is not None:
            self._timed.poll()
            nbytes = flat.numel() * flat.element_size()
            self._timed.add(work, "bucket", launched, bucket=index, params=len(bucket.params), bytes=nbytes)

    def _retire(self, index: int) -> None:
        """Waits for bucket `index`'s average; a sharded bucket gives its chunk and is freed."""
        bucket, work = self._launched[index]
        if work is not None:
            group = self._expert_group if bucket.experts else self._dp_group
            with faults.waiting(self._bucket_op(index), faults.group_of("data-parallel", group)):
                work.wait()
        if bucket.shard is None:
            bucket.flat.div_(self._dp_size)  # averaged in place
        else:
            storage, bucket.storage = bucket.storage, None
            storage.div_(self._dp_size)
            bucket.shard.take(bucket, storage)
            self._launched[index] = (bucket, None)  # the work held the storage too
        self._retired = index + 1

    def _is_expert(self, p: torch.nn.Parameter) -> bool:
        return id(p) in self._expert_ids

    def _bucket_op(self, index: int) -> str:
        return f"gradient all-reduce of bucket {index + 1} of {len(self._buckets)}"

    def _grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        view = self._view.get(id(p))
        if view is not None:
            return view
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _rebucket(self) -> None:
        """The gradient buffers (the optimizers', then own ones for the other trained parameters)
        and the buckets in launch order: each buffer's ranges, last parameters first (the backward
        produces their gradients first)."""
        self._buckets_stale = False
        if not self._buffered:
            return
        trained = {id(p) for p in self._params}
        given = [b for b in self._given if all(id(p) in trained for p in b.params)]
        covered = {id(p) for b in given for p in b.params} | self._sharded_ids
        rest = [p for p in self._params if id(p) not in covered]
        old = self._view
        self._buffers = given + own_buffers(rest, self._fp32, old)
        self._view = {id(p): view for b in self._buffers for p, view in b.views()}
        self._low_ids = {id(p) for b in self._buffers if b.low for p in b.params}
        for buffer in self._buffers:
            if buffer.low:
                for p, view in buffer.views():
                    param_facts.set_grad32(p, view)
                    p.grad = None
        buckets: list[Bucket] = []
        for shard in reversed(self._shards):
            kept = [p for p in shard.params if id(p) in self._sharded_ids]
            order = sorted(kept, key=lambda p: shard.offset_of[id(p)], reverse=True)
            for group in split_into_buckets(order, self._cap_bytes, self._is_expert):
                lo, hi = shard.offset_of[id(group[-1])], shard.offset_of[id(group[0])] + group[0].numel()
                buckets.append(Bucket(group, None, lo, hi, None, shard, experts=self._is_expert(group[0])))
        if self._dp_size > 1:
            for buffer in reversed(self._buffers):
                offset_of = {id(p): off for p, off in zip(buffer.params, buffer.offsets, strict=True)}
                order = sorted(buffer.params, key=lambda p: offset_of[id(p)], reverse=True)
                for group in split_into_buckets(order, self._cap_bytes, self._is_expert):
                    lo, hi = offset_of[id(group[-1])], offset_of[id(group[0])] + group[0].numel()
                    buckets.append(Bucket(group, buffer.grads[lo:hi], experts=self._is_expert(group[0])))
        self._buckets = buckets
        self._bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b.params}
