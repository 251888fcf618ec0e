"""Activation offloading: the inputs that checkpointed regions keep move to pinned host memory
while their microbatch waits for its backward, and come back `horizon` microbatches ahead.

Copies run on a side stream so they overlap compute; the caching allocator is told which
stream uses each block (record_stream), so a tensor's device memory is reused only after its
copy has finished. Only CUDA tensors move: on CPU there is nothing to offload.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable

import torch

from smp.services.activation_meter import parameter_storages


class _Offloaded:
    """One saved tensor, on the host from the moment it is saved until it is fetched back."""

    def __init__(self, tensor: torch.Tensor, stream: torch.cuda.Stream):
        self._device = tensor.device
        self._stream = stream
        self._host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            self._host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its memory is free again once the copy is done
        self._copied = torch.cuda.Event()
        self._copied.record(stream)
        self._back: torch.Tensor | None = None
        self._arrived: torch.cuda.Event | None = None

    def prefetch(self) -> None:
        if self._back is not None:
            return
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._copied)
            self._back = self._host.to(self._device, non_blocking=True)
            self._arrived = torch.cuda.Event()
            self._arrived.record(self._stream)

    def get(self) -> torch.Tensor:
        self.prefetch()
        current = torch.cuda.current_stream(self._device)
        current.wait_event(self._arrived)
        self._back.record_stream(current)
        return self._back


class ActivationOffloader:
    def __init__(self, horizon: int, parameters: Callable[[], Iterable[torch.Tensor]]):
        self.horizon = horizon
        self._parameters = parameters  # read at the first save: partitioning replaces parameters
        self._param_storages: set[int] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._microbatch: int | None = None
        self._held: dict[int, list[_Offloaded]] = collections.defaultdict(list)

    @contextlib.contextmanager
    def forward_of(self, k: int):
        """Regions run in this block save for microbatch k."""
        self._microbatch = k
        try:
            yield
        finally:
            self._microbatch = None

    @contextlib.contextmanager
    def saving(self):
        """Around a region's checkpoint call: its kept inputs go through the offloader."""
        if self._microbatch is None:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def before_backward(self, k: int) -> None:
        """Starts bringing back microbatches k .. k + horizon - 1 (backward runs them in order)."""
        for j in range(k, k + self.horizon):
            for saved in self._held.get(j, ()):
                saved.prefetch()
        self._held.pop(k, None)  # its autograd graph holds them now; they go with it

    def finish_step(self) -> None:
        self._held.clear()
        self._param_storages = None  # read again: an optimizer's flat state may have moved them

    def _pack(self, tensor: torch.Tensor):
        if self._param_storages is None:
            self._param_storages = parameter_storages(self._parameters())
        if not tensor.is_cuda or tensor.untyped_storage().data_ptr() in self._param_storages:
            return tensor
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        saved = _Offloaded(tensor, self._stream)
        self._held[self._microbatch].append(saved)
        return saved


def _unpack(saved):
    return saved.get() if isinstance(saved, _Offloaded) else saved
