"""The rewrite context: one pass over the original graph that emits the local graph node by node.

Rules (rules/*.py, looked up in registry.py) decide what each op becomes; this module holds
what they share: the original -> local node map and every value's layout, emitting nodes,
converting a value between layouts (gather, split), which parameters get cut how, and the
Demote signal that restarts the pass with a module or parameter kept replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from ..fx_utils import fetch_attr, module_stack, parent_path
from . import registry
from .explicit import explicit_modules
from .layout import Layout, Shard, ShardSpec, local_val

aten = torch.ops.aten


class Demote(Exception):
    """Raised by a rule when `key` (a module path or a parameter name) must stay replicated;
    the pass then starts over with the key in `replicated` (see tensor_parallel())."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}")
        self.key, self.reason = key, reason


class Rewrite:
    """One attempt at the rewrite; rules read and extend its state through the methods below."""

    def __init__(
        self,
        gm: fx.GraphModule,
        group_name: str,
        size: int,
        rank: int,
        marked: Collection[str],
        replicated: Mapping[str, str],
        scatter_batch: int | None,
    ):
        self.gm, self.size, self.rank = gm, size, rank
        self.group = group_name  # the smp ops find the process group by its name
        self.marked = marked
        # A replicated module keeps every layer under it whole; a replicated parameter stays whole.
        self.demoted_modules = {k for k in replicated if not _is_tensor_attr(gm, k)}
        self.pinned = {k for k in replicated if _is_tensor_attr(gm, k)}
        self.scatter_batch = scatter_batch
        self.graph = fx.Graph()
        self.env: dict[str, fx.Node] = {}  # original node name -> its local node
        self.layout: dict[str, Layout] = {}  # original node name -> the layout of its local node
        self.origin: dict[str, str] = {}  # sharded value -> module of the linear that sharded it
        self.specs: dict[str, ShardSpec] = {}  # get_attr target -> how it is cut
        self.replicated_uses: dict[str, str] = {}  # parameter -> a node that reads it whole
        self._cache: dict[tuple[str, Any], fx.Node] = {}  # (original node name, what) -> local node
        self.current: fx.Node | None = None  # the original node being rewritten
        self.trainable = _trainable_values(gm)  # original nodes whose value depends on a parameter
        # Paths of the modules that shard themselves (smp.nn's): the pass leaves their parameters alone.
        self.explicit = set(explicit_modules(gm))

    def run(self) -> fx.Graph:
        for node in self.gm.graph.nodes:
            self.current = node
            if node.op == "placeholder":
                self.copy(node, None)
            elif node.op == "get_attr":
                self.env[node.name] = self.graph.get_attr(node.target)
                self.env[node.name].meta = dict(node.meta)
                self.layout[node.name] = None
            elif node.op == "output":
                self._output(node)
            elif node.op == "call_function":
                self._call(node)
            else:
                self.generic(node)
        self.graph.lint()
        return self.graph

    def _call(self, node: fx.Node) -> None:
        found = registry.lookup(node.target)
        if found is None:
            self.generic(node)
        else:
            found.apply(self, node)

    # --- emitting ---------------------------------------------------------------

    def emit(self, target, args, kwargs=None, val=None) -> fx.Node:
        """A new node serving the current original node; `val` is its fake value (else inferred)."""
        node = self.graph.create_node("call_function", target, tuple(args), dict(kwargs or {}))
        node.meta = {k: v for k, v in self.current.meta.items() if k in ("nn_module_stack", "stack_trace")}
        node.meta["smp_tp_origin"] = self.current.name
        node.meta["val"] = val if val is not None else _infer_val(node)
        return node

    def copy(self, node: fx.Node, layout: Layout, args=None, kwargs=None) -> None:
        """The node itself on local values (by default its inputs replicated); `layout` describes
        its result."""
        if args is None:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: self.arg(n, None))
        if layout is not None:
            args, kwargs = self._sum_grads_of_replicated(node, args, kwargs)
        new = self.graph.create_node(node.op, node.target, tuple(args), dict(kwargs or {}), name=node.name)
        new.meta = dict(node.meta)
        new.meta["smp_tp_origin"] = node.name
        if "val" in node.meta:
            new.meta["val"] = local_val(node.meta["val"], layout, self.size)
        self.env[node.name] = new
        self.layout[node.name] = layout

    def _sum_grads_of_replicated(self, node: fx.Node, args, kwargs):
        """A replicated operand that depends on parameters (a QK-norm weight applied to sharded
        heads), read by an op whose result is sharded, meets only this rank's slice: each rank
        computes only its slice's share of the operand's gradient. tp_copy (identity forward,
        all-reduce backward) sums the shares, so every replicated parameter read inside a
        sharded region gets its whole gradient on every rank."""
        plain = {
            self.env[n.name]: n
            for n in node.all_input_nodes
            if self.layout.get(n.name) is None and n.name in self.trainable
        }
        if not plain:
            return args, kwargs

        def summed(local: fx.Node) -> fx.Node:
            original = plain.get(local)
            if original is None:
                return local
            return self.cached(
                (original.name, "grad_sum"),
                lambda: self.emit(
                    torch.ops.smp.tp_copy.default, (local, self.group), val=original.meta.get("val")
                ),
            )

        return fx.node.map_arg((tuple(args), dict(kwargs or {})), summed)

    def set(self, node: fx.Node, new: fx.Node, layout: Layout) -> None:
        """Records `new` (emitted by a rule) as the local value of `node`, in `layout`."""
        new.meta["val"] = local_val(node.meta.get("val"), layout, self.size)
        self.env[node.name] = new
        self.layout[node.name] = layout

    def keep(self, node: fx.Node, dim: int, blocks: int = 1, args=None) -> None:
        """The node on its first input's shards (the other inputs replicated), its result sharded
        on `dim`; `args` replaces the node's arguments (sizes made local), the first one ignored."""
        args = list(args if args is not None else node.args)
        args[0] = self.env[node.args[0].name]
        kwargs = fx.node.map_arg(node.kwargs, lambda n: self.arg(n, None))
        self.copy(node, Shard(dim, blocks), args, kwargs)
        if node.args[0].name in self.origin:
            self.origin[node.name] = self.origin[node.args[0].name]

    def generic(self, node: fx.Node) -> None:
        """The fallback that is always right: inputs gathered, the node run whole."""
        if node.target is aten._assert_tensor_metadata.default and self.layout.get(node.args[0].name):
            return  # checks the full shape of a value now held in slices
        self.copy(node, None)

    def cached(self, key: tuple[str, Any], make: Callable[[], fx.Node]) -> fx.Node:
        """One node per key for the whole graph: a value converted once serves all its readers."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    # --- inputs -----------------------------------------------------------------

    def arg(self, node: fx.Node, want: Layout) -> fx.Node:
        """The local value of an original node in layout `want`, converting when it differs."""
        have = self.layout[node.name]
        if have == want:
            if want is None and node.op == "get_attr":
                self._read_whole(node)
            return self.env[node.name]

        def convert() -> fx.Node:
            value = self.env[node.name]
            if have is not None:
                value = self._gather(node, value, have)
            if want is not None:
                value = self._split(node, value, want)
            return value

        return self.cached((node.name, want), convert)

    def local_args(self, node: fx.Node):
        """The node's (args, kwargs) with sharded inputs as they are and the others replicated."""
        return fx.node.map_arg(
            (node.args, node.kwargs),
            lambda n: self.env[n.name] if self.layout[n.name] else self.arg(n, None),
        )

    def sharded_input(self, node: fx.Node, plain_blocks: bool = True) -> Shard | None:
        """The layout of the node's first input when it is sharded. Otherwise the node is emitted
        here (replicated, or gathered when `plain_blocks` and the input has blocks) and None
        tells the rule it is done."""
        layout = self.layout[node.args[0].name]
        if layout is None:
            self.copy(node, None)
            return None
        if plain_blocks and layout.blocks != 1:
            self.generic(node)
            return None
        return layout

    def _gather(self, node: fx.Node, value: fx.Node, layout: Shard) -> fx.Node:
        dim, blocks = layout
        full = node.meta["val"]
        if blocks == 1:
            return self.emit(torch.ops.smp.tp_gather.default, (value, dim, self.group), val=full)
        # Gather each block on its own axis, so the parts come back in place.
        local = local_val(full, layout, self.size)
        parts = self.emit(aten.unflatten.int, (value, dim, [blocks, local.shape[dim] // blocks]))
        gathered = self.emit(torch.ops.smp.tp_gather.default, (parts, dim + 1, self.group))
        return self.emit(aten.flatten.using_ints, (gathered, dim, dim + 1), val=full)

    def _split(self, node: fx.Node, value: fx.Node, layout: Shard) -> fx.Node:
        assert layout.blocks == 1
        val = local_val(node.meta["val"], layout, self.size)
        return self.emit(torch.ops.smp.tp_split.default, (value, layout.dim, 1.0, self.group), val=val)

    # --- parameters -------------------------------------------------------------

    def shardable(self, node: fx.Node, attr: fx.Node) -> bool:
        """Whether `node` may cut the parameter `attr`: a trainable parameter read by a layer of
        a marked module under no replicated module, and not itself kept replicated."""
        if attr.op != "get_attr" or attr.target in self.pinned:
            return False
        if not isinstance(fetch_attr(self.gm, attr.target), nn.Parameter):
            return False  # a buffer (or constant) weight stays whole
        if any(attr.target.startswith(path + ".") for path in self.explicit):
            return False  # an smp.nn distributed module's: already this rank's shard, or whole by design
        stack = module_stack(node)
        if not stack or stack[-1] not in self.marked:
            return False
        # A demoted module covers every path under it (a ModuleList is demoted by its own path,
        # which no node's stack holds: only its layers run).
        return not any(p == d or p.startswith(d + ".") for p in stack for d in self.demoted_modules)

    def add_spec(self, attr: fx.Node, spec: ShardSpec) -> None:
        """Cuts parameter `attr` by `spec`; a parameter also read whole, or cut two ways, is demoted."""
        target = attr.target
        if target in self.replicated_uses:
            raise Demote(target, _shared_reason(target, self.replicated_uses[target]))
        if self.specs.setdefault(target, spec) != spec:
            raise Demote(target, f"{target} would be split two ways ({self.specs[target]} and {spec})")
        # The new graph reads this rank's shard: its recorded value is the shard's, so the ops
        # emitted over it are inferred on local shapes (never on a whole weight beside local ones).
        new = self.env.get(attr.name)
        if new is not None and new.meta.get("val") is not None:
            new.meta["val"] = local_val(attr.meta["val"], Shard(spec.dim, spec.blocks), self.size)

    def _read_whole(self, attr: fx.Node) -> None:
        if attr.target in self.specs:
            raise Demote(attr.target, _shared_reason(attr.target, self.current.name))
        self.replicated_uses.setdefault(attr.target, self.current.name)

    def demote_block(self, node: fx.Node, reason: str) -> None:
        """Keeps the block that holds `node` replicated: its module, when that module holds the
        linear that sharded the input, else the linear's parent module."""
        stack = module_stack(node)
        origin = self.origin.get(node.args[0].name, "")
        block = stack[-1] if stack else ""
        if not block or not origin.startswith(block + "."):
            block = parent_path(origin)
        raise Demote(block or "<root>", reason)

    # --- outputs ----------------------------------------------------------------

    def _output(self, node: fx.Node) -> None:
        """Model outputs leave whole, or cut back to this rank's rows of a combined batch."""

        def leaf(n: fx.Node) -> fx.Node:
            value = self.arg(n, None)
            val = n.meta.get("val")
            if (
                self.scatter_batch
                and isinstance(val, torch.Tensor)
                and val.dim() >= 1
                and val.shape[0] % self.scatter_batch == 0
            ):
                local = val.new_empty((val.shape[0] // self.size, *val.shape[1:]))
                value = self.emit(
                    torch.ops.smp.tp_split.default, (value, 0, 1.0 / self.size, self.group), val=local
                )
            return value

        self.graph.output(fx.node.map_arg(node.args[0], leaf))


def _shared_reason(target: str, reader: str) -> str:
    return f"{target} is also read whole by '{reader}', which is not tensor-parallel"


def _infer_val(node: fx.Node):
    """The node's result on the fake values of its inputs, computed by their fake mode alone.

    Inside the mode and below autograd, an op reaches only its fake (or meta) kernel. Called plainly
    on fakes, an smp op would first run its C++ Autograd kernel: an autograd node over the fake
    parameters (which require grad, as torch.export records them), then the C++ forward on the fakes,
    which throws from inside the kernel on the local-and-whole mixes this pass asks about. That
    call killed every rank with SIGSEGV on a GPU (issue 31), while the same throw was caught on CPU.
    """
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    fakes = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, FakeTensor)]
    if not fakes:
        return None  # nothing recorded to infer from: leave it unknown, never run a real kernel
    try:
        with fakes[0].fake_mode, torch._C._AutoDispatchBelowAutograd():
            return node.target(*args, **kwargs)
    except Exception:  # values the op refuses (or an input without a recorded value): unknown
        return None


def _trainable_values(gm: fx.GraphModule) -> set[str]:
    """Names of the original nodes whose value depends on a parameter that requires grad."""
    found: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = fetch_attr(gm, node.target)
            if isinstance(value, nn.Parameter) and value.requires_grad:
                found.add(node.name)
        elif any(a.name in found for a in node.all_input_nodes):
            found.add(node.name)
    return found


def _is_tensor_attr(gm: fx.GraphModule, key: str) -> bool:
    """Whether a `replicated` key names a parameter or buffer (else it names a module)."""
    try:
        return isinstance(fetch_attr(gm, key), torch.Tensor)
    except AttributeError:
        return False
