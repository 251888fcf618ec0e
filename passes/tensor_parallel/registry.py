"""The rule table: which function rewrites each op, and what the op does with sharded inputs.

Shaped after DTensor's op strategies: one rule per op (or per group of ops that share the
logic), registered with @rule beside its code, grouped by op family under rules/. The driver
looks every call_function node up here; an op without a rule has its inputs gathered and
runs whole, which is always correct, so a rule only ever makes the graph faster.

Besides the function, each entry says how a sharded input travels through the op. This is
what decides, before a linear is cut, whether cutting it pays off (rules.layers): the walk
from its output follows ops that carry the shards on and succeeds at one that uses them.
Both facts live in this one table, next to the function that makes them true.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

# fn(rewrite, node): `rewrite` is the driver's Rewrite. The table does not name its type: the
# driver looks rules up here, so importing it back would tie the two into a circle.
RuleFn = Callable[[Any, fx.Node], None]


@dataclasses.dataclass(frozen=True)
class Rule:
    apply: RuleFn
    # A sharded input comes out sharded (in some layout) when the shapes allow: the walk goes on.
    carries: bool
    # A sharded input is consumed as it is, without a gather (row-parallel linear, attention).
    uses_shards: bool


# op (an OpOverload, operator.getitem, ...) or torch.Tag (every op with the tag) -> its rule.
_RULES: dict[Any, Rule] = {}


def rule(*ops: Any, carries: bool = False, uses_shards: bool = False) -> Callable[[RuleFn], RuleFn]:
    """Registers the decorated function `fn(rewrite, node)` as the rewrite of every op in `ops`.

    A torch.Tag stands for every op with that tag that has no rule of its own. `fn` emits the
    node's local version through the Rewrite (or calls `rewrite.generic(node)` when the layouts
    at hand do not suit it). Decorators stack, for ops that share the function but not the flags.
    """
    if carries and uses_shards:
        raise ValueError("a rule either carries shards on or uses them, not both")

    def register(fn: RuleFn) -> RuleFn:
        for op in ops:
            if op in _RULES:
                first = _RULES[op].apply.__qualname__
                raise ValueError(f"two tensor-parallel rules for {op}: {first} and {fn.__qualname__}")
            _RULES[op] = Rule(fn, carries, uses_shards)
        return fn

    return register


def lookup(target: Any) -> Rule | None:
    """The rule for a call_function target: its own, else the rule of one of its tags."""
    found = _RULES.get(target)
    if found is None and isinstance(target, torch._ops.OpOverload):
        found = next((_RULES[tag] for tag in target.tags if tag in _RULES), None)
    return found


def carries(target: Any) -> bool:
    found = lookup(target)
    return found is not None and found.carries


def uses_shards(target: Any) -> bool:
    found = lookup(target)
    return found is not None and found.uses_shards
