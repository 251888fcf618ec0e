"""Eager execution of an ATen graph through PyTorch's Python bindings.

A captured graph calls each op as an OpOverload (`torch.ops.aten.linear.default(...)`): a Python
`__call__` and then the boxed path through the dispatcher, which builds a stack of IValues from
the Python arguments. Eager PyTorch code calls the same ops through their generated Python
bindings (`torch._C._nn.linear`, `torch.layer_norm`, `Tensor.view`), which parse the arguments
straight into the C++ call. On small microbatches the host decides a stage's time, and a stage's
forward through the OpOverloads was slower than the same layers as modules; through the bindings
it runs as fast as the modules (docs/benchmarks.md, "Host overhead").

`use_python_bindings(gm)` gives a GraphModule (and each GraphModule inside it) a forward
generated from a copy of its graph in which every ATen op that has a binding calls the binding,
and a parameter is read from its module held in the GraphModule's `__dict__` (one attribute
lookup, not one `Module.__getattr__` per level of `blocks.4.attn.qkv.weight`; the tensor itself is
read at every call, so a parameter replaced on its module is followed).
The graph itself keeps its OpOverloads, which the passes read (schemas, targets). A binding takes
the schema's arguments in the schema's order and keywords, as the OpOverload does, and picks the
op's overload from their types; ATen's overloads of one name are one operation over different
argument types, so the result is the same (the parity tests run every pipeline through this).
Ops without a binding (`aten.slice.Tensor`, `aten.index.Tensor`), in-place and `out=` variants,
and ops of other namespaces (smp's tensor-parallel ops) keep their OpOverload.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

# Where the Python bindings of ATen ops live: torch.<name>, torch.nn.functional's C half, and the
# tensor methods (called as functions: Tensor.view(x, size)).
_BINDING_NAMESPACES = (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase)

# The ops run through their bindings: those a transformer's graph is made of. A list, not every op
# with a binding: a binding's default for an argument can differ from the schema's (cross-entropy's
# `reduction` defaults to none in torch._C._nn, to mean in the schema), so each call is given every
# argument explicitly, and each op here is checked against its OpOverload by the tests
# (tests/python/test_bindings.py).
BOUND_OPS = frozenset(
    """
    add sub mul div neg pow rsqrt sqrt exp log tanh sigmoid sin cos abs reciprocal clamp
    linear matmul mm bmm addmm baddbmm embedding layer_norm softmax log_softmax
    gelu silu relu dropout scaled_dot_product_attention cross_entropy_loss
    view reshape transpose permute t unsqueeze squeeze expand split split_with_sizes chunk cat
    select clone contiguous masked_fill where tril triu bitwise_not eq ne lt gt mean sum
    ones zeros full arange ones_like zeros_like
    """.split()
)


def use_python_bindings(root: torch.nn.Module) -> None:
    """Sets `forward` on each GraphModule in `root` (itself included) to code that calls ATen ops
    through their Python bindings (see the module docstring). Left alone: compiled modules (dynamo
    traces the graph's own code) and a GraphModule whose forward something else replaced
    (activation checkpointing's wrapper). Call it again after a graph changes: recompile()
    regenerates the class's forward, which the instance's would hide."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # (loaded once anything is compiled)
    compiled = eval_frame.OptimizedModule if eval_frame is not None else ()
    pending = [root]
    while pending:
        module = pending.pop()
        if isinstance(module, compiled):
            continue
        if isinstance(module, fx.GraphModule) and (
            "forward" not in module.__dict__ or _MARK in module.__dict__
        ):
            forward = _forward_through_bindings(module)
            if forward is not None:
                object.__setattr__(module, "forward", forward.__get__(module))
                object.__setattr__(module, _MARK, True)
        pending.extend(module.children())


_MARK = "_smp_python_bindings"  # set on a GraphModule whose forward this module made


def binding_of(op: Any) -> Callable | None:
    """The Python binding that runs ATen op `op` (an OpOverload) given all its arguments, or None."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    name = op.overloadpacket.__name__
    if name not in BOUND_OPS or op._schema.overload_name.startswith("out"):
        return None
    for namespace in _BINDING_NAMESPACES:
        binding = getattr(namespace, name, None)
        if binding is not None:
            return binding
    return None


def explicit_arguments(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    """`kwargs` with every argument of the schema that `args` and `kwargs` leave to its default given
    that default by name (a binding's own default may differ)."""
    given = dict(kwargs)
    for i, argument in enumerate(op._schema.arguments):
        if i >= len(args) and argument.name not in given and argument.has_default_value():
            if not any(kind in str(argument.real_type) for kind in _ENUM_TYPES):
                given[argument.name] = argument.default_value
    return given


# Argument types whose schema defaults come as their enum's number, which a binding refuses (it
# wants torch.contiguous_format, not 0); their bindings' defaults are the schema's.
_ENUM_TYPES = ("MemoryFormat", "ScalarType", "Layout", "Device", "Generator")


class _Call:
    """A call_function target that fx's code generator names as a global of its own; the global is
    then set to the binding itself, so the generated code calls it with no frame in between."""

    __module__ = "smp_binding"

    def __init__(self, binding: Callable, name: str):
        self.binding = binding
        self.__name__ = name

    def __call__(self, *args, **kwargs):  # (not called by the generated code)
        return self.binding(*args, **kwargs)


def _forward_through_bindings(gm: fx.GraphModule) -> Callable | None:
    if type(getattr(gm.graph, "_codegen", None)) is not fx.graph.CodeGen:
        return None  # a graph with a codegen of its own (pytree in and out): left as it is
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    replaced = 0
    owners: dict[str, str] = {}  # path of a module that holds a read tensor -> its alias
    for node in graph.nodes:
        if node.op == "get_attr" and "." in node.target:
            path, field = node.target.rsplit(".", 1)
            if path not in owners:
                owners[path] = f"{_MARK}_owner_{len(owners)}"
                object.__setattr__(gm, owners[path], gm.get_submodule(path))
            node.target = f"{owners[path]}.{field}"
        elif node.op == "call_function":
            op, binding = node.target, binding_of(node.target)
            if binding is not None:
                node.kwargs = explicit_arguments(op, node.args, node.kwargs)
                node.target = _Call(binding, op.overloadpacket.__name__)
                replaced += 1
    if not replaced and not owners:
        return None
    code = graph.python_code(root_module="self")
    scope = {
        name: value.binding if isinstance(value, _Call) else value for name, value in code.globals.items()
    }
    exec(compile(code.src, f"<{type(gm).__name__} through Python bindings>", "exec"), scope)
    return scope["forward"]
