"""Input signatures: the shapes, dtypes and non-tensor values a model call was captured for.

A captured graph is specialized to its inputs' shapes, so each new signature (another sequence
length, a smaller last batch, an eval loop with another batch size) gets its own captured stage
graphs. They are cached per (train/eval flags, signature), least recently used evicted past
`signature_cache_size`; after `signature_warn_after` distinct signatures smp warns once, with
the advice of SageMaker Training Compiler's best practices (every capture costs time).

Every rank of a pipeline calls the model with the same step inputs (SMP's model), so every
stage computes the same signature from its own inputs: agreeing on it needs no message.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from smp.passes.capture import is_plain_leaf


def of(args: tuple, kwargs: dict) -> Hashable:
    """The signature of one call: structure, each tensor's shape/dtype/requires_grad, each other value."""
    if all(map(is_plain_leaf, args)) and all(map(is_plain_leaf, kwargs.values())):
        # No containers: the structure is the positional count and the keyword names (no pytree walk
        # per microbatch; a call with containers gets a TreeSpec, so the two kinds never collide).
        names = tuple(sorted(kwargs))
        return ((len(args), names), tuple(_leaf(x) for x in (*args, *(kwargs[k] for k in names))))
    leaves, spec = pytree.tree_flatten((tuple(args), dict(sorted(kwargs.items()))))
    return (spec, tuple(_leaf(x) for x in leaves))  # TreeSpec hashes and compares by structure


def _leaf(x: Any) -> Hashable:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.requires_grad, x.device.type)
    try:
        hash(x)
        return (type(x).__name__, x)
    except TypeError:  # an unhashable constant: its text stands for it
        return (type(x).__name__, repr(x))


def describe(signature: Hashable) -> str:
    """The tensor shapes of a signature, for messages: '(8, 16) int64, (8, 16) int64'."""
    _, leaves = signature
    shapes = [f"{tuple(leaf[0])} {str(leaf[1]).removeprefix('torch.')}" for leaf in leaves if len(leaf) == 4]
    return ", ".join(shapes) or "no tensors"


class SignatureCache:
    """Captured stage runtimes by (mode flags, signature), least recently used first."""

    def __init__(self, warn_after: int, capacity: int):
        self._warn_after = warn_after
        self._capacity = capacity
        self._entries: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._seen: dict[Hashable, float] = {}  # every distinct signature -> seconds its capture took
        self._warned = False
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> list[Any]:
        return list(self._entries.values())

    @property
    def signatures_seen(self) -> int:
        return len(self._seen)

    def seen_costs(self) -> dict[Hashable, float]:
        """Every distinct signature seen -> the seconds its captures took (all modes, recaptures)."""
        return dict(self._seen)

    def get(self, flags: tuple, signature: Hashable) -> Any | None:
        entry = self._entries.get((flags, signature))
        if entry is not None:
            self._entries.move_to_end((flags, signature))
        return entry

    def put(self, flags: tuple, signature: Hashable, runtime: Any, seconds: float) -> None:
        """Adds a captured runtime (evicting the least recently used past capacity), and warns once
        when the distinct signatures reach `warn_after`."""
        self._entries[(flags, signature)] = runtime
        self._entries.move_to_end((flags, signature))
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
            self.evictions += 1
        self._seen[signature] = self._seen.get(signature, 0.0) + seconds
        if not self._warned and len(self._seen) >= self._warn_after:
            self._warned = True
            warnings.warn(self.advice(), stacklevel=5)

    def advice(self) -> str:
        costs = ", ".join(f"[{describe(s)}] {t:.2f}s" for s, t in self._seen.items())
        return (
            f"smp: the model has been called with {len(self._seen)} distinct input signatures (shapes, "
            f"dtypes or non-tensor values); each one is captured, partitioned and compiled anew "
            f"(capture costs: {costs}). As SageMaker Training Compiler advises: pad to a fixed length "
            "(tokenizer padding='max_length') or bucket the lengths into a few sizes, and keep the batch "
            "size fixed (DataLoader(drop_last=True)). The config keys 'signature_warn_after' and "
            f"'signature_cache_size' (now {self._capacity} graphs kept) tune this."
        )


def timed(capture: Callable[[], Any]) -> tuple[Any, float]:
    """capture() and the seconds it took."""
    import time

    start = time.perf_counter()
    result = capture()
    return result, time.perf_counter() - start
