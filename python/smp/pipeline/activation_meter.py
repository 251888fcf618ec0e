"""Counts the bytes autograd saves for backward (activations), live and peak, with saved-tensor hooks.

Tensors that share storage with a parameter (weights saved by matmuls) are not
activations and are not counted; a storage saved twice counts once.
"""

from __future__ import annotations

import contextlib
import weakref

import torch


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def parameter_storages(parameters) -> set[int]:
    """The storages of these parameters: a saved tensor in one of them is a weight, not an activation."""
    return {p.untyped_storage().data_ptr() for p in parameters}


class SavedActivationMeter:
    def __init__(self, parameters):
        self._param_storages = parameter_storages(parameters)
        self._live: dict[int, list[int]] = {}  # storage -> [saved count, bytes]
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    @contextlib.contextmanager
    def track(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

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
