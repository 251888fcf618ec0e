"""The rule table of the context-parallel rewrite: for each op, how a value cut on the sequence
goes through it.

A rule has two halves. `forward(rewrite, node) -> Plan | None`: from where its inputs hold the
sequence (rewrite.layout), the cut of its result and the cut (or None: whole) each input is read
at; None when the op cannot run on cut inputs (the driver then runs it on whole ones). `pull(rewrite,
node, cut) -> Plan | None`: how to compute the node's result already cut by `cut` from cut inputs,
so that a whole value (a mask or position table built from `arange`) is computed only for this
rank's positions; None: the whole value is sliced instead. Both are always correct to decline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from .layout import Cut

# A cut of a result: one Cut, None (whole), or one per element of a tuple result.
Layout = Cut | list | None


@dataclasses.dataclass
class Plan:
    """How a node runs on this rank: the cut of its result and what each input is read as."""

    out: Layout
    wants: dict[str, Cut | None] = dataclasses.field(default_factory=dict)  # input name -> cut
    # The node's args/kwargs with local sizes (original nodes inside, read as `wants` says).
    args: tuple | None = None
    kwargs: dict | None = None
    # Emits more on the node's local result (a reduction's all-reduce); returns the final node.
    finish: Callable[[Any, fx.Node], fx.Node] | None = None
    # Emits the node's local version by itself (given the rewrite), instead of the node's op.
    emit: Callable[[Any], fx.Node] | None = None


Forward = Callable[[Any, fx.Node], Plan | None]
Pull = Callable[[Any, fx.Node, Cut], Plan | None]


@dataclasses.dataclass(frozen=True)
class Rule:
    forward: Forward
    pull: Pull | None


_RULES: dict[Any, Rule] = {}


def rule(*ops: Any, pull: Pull | None = None) -> Callable[[Forward], Forward]:
    """Registers the decorated forward (and `pull`) for every op in `ops`."""

    def register(forward: Forward) -> Forward:
        for op in ops:
            if op in _RULES:
                raise ValueError(f"two context-parallel rules for {op}")
            _RULES[op] = Rule(forward, pull)
        return forward

    return register


def lookup(target: Any) -> Rule | None:
    """The rule of a call_function target (smp's own ops are registered by name, "smp::tp_copy":
    the passes load before their library)."""
    found = _RULES.get(target)
    if found is None and isinstance(target, torch._ops.OpOverload):
        found = _RULES.get(target._schema.name)
    return found
