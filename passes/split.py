"""Split: a partitioned graph -> one GraphModule per stage, plus what crosses between stages.

Every stage module takes (the flat model inputs it reads, then the values it
receives from earlier stages) and returns the values it produces for later
stages or for the model's output. Parameters and buffers are get_attr nodes
that point at the captured module's own tensors, so a parameter used on two
stages is the same tensor in both stage modules of one process.

What a stage computes from the model inputs alone (no parameter, buffer or gradient: a reshaped
label, a position range, an attention mask built from the inputs) is not sent to the later
stages that read it: each computes it again from the inputs it holds (`_from_inputs_alone`), a
few cheap ops instead of a message per microbatch.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from .capture import CapturedGraph
from .fx_utils import COMPUTE_OPS, fetch_attr, tensor_leaves
from .partition import PartitionError, PartitionPlan


@dataclasses.dataclass
class Value:
    """A tensor that leaves the stage that computed it."""

    name: str
    src: int
    consumers: list[int]  # later stages that read it
    is_output: bool  # returned from the model's forward (so sent to every stage)
    requires_grad: bool  # a gradient flows back for it
    shape: torch.Size
    dtype: torch.dtype


@dataclasses.dataclass
class StageModule:
    index: int
    module: fx.GraphModule
    inputs: list[int]  # flat model-input indices, the first placeholders
    received: list[str]  # values from earlier stages, the next placeholders
    produced: list[str]  # values it returns, in order


@dataclasses.dataclass
class OutputLeaf:
    kind: str  # "value" (a Value's name), "input" (a flat input index) or "const"
    ref: Any


@dataclasses.dataclass
class PipelineGraph:
    stages: list[StageModule]
    values: dict[str, Value]
    outputs: list[OutputLeaf]
    captured: CapturedGraph
    plan: PartitionPlan

    def unflatten_outputs(self, leaves: list[Any]) -> Any:
        return pytree.tree_unflatten(leaves, self.captured.out_spec)

    def run(self, *args, **kwargs) -> Any:
        """Runs every stage in order in this process: the model's forward, for checking a split."""
        flat = self.captured.flatten_inputs(args, kwargs)
        env: dict[str, Any] = {}
        for stage in self.stages:
            results = stage.module(*[flat[i] for i in stage.inputs], *[env[v] for v in stage.received])
            env.update(zip(stage.produced, results, strict=True))
        leaves = [
            env[leaf.ref] if leaf.kind == "value" else flat[leaf.ref] if leaf.kind == "input" else leaf.ref
            for leaf in self.outputs
        ]
        return self.unflatten_outputs(leaves)


def split(captured: CapturedGraph, plan: PartitionPlan) -> PipelineGraph:
    gm = captured.graph_module
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    input_index = {n.name: i for i, n in enumerate(placeholders)}
    stage_of = plan.node_stage
    requires_grad = _requires_grad(nodes, captured.input_requires_grad)
    recomputed = _from_inputs_alone(nodes, requires_grad)

    values: dict[str, Value] = {}

    def value(node: fx.Node) -> Value:
        if node.name not in values:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise PartitionError(
                    f"'{node.name}' ({type(val).__name__}) would cross between pipeline stages, but only "
                    "tensors can; move the code that produces and uses it into one partition"
                )
            values[node.name] = Value(
                node.name, stage_of[node.name], [], False, requires_grad[node.name], val.shape, val.dtype
            )
        return values[node.name]

    for node in nodes:
        if node.name not in stage_of:
            continue
        for producer in node.all_input_nodes:
            if producer.name in recomputed:
                continue  # (the consumer's stage computes it too)
            if producer.name in stage_of and stage_of[producer.name] != stage_of[node.name]:
                consumers = value(producer).consumers
                if stage_of[node.name] not in consumers:
                    consumers.append(stage_of[node.name])

    outputs = []
    for leaf in captured.output_nodes():
        if not isinstance(leaf, fx.Node):
            outputs.append(OutputLeaf("const", leaf))
        elif leaf.op == "placeholder":
            outputs.append(OutputLeaf("input", input_index[leaf.name]))
        elif leaf.name in stage_of:
            value(leaf).is_output = True
            outputs.append(OutputLeaf("value", leaf.name))
        else:
            raise PartitionError(
                f"the model returns '{leaf.target}' ({leaf.op}) directly; return a computed tensor instead"
            )

    stages = [
        _stage_module(gm, nodes, plan.num_stages, s, stage_of, input_index, values, recomputed)
        for s in range(plan.num_stages)
    ]
    return PipelineGraph(stages, values, outputs, captured, plan)


def _stage_module(gm, nodes, num_stages, s, stage_of, input_index, values, recomputed) -> StageModule:
    own = {n.name for n in nodes if stage_of.get(n.name) == s or _is_grad_mode_switch(n)}
    needed = [p for n in nodes if n.name in own for p in n.all_input_nodes if p.name in recomputed]
    while needed:  # what the stage computes again from the inputs, with what that reads
        node = needed.pop()
        if node.name not in own:
            own.add(node.name)
            needed += [p for p in node.all_input_nodes if p.name in recomputed]
    mine = [n for n in nodes if n.name in own]
    inputs: list[int] = []
    received: list[str] = []
    for node in mine:
        for p in node.all_input_nodes:
            if p.op == "placeholder" and input_index[p.name] not in inputs:
                inputs.append(input_index[p.name])
            elif p.name in stage_of and p.name not in own and p.name not in received:
                received.append(p.name)
    inputs.sort()
    order = {n.name: i for i, n in enumerate(nodes)}
    received.sort(key=order.__getitem__)
    produced = [v.name for v in values.values() if v.src == s and (v.consumers or v.is_output)]

    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    attrs: dict[str, Any] = {}
    by_name = {n.name: n for n in nodes}
    placeholder_names = [n.name for n in nodes if n.op == "placeholder"]
    for i in inputs:
        env[placeholder_names[i]] = graph.placeholder(placeholder_names[i])
    for name in received:
        env[name] = graph.placeholder(name)
        env[name].meta = dict(by_name[name].meta)

    def lookup(node: fx.Node) -> fx.Node:
        if node.name not in env:
            assert node.op == "get_attr", node.format_node()
            attrs[node.target] = fetch_attr(gm, node.target)
            env[node.name] = graph.get_attr(node.target)
        return env[node.name]

    for node in mine:
        env[node.name] = graph.node_copy(node, lookup)
    for name in received:
        _clone_if_mutated(graph, env[name])
    graph.output(tuple(env[name] for name in produced))
    graph.lint()
    module = fx.GraphModule(attrs, graph, class_name=f"Stage{s}")
    return StageModule(s, module, inputs, received, produced)


def _clone_if_mutated(graph: fx.Graph, placeholder: fx.Node) -> None:
    """A received value is an autograd leaf on its stage, and leaves may not be modified in
    place (`relu_`, `x += pos` at the start of a stage): such stages work on a copy."""
    if not any(_writes(user, placeholder) for user in placeholder.users):
        return
    with graph.inserting_after(placeholder):
        copy = graph.call_function(torch.ops.aten.clone.default, (placeholder,))
    placeholder.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)


def _writes(node: fx.Node, value: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    bound = list(zip(schema.arguments, node.args, strict=False)) + [
        (a, node.kwargs[a.name]) for a in schema.arguments if a.name in node.kwargs
    ]
    return any(arg is value and a.alias_info is not None and a.alias_info.is_write for a, arg in bound)


def _from_inputs_alone(nodes: list[fx.Node], requires_grad: dict[str, bool]) -> set[str]:
    """The nodes every stage that reads them computes for itself: those computed by functional,
    deterministic ATen ops (and getitem) from model inputs, constants and each other alone, with
    no gradient. None if anything writes in place to such a node or to a model input (a stage
    computing it again would not see the write), or under a grad-mode switch's region (kept
    simple: none at all then)."""
    found: set[str] = set()
    for node in nodes:
        if _is_grad_mode_switch(node):
            return set()
        if node.op == "placeholder":
            found.add(node.name)
        elif (
            node.op == "call_function"
            and (node.target is operator.getitem or _functional_and_deterministic(node.target))
            and not requires_grad.get(node.name, False)
            and all(p.name in found for p in node.all_input_nodes)
        ):
            found.add(node.name)
    by_name = {n.name: n for n in nodes}
    if any(_writes(user, by_name[name]) for name in found for user in by_name[name].users):
        return set()
    return {name for name in found if by_name[name].op != "placeholder"}


def _functional_and_deterministic(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False  # (smp's ops and collectives talk to other ranks: never computed twice)
    if torch.Tag.nondeterministic_seeded in target.tags:  # (random: each stage would draw its own)
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _is_grad_mode_switch(node: fx.Node) -> bool:
    # no_grad / enable_grad regions: every stage replays the switches in order.
    return node.op == "call_function" and node.target is torch._C._set_grad_enabled


def _requires_grad(nodes: list[fx.Node], input_requires_grad: list[bool]) -> dict[str, bool]:
    """Which nodes' outputs autograd will track: floating tensors computed from tracked inputs."""
    result: dict[str, bool] = {}
    grad_enabled = True
    placeholder_index = 0
    for node in nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            result[node.name] = input_requires_grad[placeholder_index]
            placeholder_index += 1
        elif node.op == "get_attr":
            result[node.name] = bool(
                getattr(fetch_attr(node.graph.owning_module, node.target), "requires_grad", False)
            )
        elif _is_grad_mode_switch(node):
            grad_enabled = bool(node.args[0])
            result[node.name] = False
        elif node.op in COMPUTE_OPS:
            differentiable = (
                grad_enabled
                and node.target is not torch.ops.aten.detach.default
                and any(t.is_floating_point() or t.is_complex() for t in tensor_leaves(val))
            )
            result[node.name] = differentiable and any(
                result.get(p.name, False) for p in node.all_input_nodes
            )
    return result
