"""Sharded data parallelism over pipeline stages and tensor-parallel shards: FSDP2 units for a
captured model.

With pipeline or tensor parallelism the model runs as stage graphs, not as its modules, so
FSDP2's module hooks cannot sit on the layers themselves. Each FSDP2 unit is a small wrapper
instead, made once at partitioning and kept for every input signature:
- a `LayerUnit` holds one original layer module (so FSDP2 shards that layer's parameters, this
  rank's tensor-parallel shards of them, in place on the layer's own modules) and runs whatever
  piece of a stage graph computes that layer: each signature's stage graph has the layer's nodes
  outlined into a `LayerCall`, which calls the unit with its body;
- a `StageUnit` per stage holds the stage's other parameters (embeddings, final norm, head) and
  runs the whole stage graph; the layer units are its children, so it is FSDP2's root.
Graphs read every sharded parameter through the original module (`_OWNER`), at run time: inside
a unit's forward, that is the gathered tensor FSDP2 put there, never a stale copy.
"""

from __future__ import annotations

from torch import fx, nn

from smp.passes.fx_utils import COMPUTE_OPS, fetch_attr, module_stack
from smp.passes.outline import convex_pieces, outline

_OWNER = "_smp_sharded_owner"  # the original module, as a plain attribute of a graph module


class LayerUnit(nn.Module):
    """FSDP2's unit of one layer: runs a graph piece of it (`body`) between gather and reshard."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, body: nn.Module, *inputs):
        return body(*inputs)


class StageUnit(nn.Module):
    """FSDP2's root unit of one stage: the stage's non-layer parameters (held through the original
    module, the others ignored) and its layer units; runs the stage graph."""

    def __init__(self, module: nn.Module, layers: list[LayerUnit]):
        super().__init__()
        self.model = module
        self.layers = nn.ModuleList(layers)

    def forward(self, gm: nn.Module, *inputs):
        return gm(*inputs)


class LayerCall(nn.Module):
    """A stage graph's call of a layer unit (one per outlined piece)."""

    def __init__(self, unit: LayerUnit, body: fx.GraphModule):
        super().__init__()
        self.body = body
        object.__setattr__(self, "unit", unit)  # not a submodule: the stage does not own the layer

    def forward(self, *inputs):
        return self.unit(self.body, *inputs)


class StageCall(nn.Module):
    """What the pipeline runtime calls for a stage: its graph inside its stage unit."""

    def __init__(self, unit: StageUnit, gm: fx.GraphModule):
        super().__init__()
        self.gm = gm
        object.__setattr__(self, "unit", unit)

    def forward(self, *inputs):
        return self.unit(self.gm, *inputs)


def read_through_owner(gm: fx.GraphModule, module: nn.Module, managed: set[str]) -> None:
    """Makes `gm` read the parameters named in `managed` (original-module names) from `module` at
    run time, and drops its own references to them (which would keep the unsharded tensors)."""
    object.__setattr__(gm, _OWNER, module)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in managed:
            _drop_slot(gm, node.target)
            node.target = f"{_OWNER}.{node.target}"
    gm.recompile()


def outline_layer(
    gm: fx.GraphModule, path: str, unit: LayerUnit, module: nn.Module, prefix: str
) -> list[LayerCall]:
    """Outlines the nodes of `gm` that run inside layer `path`, with its parameter reads, into
    LayerCalls of `unit`; returns them."""
    reads = f"{_OWNER}.{path}."
    members = {n for n in gm.graph.nodes if n.op in COMPUTE_OPS and path in module_stack(n)}
    members |= {
        n
        for n in gm.graph.nodes
        if n.op == "get_attr" and str(n.target).startswith(reads) and n.users and set(n.users) <= members
    }
    calls = []
    for nodes in convex_pieces(gm.graph, members):
        done = outline(gm, nodes, f"{prefix}_{len(calls)}", lambda body: _layer_call(unit, body, module))
        if done is not None:
            calls.append(gm.get_submodule(done.name))
    gm.graph.lint()
    gm.recompile()
    return calls


def reads_outside(gm: fx.GraphModule, path: str) -> list[str]:
    """The layer's parameters that `gm` reads outside the layer's own nodes (after outlining):
    such a layer cannot be its own unit."""
    reads = f"{_OWNER}.{path}."
    return [str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and str(n.target).startswith(reads)]


def _layer_call(unit: LayerUnit, body: fx.GraphModule, module: nn.Module) -> LayerCall:
    # The body was built with copies of the parameters it reads: read them from the module.
    body._modules.pop(_OWNER, None)
    object.__setattr__(body, _OWNER, module)
    return LayerCall(unit, body)


def _drop_slot(gm: fx.GraphModule, target: str) -> None:
    owner_path, _, name = target.rpartition(".")
    try:
        owner = gm.get_submodule(owner_path)
    except AttributeError:
        return
    if name in owner._parameters:
        del owner._parameters[name]


def stage_parameters(gm: fx.GraphModule) -> dict[str, nn.Parameter]:
    """name -> parameter, of the parameters a stage graph reads (its get_attr targets)."""
    found = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            t = fetch_attr(gm, node.target)
            if isinstance(t, nn.Parameter):
                found[str(node.target)] = t
    return found
