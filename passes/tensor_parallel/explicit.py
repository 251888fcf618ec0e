"""Modules that shard their own parameters (smp.nn's distributed modules): the pass must not cut
them a second time, and must report their shards like its own.

Their classes are registered here by name (smp.nn registers every DistributedModule subclass
when it is defined), each with the dimension each of its own parameters is cut along. The
captured graph records, for every node, the modules it runs in with their types' names
(`nn_module_stack`); a module of a registered type owns its parameters (and its submodules'),
so the pass leaves every parameter under its path as it is, even where another module reads it
(a head tied to a distributed embedding). Its cut parameters are returned among the pass's
specs, so the rest of smp treats them as the pass's shards: their gradients are averaged over
the replicas only, every tensor-parallel rank counts them in the global norm, and the model's
state_dict gathers them.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx, nn

from ..fx_utils import fetch_attr
from .layout import ShardSpec

# Type name -> {own parameter name -> the dimension it is cut along} (the cut ones only).
_EXPLICIT_TYPES: dict[str, dict[str, int]] = {}


def register_explicit_module(cls: type, shard_dims: Mapping[str, int] | None = None) -> None:
    """Marks `cls` as a module that shards itself; `shard_dims` names its own parameters that are
    this rank's slices, each with its dimension (contiguous slices in rank order)."""
    _EXPLICIT_TYPES[f"{cls.__module__}.{cls.__qualname__}"] = dict(shard_dims or {})


def _type_name(entry) -> str:
    kind = entry[1]
    return kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"


def explicit_modules(gm: fx.GraphModule) -> dict[str, dict[str, int]]:
    """Path -> its cut parameters' dimensions, for every module of a registered type in `gm`."""
    found = {}
    for node in gm.graph.nodes:
        for entry in (node.meta.get("nn_module_stack") or {}).values():
            if entry[0] and _type_name(entry) in _EXPLICIT_TYPES:
                found[entry[0]] = _EXPLICIT_TYPES[_type_name(entry)]
    return found


def explicit_specs(gm: fx.GraphModule) -> dict[str, ShardSpec]:
    """get_attr target -> how it is cut, for the cut parameters of the registered modules."""
    specs = {}
    for path, dims in explicit_modules(gm).items():
        for name, dim in dims.items():
            target = f"{path}.{name}"
            try:
                value = fetch_attr(gm, target)
            except AttributeError:
                continue  # not read by this graph
            if value is not None:
                specs[target] = ShardSpec(dim)
    return specs


def module_specs(root: nn.Module, degree: int) -> dict[int, ShardSpec]:
    """id(parameter) -> how it is cut, for the cut parameters of the registered modules in `root`
    as built (before any capture; none at tensor-parallel degree 1, where they hold whole tensors)."""
    if degree == 1:
        return {}
    specs = {}
    for module in root.modules():
        dims = _EXPLICIT_TYPES.get(f"{type(module).__module__}.{type(module).__qualname__}", {})
        for name, dim in dims.items():
            param = module._parameters.get(name)
            if param is not None:
                specs[id(param)] = ShardSpec(dim)
    return specs
