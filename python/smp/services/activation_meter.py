"""Counts the bytes autograd saves for backward (activations), live and peak, with saved-tensor hooks;
and, apart, the output gradients zero_bubble keeps for its deferred weight gradients.

Tensors that share storage with a parameter (weights saved by matmuls) are not
activations and are not counted; a storage saved twice counts once.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.distributed.tensor import DTensor


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def parameter_storages(parameters) -> set[int]:
    """The storages of these parameters: a saved tensor in one of them is a weight, not an activation.
    (A sharded parameter's is its local shard's; the gathered copies FSDP2 makes count as weights
    only while they are parameters of a module, so they are not listed here.)"""
    return {_local(p).untyped_storage().data_ptr() for p in parameters}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class SavedActivationMeter:
    def __init__(self, parameters):
        """`parameters`: a function giving the module's parameters now. Their storages are read
        again at each track(): an optimizer's flat state moves them into one buffer."""
        self._parameters = parameters
        self._param_storages = parameter_storages(parameters())
        self._live: dict[int, list[int]] = {}  # storage -> [saved count, bytes]
        self.live_bytes = 0
        self.peak_bytes = 0
        self.gradient_live_bytes = 0  # output gradients zero_bubble's W keeps (see hold)
        self.gradient_peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.gradient_peak_bytes = self.gradient_live_bytes

    @contextlib.contextmanager
    def track(self):
        self._param_storages = parameter_storages(self._parameters())
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def hold(self, tensor: torch.Tensor, gradient: bool = False):
        """Counts a tensor kept for backward outside autograd (zero_bubble's W inputs) for as long
        as the returned object lives; its `.tensor` is the tensor. A kept activation counts with
        the saved ones; a kept gradient apart (`gradient_peak_bytes`): gradients in flight are not
        counted in any schedule (a plain backward holds each while its node runs), so counting
        these with the activations would compare unlike things."""
        if not gradient:
            held = self._pack(tensor)
            return held if isinstance(held, _Saved) else _Saved(tensor)
        held = _Saved(tensor)
        nbytes = tensor.untyped_storage().nbytes()
        self.gradient_live_bytes += nbytes
        self.gradient_peak_bytes = max(self.gradient_peak_bytes, self.gradient_live_bytes)
        weakref.finalize(held, self._release_gradient, nbytes)
        return held

    def _release_gradient(self, nbytes: int) -> None:
        self.gradient_live_bytes -= nbytes

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._param_storages or key == 0:
            return tensor
        entry = self._live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live_bytes += entry[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        saved = _Saved(tensor)
        weakref.finalize(saved, self._release, key)
        return saved

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._live[key]


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Saved) else saved
