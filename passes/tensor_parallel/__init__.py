"""Tensor parallelism: rewrites a captured graph so its marked layers run sharded over a TP group.

Every value of the rewritten graph has a layout, the same on each rank of the group:
replicated, or sharded on one dimension (layout.py). Parameters and inputs start replicated.

- A marked linear whose input is replicated becomes column-parallel (weight rows sliced,
  output sharded on features); one whose input is sharded on its features becomes
  row-parallel (weight columns sliced, output all-reduced). Megatron's pairing, one
  all-reduce per pair each way, falls out of the dataflow: q/k/v and MLP up/gate
  projections come first, attention output and MLP down projections second.
- Ops that act within the slices keep the layout, with sizes that count the sharded
  dimension made local: pointwise ops, views that split features into heads, attention
  and matmuls over sharded heads, softmax and reductions over other dimensions.
- A marked embedding becomes vocab-parallel; cross entropy over vocab-sharded logits
  becomes the vocab-parallel cross entropy (logits are never gathered).
- Any other op gets its inputs gathered first, and model outputs are gathered: the
  rewrite is always correct; what it recognizes only decides how fast it runs.

Modules that shard themselves (smp.nn's, registered with `register_explicit_module`) keep
their parameters as they are, reported among the shards (explicit.py).

A block whose head count or feature count does not divide by the group size stays
replicated (reported in `TensorParallelResult.replicated`), as does a parameter that
some unmarked code also reads.

Where things are: driver.py walks the graph and holds what every rule shares; registry.py is
the table of rules, one per op, which rules/ fills by op family (layers, shape, elementwise,
matmul); layout.py is the layout and ShardSpec arithmetic; smp.passes.linear_forms (shared
with the pipeline's backward split) first turns every spelling of a linear layer (x @ W.T,
einsum, matmul on a [in, out] weight) into one the layer rules cut. This module runs the
driver until no rule asks for another module or parameter to stay replicated, then installs
the shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection

import torch
from torch import fx, nn

from ..fx_utils import fetch_attr, module_stack, parent_path
from ..linear_forms import canonicalize_linears
from . import rules  # noqa: F401  (importing registers every rule)
from .driver import Demote, Rewrite
from .explicit import explicit_specs, module_specs, register_explicit_module
from .layout import ShardSpec

__all__ = ["ShardSpec", "TensorParallelResult", "module_specs", "register_explicit_module", "tensor_parallel"]


@dataclasses.dataclass
class TensorParallelResult:
    # get_attr target -> how that parameter is split; the graph module now holds the local shards.
    specs: dict[str, ShardSpec]
    # id(original full tensor) -> its local shard (pass it to the next call to share shards).
    shards: dict[int, nn.Parameter]
    # Module path or parameter name -> why it stays replicated.
    replicated: dict[str, str]


def tensor_parallel(
    gm: fx.GraphModule,
    group: torch.distributed.ProcessGroup,
    marked: Collection[str],
    *,
    scatter_batch: int | None = None,
    shards: dict[int, nn.Parameter] | None = None,
    replicated: dict[str, str] | None = None,
) -> TensorParallelResult:
    """Rewrites `gm` (a graph from smp.passes.capture) in place to run over the TP group `group`
    (this process is one of its ranks; the ops reach it by name, as functional collectives do).

    marked: paths of the modules whose linear and embedding layers may be sharded.
    scatter_batch: when each rank of the group fed its own batch and the inputs were
    concatenated (size * b rows), outputs whose dim 0 is a multiple of this combined
    batch size are cut back to this rank's rows (gradients are averaged over the group).
    shards, replicated: from an earlier call on another capture of the same model (the
    eval-mode graph), so both use the same parameter shards and decisions.
    Every new node records `meta["smp_tp_origin"]`: the name of the original node it serves.
    """
    replicated = dict(replicated or {})
    size, rank = group.size(), group.rank()
    canonicalize_linears(gm)  # x @ W.T, matmul on [in, out] weights, einsum: linear layers

    def attempt() -> Rewrite:
        rewrite = Rewrite(gm, group.group_name, size, rank, set(marked), replicated, scatter_batch)
        rewrite.run()
        return rewrite

    rewrite = _run_with_demotions(attempt, replicated, _demotable_keys(gm))
    shards = {} if shards is None else shards
    for target, spec in rewrite.specs.items():
        full = fetch_attr(gm, target)
        if id(full) not in shards:
            with torch.no_grad():
                local = spec.local(full.detach(), rank, size)
            shards[id(full)] = nn.Parameter(local, requires_grad=full.requires_grad)
        _assign(gm, target, shards[id(full)])
    # smp.nn's modules hold their shards already: reported as shards (a new Parameter object on
    # the same storage, as the caller frees the tensors it replaces), never cut again.
    explicit = explicit_specs(gm)
    for target in explicit:
        held = fetch_attr(gm, target)
        if id(held) not in shards:
            shards[id(held)] = nn.Parameter(held.detach(), requires_grad=held.requires_grad)
        _assign(gm, target, shards[id(held)])
    gm.graph = rewrite.graph
    gm.recompile()
    return TensorParallelResult(dict(rewrite.specs) | explicit, shards, replicated)


def _run_with_demotions(
    attempt: Callable[[], Rewrite], replicated: dict[str, str], demotable: set[str]
) -> Rewrite:
    """Runs the rewrite until no rule demotes anything, adding each demoted key to `replicated`.

    A rule finds out that a block cannot be cut (heads that do not divide, a weight that other
    code reads whole) only partway through the graph, after earlier layers were already cut to
    match it; starting over with the key replicated is simpler than undoing them. Every restart
    must demote a key not demoted before, so there are at most as many restarts as keys that
    can be demoted; a rule that demotes a key twice, or one outside that set, is a bug in the
    rules and stops the pass with every restart's reason.
    """
    limit = len(demotable - replicated.keys())
    restarts: list[Demote] = []
    for _ in range(limit + 1):
        try:
            return attempt()
        except Demote as demotion:
            if demotion.key in replicated:
                raise RuntimeError(
                    f"smp tensor parallelism: a rule demoted {demotion.key} again ({demotion.reason}) "
                    f"although it was already kept replicated ({replicated[demotion.key]}), so "
                    f"restarting cannot make progress (a bug in the rules); restarts: {_history(restarts)}"
                ) from demotion
            replicated[demotion.key] = demotion.reason
            restarts.append(demotion)
    strays = [d for d in restarts if d.key not in demotable]
    raise RuntimeError(
        f"smp tensor parallelism: {len(restarts)} restarts, more than the {limit} modules and "
        f"parameters that could be demoted; these demotions name none of them (a bug in the rules): "
        f"{_history(strays)}; all restarts: {_history(restarts)}"
    )


def _demotable_keys(gm: fx.GraphModule) -> set[str]:
    """Every key a rule may demote: the module paths the graph runs in and their parents,
    "<root>", and the get_attr targets (parameters)."""
    keys = {"<root>"}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            keys.add(node.target)
        for path in module_stack(node):
            while path:
                keys.add(path)
                path = parent_path(path)
    return keys


def _history(demotions: list[Demote]) -> str:
    return "; ".join(f"{i + 1}. {d.key}: {d.reason}" for i, d in enumerate(demotions)) or "none"


def _assign(module: nn.Module, target: str, value: nn.Parameter) -> None:
    """Puts `value` where the get_attr `target` reads, as a parameter when one was there."""
    *path, name = target.split(".")
    owner = fetch_attr(module, ".".join(path)) if path else module
    if name in owner._parameters:
        owner._parameters[name] = value
    else:
        setattr(owner, name, value)
