"""Partition: assign every compute node of a captured graph to a pipeline stage.

Automatic partitioning cuts the graph into contiguous stages balanced by the cost
model of cost.py; manual partitioning follows the module -> stage map the user set
with smp.partition / smp.set_partition. Either way the result is a PartitionPlan
that split.py turns into stage modules.

A parameter used by nodes on several stages (tied embeddings, a module called
twice) is "shared": by default every stage that uses it holds a replica and the
runtime sums the replicas' gradients; with `colocate_shared=True` (SMP v1's
behaviour) all its users must land on one stage instead.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping

import torch
from torch import fx

from . import cost as cost_lib
from .fx_utils import COMPUTE_OPS, attr_inputs, module_stack  # COMPUTE_OPS: smp reads it from here too


class PartitionError(ValueError):
    pass


@dataclasses.dataclass
class Segment:
    """A run of consecutive compute nodes that belong to one module call (a partitionable unit)."""

    key: str  # module path at the chosen depth; "" for code of the root module itself
    nodes: list[str]
    compute: float
    activation_bytes: int
    parameters: frozenset[str]  # canonical names of the parameters its nodes read


@dataclasses.dataclass
class PartitionPlan:
    num_stages: int
    node_stage: dict[str, int]  # compute node name -> stage
    stage_units: list[list[str]]  # module paths per stage, in graph order
    stage_parameters: list[list[str]]  # canonical parameter names per stage
    stage_parameter_bytes: list[int]
    stage_cost: list[float]  # the balancing objective per stage (relative units)
    shared_parameters: dict[str, list[int]]  # parameter -> the stages holding a replica
    parameter_aliases: dict[str, str]  # get_attr target -> canonical parameter name
    parameter_numel: dict[str, int]

    def report(self) -> str:
        lines = [f"smp partition: {self.num_stages} stages"]
        for s in range(self.num_stages):
            numel = sum(self.parameter_numel[p] for p in self.stage_parameters[s])
            units = _abbreviate(self.stage_units[s])
            lines.append(
                f"  stage {s}: cost {self.stage_cost[s]:.4f}, {numel:,} parameters "
                f"({self.stage_parameter_bytes[s] / 2**20:.2f} MiB), modules: {units}"
            )
        if self.shared_parameters:
            lines.append("  shared parameters (replicated, gradients summed across their stages):")
            for name, stages in sorted(self.shared_parameters.items()):
                lines.append(f"    {name}: stages {stages}")
        return "\n".join(lines)


def parameter_aliases(gm: fx.GraphModule) -> tuple[dict[str, str], dict[str, torch.nn.Parameter]]:
    """Maps every parameter name of `gm` (tied ones included) to one canonical name per tensor."""
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    params: dict[str, torch.nn.Parameter] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(p), name)
        aliases[name] = first
        params[first] = p
    return aliases, params


def segments(gm: fx.GraphModule, depth: int) -> list[Segment]:
    """Consecutive compute nodes grouped by the module they run in, `depth` calls below the root."""
    aliases, params = parameter_aliases(gm)
    keys: dict[str, str] = {}
    result: list[Segment] = []
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        if (
            node.target is operator.getitem
            and isinstance(node.args[0], fx.Node)
            and node.args[0].name in keys
        ):
            key = keys[node.args[0].name]  # unpacking stays with the op that produced the tuple
        else:
            key = _module_path(node, depth)
        keys[node.name] = key
        used = frozenset(aliases[a.target] for a in attr_inputs(node) if a.target in aliases)
        compute = node.meta.get(cost_lib.SECONDS, node.meta.get(cost_lib.FLOPS, 0.0))
        act = node.meta.get(cost_lib.ACTIVATION_BYTES, 0)
        if result and result[-1].key == key:
            last = result[-1]
            last.nodes.append(node.name)
            last.compute += compute
            last.activation_bytes += act
            last.parameters = last.parameters | used
        else:
            result.append(Segment(key, [node.name], compute, act, used))
    return result


def auto_partition(
    gm: fx.GraphModule, num_stages: int, memory_weight: float = 0.8, colocate_shared: bool = False
) -> PartitionPlan:
    """Contiguous stages minimizing the costliest stage.

    Cost = (1 - memory_weight) * compute share + memory_weight * memory share,
    memory = parameter bytes * OPTIMIZER_FACTOR + activation bytes. Units are module
    calls at the shallowest call depth that balances within 5% of the best depth.
    Call cost.annotate(gm) first.
    """
    if num_stages < 1:
        raise PartitionError(f"num_stages must be >= 1, got {num_stages}")
    _, params = parameter_aliases(gm)
    param_bytes = {n: p.numel() * p.element_size() for n, p in params.items()}
    candidates = []
    previous: list[str] | None = None
    deepest = max((len(module_stack(n)) for n in gm.graph.nodes), default=0)
    for depth in range(1, max(deepest, 1) + 1):
        units = _absorb_glue(segments(gm, depth))
        if depth == 1:
            top_units = units
        if colocate_shared:
            units = _merge_shared(units)
        keys = [u.key for u in units]
        if keys == previous:
            continue  # a wrapper module adds depth without new units
        previous = keys
        if len(units) >= num_stages:
            bounds, stage_cost = _balance(units, num_stages, memory_weight, param_bytes)
            candidates.append((max(stage_cost), depth, units, bounds, stage_cost))
    if not candidates:
        raise PartitionError(_too_small_message(top_units, num_stages, colocate_shared))
    best = min(c[0] for c in candidates)
    _, _, units, bounds, stage_cost = next(c for c in candidates if c[0] <= best * 1.05 + 1e-12)
    node_stage = {}
    for s in range(num_stages):
        for unit in units[bounds[s] : bounds[s + 1]]:
            for name in unit.nodes:
                node_stage[name] = s
    return plan_from_assignment(gm, node_stage, num_stages, colocate_shared, stage_cost)


def manual_partition(
    gm: fx.GraphModule,
    num_stages: int,
    module_stage: Mapping[str, int],
    default_stage: int = 0,
    colocate_shared: bool = False,
) -> PartitionPlan:
    """Stages from a map of module path -> stage (innermost assigned module wins).

    An operation outside every assigned module runs on the latest stage among
    `default_stage` and the stages of its inputs, so unassigned code (the root
    module's own code, an unassigned head) follows the data instead of sending it back.
    """
    for path, s in module_stage.items():
        if not 0 <= s < num_stages:
            raise PartitionError(
                f"module '{path}' is assigned to partition {s}, outside [0, {num_stages}); "
                f"use a partition index below the number of stages, {num_stages} (pipeline_parallel_degree, "
                "twice it under the zero_bubble_v schedule)"
            )
    nodes = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    stage: dict[str, int] = {}
    for node in nodes:
        assigned = _explicit_stage(node, module_stage)
        if assigned is None:
            assigned = max([default_stage] + [stage[p.name] for p in node.all_input_nodes if p.name in stage])
        stage[node.name] = assigned
    _check_forward_only(nodes, stage)
    empty = [s for s in range(num_stages) if s not in set(stage.values())]
    if empty:
        raise PartitionError(
            f"partition(s) {empty} received no operations of the model: assign modules to them with "
            "`with smp.partition(i):` or smp.set_partition(module, i), or lower pipeline_parallel_degree "
            "(under zero_bubble_v every one of its 2 x pipeline_parallel_degree stages needs operations)"
        )
    return plan_from_assignment(gm, stage, num_stages, colocate_shared)


# --- helpers --------------------------------------------------------------------


def _module_path(node: fx.Node, depth: int) -> str:
    stack = module_stack(node)
    return stack[min(depth, len(stack)) - 1] if stack else ""


def _explicit_stage(node: fx.Node, module_stage: Mapping[str, int]) -> int | None:
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        if path in module_stage:
            return module_stage[path]
    return None


def _absorb_glue(units: list[Segment]) -> list[Segment]:
    """Merges code of the root module that reads no parameter (`x + pos`, `arange`) into the next
    unit: it is glue between modules, not a place worth a stage of its own."""
    merged: list[Segment] = []
    carry: list[Segment] = []
    for unit in units:
        if unit.key == "" and not unit.parameters:
            carry.append(unit)
            continue
        merged.append(_join(carry + [unit]) if carry else unit)
        carry = []
    if carry:
        if merged:
            merged[-1] = _join([merged[-1]] + carry)
        else:
            merged.append(_join(carry))
    return merged


def _join(group: list[Segment]) -> Segment:
    return Segment(
        "+".join(dict.fromkeys(u.key or "<root>" for u in group)),
        [n for u in group for n in u.nodes],
        sum(u.compute for u in group),
        sum(u.activation_bytes for u in group),
        functools.reduce(operator.or_, (u.parameters for u in group), frozenset()),
    )


def _merge_shared(units: list[Segment]) -> list[Segment]:
    """Merges every run of units between the first and last user of a shared parameter."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, unit in enumerate(units):
        for p in unit.parameters:
            first.setdefault(p, i)
            last[p] = i
    reach = list(range(len(units)))
    for p in first:
        for i in range(first[p], last[p] + 1):
            reach[i] = max(reach[i], last[p])
    merged: list[Segment] = []
    i = 0
    while i < len(units):
        j, end = i, reach[i]
        while j < end:
            j += 1
            end = max(end, reach[j])
        merged.append(_join(units[i : j + 1]))
        i = j + 1
    return merged


def _balance(units, num_stages, memory_weight, param_bytes):
    """Contiguous split of `units` into `num_stages` non-empty ranges minimizing the max range cost."""
    n = len(units)
    total_compute = sum(u.compute for u in units) or 1.0
    total_memory = (
        sum(u.activation_bytes for u in units) + cost_lib.OPTIMIZER_FACTOR * sum(param_bytes.values())
    ) or 1.0
    cost = [[0.0] * (n + 1) for _ in range(n + 1)]
    for i in range(n):
        compute, act, seen, pbytes = 0.0, 0, set(), 0
        for j in range(i, n):
            unit = units[j]
            compute += unit.compute
            act += unit.activation_bytes
            for p in unit.parameters - seen:
                seen.add(p)
                pbytes += param_bytes.get(p, 0)
            memory = act + cost_lib.OPTIMIZER_FACTOR * pbytes
            cost[i][j + 1] = (
                1 - memory_weight
            ) * compute / total_compute + memory_weight * memory / total_memory
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost[i][j])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    stage_cost = [cost[bounds[s]][bounds[s + 1]] for s in range(num_stages)]
    return bounds, stage_cost


def _too_small_message(units: list[Segment], num_stages: int, colocate_shared: bool) -> str:
    names = _abbreviate([u.key or "<root>" for u in units])
    message = (
        f"model too small to split: {len(units)} partitionable unit(s) ({names}) for "
        f"pipeline_parallel_degree={num_stages}; use at most {len(units)} stages or a model with more modules"
    )
    if colocate_shared:
        message += (
            "; shared parameters are co-located (colocate_shared_parameters=True), which merges every "
            "module between their users into one unit: set it to False to replicate them instead"
        )
    return message


def _check_forward_only(nodes: list[fx.Node], node_stage: Mapping[str, int]) -> None:
    for node in nodes:
        for producer in node.all_input_nodes:
            if producer.name in node_stage and node_stage[producer.name] > node_stage[node.name]:
                raise PartitionError(
                    f"the manual partition is not a pipeline: '{producer.name}' "
                    f"(in {_module_path(producer, 99) or '<root>'}, partition {node_stage[producer.name]}) "
                    f"feeds '{node.name}' (in {_module_path(node, 99) or '<root>'}, partition "
                    f"{node_stage[node.name]}); data must flow from lower to higher partitions: "
                    "assign modules in the order the forward calls them"
                )


def plan_from_assignment(
    gm: fx.GraphModule,
    node_stage: Mapping[str, int],
    num_stages: int,
    colocate_shared: bool = False,
    stage_cost: list[float] | None = None,
) -> PartitionPlan:
    """The plan for a given node -> stage assignment (the report, parameters per stage, sharing)."""
    aliases, params = parameter_aliases(gm)
    users: dict[str, set[int]] = {}
    units: list[list[str]] = [[] for _ in range(num_stages)]
    # Name each stage's modules at the shallowest depth where a module belongs to one stage only.
    stages_of: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        if node.name in node_stage:
            for path in module_stack(node):
                stages_of.setdefault(path, set()).add(node_stage[node.name])
    for node in gm.graph.nodes:
        if node.name not in node_stage:
            continue
        s = node_stage[node.name]
        for attr in attr_inputs(node):
            if attr.target in aliases:
                users.setdefault(aliases[attr.target], set()).add(s)
        stack = module_stack(node)
        unit = next((path for path in stack if len(stages_of[path]) == 1), stack[-1] if stack else "<root>")
        if unit not in units[s]:
            units[s].append(unit)
    shared = {p: sorted(s) for p, s in users.items() if len(s) > 1}
    if colocate_shared and shared:
        name, stages = sorted(shared.items())[0]
        raise PartitionError(
            f"parameter '{name}' is used on partitions {stages}, but shared parameters must be co-located "
            "(colocate_shared_parameters=True): put every module that uses it in one partition, or set "
            "colocate_shared_parameters=False to replicate it with gradients summed across partitions"
        )
    stage_params: list[list[str]] = [[] for _ in range(num_stages)]
    for name in params:  # parameter order of the module
        for s in sorted(users.get(name, {0})):  # unused parameters stay on stage 0
            stage_params[s].append(name)
    nbytes = [sum(params[p].numel() * params[p].element_size() for p in ps) for ps in stage_params]
    if stage_cost is None:
        stage_cost = _stage_costs(gm, node_stage, num_stages)
    return PartitionPlan(
        num_stages,
        dict(node_stage),
        units,
        stage_params,
        nbytes,
        list(stage_cost),
        shared,
        aliases,
        {n: p.numel() for n, p in params.items()},
    )


def _stage_costs(gm, node_stage, num_stages) -> list[float]:
    total = [0.0] * num_stages
    for node in gm.graph.nodes:
        if node.name in node_stage:
            total[node_stage[node.name]] += node.meta.get(cost_lib.FLOPS, 0.0)
    whole = sum(total) or 1.0
    return [t / whole for t in total]


def _abbreviate(names: list[str], keep: int = 8) -> str:
    if len(names) <= keep:
        return ", ".join(names)
    return (
        ", ".join(names[: keep // 2]) + f", ... ({len(names) - keep} more), " + ", ".join(names[-keep // 2 :])
    )
