"""Delayed parameter initialization: `with smp.delay_param_initialization():`.

Modules built inside the block get their parameters on the meta device (shapes only, no
memory); their buffers are computed by `__init__` as usual (rotary frequencies, causal masks:
values no initializer could give again, and small). smp.DistributedModel captures and partitions
the model on meta parameters, shards it, and then materializes only what this rank keeps, each
module's tensors initialized by the model's own functions: its `reset_parameters()`, and inside a
Hugging Face model the model's `_init_weights` (applied children first, as transformers does: a
block may re-initialize its children, as GPT-2 scales its residual projections).
A shard is seeded from `tensor_parallel_seed`, the module's path and the rank's
`tp_rank` (shards differ across the group, as SMP's did); replicated tensors are
seeded without tp_rank and then taken from the group's first rank, so they agree.
Initializers see the full parameter's fan-in and fan-out, so a row-parallel shard
draws from the same distribution as the whole weight would.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any

import torch
from torch import fx, nn

from smp import params as param_facts


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True):
    """Modules constructed inside get meta parameters, initialized after partitioning (see module
    doc). A parameter is made meta as it is registered, before `__init__` initializes it (so that
    initialization costs nothing); the tensor it was made from (torch.empty) is never touched."""
    if not enabled:
        yield
        return
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def is_delayed(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def to_meta(tree: Any) -> Any:
    """Tensors of `tree` as meta tensors (for capturing a model whose parameters are meta)."""

    def convert(x):
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    return torch.utils._pytree.tree_map(convert, tree)


def retarget(gm: fx.GraphModule, device: torch.device) -> None:
    """A graph captured on meta tensors creates its tensors on `device` instead."""
    meta = torch.device("meta")

    def fix(value):
        return device if isinstance(value, torch.device) and value == meta else value

    # Higher-order ops (torch.no_grad regions, autocast) keep their bodies in nested graph modules.
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            node.args = fx.node.map_aggregate(node.args, fix)
            node.kwargs = fx.node.map_aggregate(node.kwargs, fix)
        sub.recompile()


def materialize(
    root: nn.Module,
    full_shapes: dict[int, torch.Size],
    device: torch.device,
    seed: int,
    tp_rank: int,
    prefix: str = "",
    model: nn.Module | None = None,
) -> dict[int, torch.Tensor]:
    """Allocates and initializes the meta tensors `root` still holds (this rank's part), in new
    tensor objects put in the modules; returns id(meta tensor) -> its replacement, for the other
    holders (stage graphs; an optimizer follows smp.params.current).

    full_shapes: id(shard) -> the shape of the whole parameter, for tensor-parallel shards.
    prefix: `root`'s path in the whole model `model` (default: root itself); each module's seed
    follows its full path, and a Hugging Face model around it gives its initializer.
    """
    model = root if model is None else model
    replaced: dict[int, torch.Tensor] = {}
    modules = list(root.named_modules(remove_duplicate=False, prefix=prefix))
    touched: set[str] = set()  # paths of modules holding, or around, a new tensor
    for path, module in reversed(modules):  # children before their parents, as transformers does
        own = [
            (n, t)
            for n, t in list(module._parameters.items()) + list(module._buffers.items())
            if t is not None
        ]
        hf_init = _hf_initializer(model, path)
        if not any(t.is_meta for _, t in own):
            if hf_init is not None and any(p.startswith(f"{path}.") or not path for p in touched):
                with _seeded(seed, path, False):  # a block that re-initializes its children
                    hf_init(module)
            continue
        if not hasattr(module, "reset_parameters") and hf_init is None:
            names = [f"{path}.{n}" if path else n for n, t in own if t.is_meta]
            raise RuntimeError(
                f"smp: delayed initialization cannot initialize {names} of {type(module).__name__}, which "
                "has no reset_parameters(); build that module outside smp.delay_param_initialization(), "
                "or give it a reset_parameters() that initializes its tensors"
            )
        shapes = {}
        for name, t in own:
            if t.is_meta and id(t) not in replaced:
                replaced[id(t)] = _allocated(t, device)
            if id(t) in replaced:
                new = replaced[id(t)]
                (module._parameters if name in module._parameters else module._buffers)[name] = new
                if id(t) in full_shapes:
                    shapes[id(new)] = full_shapes[id(t)]
        touched.add(path)
        with _seeded(seed + (1_000_003 * tp_rank if shapes else 0), path, True), _full_fans(shapes):
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            if hf_init is not None:
                hf_init(module)
    return replaced


@contextlib.contextmanager
def _seeded(seed: int, path: str, fork: bool):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + zlib.crc32(path.encode()) + (0 if fork else 7))
        yield


def _hf_initializer(model: nn.Module, path: str):
    """The `_init_weights` of the innermost Hugging Face model (a module with a config and
    `_init_weights`) around the module at `path`, or None."""
    found, module = None, model
    parts = path.split(".") if path else []
    for i in range(len(parts) + 1):
        if hasattr(module, "_init_weights") and hasattr(module, "config"):
            found = module._init_weights
        if i < len(parts):
            module = getattr(module, parts[i], None)
            if not isinstance(module, nn.Module):
                break
    return found


def real_buffers_to(module: nn.Module, device: torch.device) -> None:
    """Moves the buffers `__init__` computed (real, beside meta parameters) to `device`."""
    for owner in module.modules():
        for name, t in owner._buffers.items():
            if t is not None and not t.is_meta and t.device != device:
                owner._buffers[name] = t.to(device)


@contextlib.contextmanager
def meta_buffers(module: nn.Module):
    """The module's real buffers swapped for meta copies (a capture on meta parameters sees one
    device); yields id(meta copy) -> the real buffer, for the captured graph (replace_in)."""
    real_of: dict[int, torch.Tensor] = {}
    swapped = []
    for owner in module.modules():
        for name, t in owner._buffers.items():
            if t is not None and not t.is_meta:
                meta = t.to("meta")
                real_of[id(meta)] = t
                swapped.append((owner, name, meta))
    for owner, name, meta in swapped:
        owner._buffers[name] = meta
    try:
        yield real_of
    finally:
        for owner, name, meta in swapped:
            owner._buffers[name] = real_of[id(meta)]


def replace_in(module: nn.Module, replaced: dict[int, torch.Tensor]) -> None:
    """Points every parameter and buffer slot of `module` (a graph module) at the replacements."""
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for name, t in list(table.items()):
                if t is not None and id(t) in replaced:
                    table[name] = replaced[id(t)]


def _allocated(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor to replace a meta one (whose .data cannot become real in place)."""
    real = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    if isinstance(tensor, nn.Parameter):
        real = nn.Parameter(real, requires_grad=tensor.requires_grad)
        real.__dict__.update(tensor.__dict__)  # smp's marks
        real.__dict__.pop("_is_hf_initialized", None)  # (transformers skips flagged tensors)
        param_facts.mark_moved(tensor, real)
    return real


@contextlib.contextmanager
def _full_fans(full_shapes: dict[int, torch.Size]):
    original = nn.init._calculate_fan_in_and_fan_out

    def fans(tensor):
        shape = full_shapes.get(id(tensor))
        return original(torch.empty(shape, device="meta") if shape is not None else tensor)

    nn.init._calculate_fan_in_and_fan_out = fans
    try:
        yield
    finally:
        nn.init._calculate_fan_in_and_fan_out = original
