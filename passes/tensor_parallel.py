"""Tensor parallelism: rewrites a captured graph so its marked layers run sharded over a TP group.

Every value of the rewritten graph has a layout, the same on each rank of the group:
replicated (each rank holds the whole tensor) or sharded on one dimension (rank r holds
the r-th of `size` contiguous slices; with blocks > 1, the r-th slice of each of `blocks`
equal parts, as a fused q/k/v projection needs). Parameters and inputs start replicated.

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

A block whose head count or feature count does not divide by the group size stays
replicated (reported in `TensorParallelResult.replicated`), as does a parameter that
some unmarked code also reads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Collection
from typing import Any

import torch
from torch import fx, nn

aten = torch.ops.aten

Layout = tuple[int, int] | None  # (sharded dim, blocks), or None for replicated


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How a parameter is split over the group: along `dim`, each of `blocks` parts separately."""

    dim: int
    blocks: int = 1

    def local(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        parts = full.unflatten(self.dim, (self.blocks, -1))
        return parts.chunk(size, dim=self.dim + 1)[rank].flatten(self.dim, self.dim + 1).contiguous()

    def full(self, shards: list[torch.Tensor]) -> torch.Tensor:
        parts = [s.unflatten(self.dim, (self.blocks, -1)) for s in shards]
        return torch.cat(parts, dim=self.dim + 1).flatten(self.dim, self.dim + 1)


@dataclasses.dataclass
class TensorParallelResult:
    # get_attr target -> how that parameter is split; the graph module now holds the local shards.
    specs: dict[str, ShardSpec]
    # id(original full tensor) -> its local shard (pass it to the next call to share shards).
    shards: dict[int, nn.Parameter]
    # Module path or parameter name -> why it stays replicated.
    replicated: dict[str, str]


class _Demote(Exception):
    def __init__(self, key: str, reason: str):
        super().__init__(reason)
        self.key, self.reason = key, reason


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
    for _ in range(1000):
        rewrite = _Rewrite(gm, group.group_name, size, rank, set(marked), replicated, scatter_batch)
        try:
            graph = rewrite.run()
            break
        except _Demote as demote:
            if demote.key in replicated:
                raise RuntimeError(f"smp tensor parallelism: {demote.key} demoted twice") from demote
            replicated[demote.key] = demote.reason
    shards = {} if shards is None else shards
    for target, spec in rewrite.specs.items():
        full = _fetch(gm, target)
        if id(full) not in shards:
            with torch.no_grad():
                local = spec.local(full.detach(), rank, size)
            shards[id(full)] = nn.Parameter(local, requires_grad=full.requires_grad)
        _assign(gm, target, shards[id(full)])
    gm.graph = graph
    gm.recompile()
    return TensorParallelResult(dict(rewrite.specs), shards, replicated)


class _Rewrite:
    """One pass over the original graph, emitting the local graph node by node."""

    def __init__(self, gm, group_name, size, rank, marked, replicated, scatter_batch):
        self.gm, self.group, self.size, self.rank = gm, group_name, size, rank
        self.marked = marked
        self.demoted_modules = {k for k in replicated if not _is_param_key(gm, k)}
        self.pinned = {k for k in replicated if _is_param_key(gm, k)}
        self.scatter_batch = scatter_batch
        self.graph = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.layout: dict[str, Any] = {}
        self.origin: dict[str, str] = {}  # sharded value -> module of the linear that sharded it
        self.specs: dict[str, ShardSpec] = {}
        self.replicated_uses: dict[str, str] = {}  # parameter -> a node that reads it whole
        self.converted: dict[tuple[str, Any], fx.Node] = {}
        self.current: fx.Node | None = None

    # --- driver -----------------------------------------------------------------

    def run(self) -> fx.Graph:
        for node in self.gm.graph.nodes:
            self.current = node
            if node.op == "placeholder":
                self._copy(node, None)
            elif node.op == "get_attr":
                self.env[node.name] = self.graph.get_attr(node.target)
                self.env[node.name].meta = dict(node.meta)
                self.layout[node.name] = None
            elif node.op == "output":
                self._output(node)
            elif node.op == "call_function":
                self._call(node)
            else:
                self._generic(node)
        self.graph.lint()
        return self.graph

    def _call(self, node: fx.Node) -> None:
        t = node.target
        handler = _HANDLERS.get(t)
        if handler is not None:
            handler(self, node)
        elif t is operator.getitem:
            self._getitem(node)
        elif isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
            self._pointwise(node)
        else:
            self._generic(node)

    # --- emitting ---------------------------------------------------------------

    def _emit(self, target, args, kwargs=None, val=None) -> fx.Node:
        node = self.graph.create_node("call_function", target, tuple(args), dict(kwargs or {}))
        node.meta = {k: v for k, v in self.current.meta.items() if k in ("nn_module_stack", "stack_trace")}
        node.meta["smp_tp_origin"] = self.current.name
        node.meta["val"] = val if val is not None else _infer_val(node)
        return node

    def _copy(self, node: fx.Node, layout, args=None, kwargs=None) -> None:
        """The node itself on local values; `layout` describes its result."""
        if args is None:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: self._arg(n, None))
        new = self.graph.create_node(node.op, node.target, tuple(args), dict(kwargs or {}), name=node.name)
        new.meta = dict(node.meta)
        new.meta["smp_tp_origin"] = node.name
        if "val" in node.meta:
            new.meta["val"] = _local_val(node.meta["val"], layout, self.size)
        self.env[node.name] = new
        self.layout[node.name] = layout

    def _arg(self, node: fx.Node, want: Layout) -> fx.Node:
        """The local value of an original node in layout `want`, converting when it differs."""
        have = self.layout[node.name]
        if have == want:
            if want is None and node.op == "get_attr":
                self._read_whole(node)
            return self.env[node.name]
        key = (node.name, want)
        if key not in self.converted:
            value = self.env[node.name]
            if have is not None:
                value = self._gather(node, value, have)
            if want is not None:
                value = self._split(node, value, want)
            self.converted[key] = value
        return self.converted[key]

    def _gather(self, node, value, layout) -> fx.Node:
        dim, blocks = layout
        full = node.meta["val"]
        if blocks == 1:
            return self._emit(torch.ops.smp.tp_gather.default, (value, dim, self.group), val=full)
        local = _local_val(full, layout, self.size)
        parts = self._emit(aten.unflatten.int, (value, dim, [blocks, local.shape[dim] // blocks]))
        gathered = self._emit(torch.ops.smp.tp_gather.default, (parts, dim + 1, self.group))
        return self._emit(aten.flatten.using_ints, (gathered, dim, dim + 1), val=full)

    def _split(self, node, value, layout) -> fx.Node:
        dim, blocks = layout
        assert blocks == 1
        val = _local_val(node.meta["val"], layout, self.size)
        return self._emit(torch.ops.smp.tp_split.default, (value, dim, 1.0, self.group), val=val)

    def _read_whole(self, attr: fx.Node) -> None:
        if attr.target in self.specs:
            raise _Demote(attr.target, self._shared_reason(attr.target, self.current.name))
        self.replicated_uses.setdefault(attr.target, self.current.name)

    def _shared_reason(self, target: str, reader: str) -> str:
        return f"{target} is also read whole by '{reader}', which is not tensor-parallel"

    def _add_spec(self, attr: fx.Node, spec: ShardSpec) -> None:
        target = attr.target
        if target in self.replicated_uses:
            raise _Demote(target, self._shared_reason(target, self.replicated_uses[target]))
        if self.specs.setdefault(target, spec) != spec:
            raise _Demote(target, f"{target} would be split two ways ({self.specs[target]} and {spec})")

    def _generic(self, node: fx.Node) -> None:
        if node.target is aten._assert_tensor_metadata.default and self.layout.get(node.args[0].name):
            return  # checks the full shape of a value now held in slices
        self._copy(node, None)

    # --- marking ----------------------------------------------------------------------

    def _shardable(self, node: fx.Node, attr: fx.Node) -> bool:
        if attr.op != "get_attr" or attr.target in self.pinned:
            return False
        if not isinstance(_fetch(self.gm, attr.target), nn.Parameter):
            return False  # a buffer (or constant) weight stays whole
        stack = _module_stack(node)
        if not stack or stack[-1] not in self.marked:
            return False
        return not any(path in self.demoted_modules for path in stack)

    def _demote_block(self, node: fx.Node, reason: str) -> None:
        """Keeps the block that holds `node` replicated: its module, when that module holds the
        linear that sharded the input, else the linear's parent module."""
        stack = _module_stack(node)
        origin = self.origin.get(node.args[0].name, "")
        block = stack[-1] if stack else ""
        if not block or not origin.startswith(block + "."):
            block = _parent(origin)
        raise _Demote(block or "<root>", reason)

    # --- layers -----------------------------------------------------------------------

    def _linear(self, node: fx.Node) -> None:
        x, weight = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        self._linear_layer(node, x, weight, bias, transposed=False)

    def _addmm(self, node: fx.Node) -> None:
        """addmm(bias, x, weight) with a [in, out] weight: HF's Conv1D (GPT-2) is a linear layer."""
        bias, x, weight = node.args[:3]
        bound = _bound(node)
        plain = bound["beta"] == 1 and bound["alpha"] == 1 and bias.meta["val"].dim() == 1
        if not plain:
            return self._generic(node)
        self._linear_layer(node, x, weight, bias, transposed=True)

    def _linear_layer(self, node: fx.Node, x: fx.Node, weight: fx.Node, bias, transposed: bool) -> None:
        """x @ W^T + b (or x @ W + b when `transposed`, the weight stored [in, out])."""
        if not self._shardable(node, weight):
            return self._generic(node)
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        out_features = weight.meta["val"].shape[out_dim]
        x_nd = x.meta["val"].dim()
        if self.layout[x.name] == (x_nd - 1, 1):  # input sharded on its features: row-parallel
            self._add_spec(weight, ShardSpec(in_dim))
            w = self._weight(weight, ShardSpec(in_dim), transposed)
            args = (self.env[x.name], w, self._arg(bias, None) if bias else None)
            new = self._emit(torch.ops.smp.row_parallel_linear.default, (*args, self.group))
            self._set(node, new, None)
            return
        if not _shards_pay_off(node):
            return self._generic(node)  # its output would only be gathered again
        blocks = _fused_blocks(node)
        if (out_features // blocks) % self.size:
            raise _Demote(
                _parent(_module_stack(node)[-1]) or _module_stack(node)[-1],
                f"the {out_features} output features of {_module_stack(node)[-1]} do not divide by "
                f"tensor_parallel_degree={self.size}",
            )
        self._add_spec(weight, ShardSpec(out_dim, blocks))
        if bias is not None:
            self._add_spec(bias, ShardSpec(0, blocks))
        local = (
            self._weight(weight, ShardSpec(out_dim, blocks), transposed),
            self.env[bias.name] if bias else None,
        )
        if self._column_readers(x) > 1:
            # q/k/v or gate/up on one input: one copy whose backward all-reduces once for all.
            key = (x.name, "copy")
            if key not in self.converted:
                self.converted[key] = self._emit(
                    torch.ops.smp.tp_copy.default, (self._arg(x, None), self.group)
                )
            new = self._emit(aten.linear.default, (self.converted[key], *local))
        else:
            new = self._emit(
                torch.ops.smp.column_parallel_linear.default, (self._arg(x, None), *local, self.group)
            )
        self._set(node, new, (node.meta["val"].dim() - 1, blocks))
        self.origin[node.name] = _module_stack(node)[-1]

    def _weight(self, weight: fx.Node, spec: ShardSpec, transposed: bool) -> fx.Node:
        """The local shard as a [out, in] linear weight."""
        if not transposed:
            return self.env[weight.name]
        local = _local_val(weight.meta["val"], (spec.dim, spec.blocks), self.size)
        return self._emit(aten.t.default, (self.env[weight.name],), val=local.t())

    def _column_readers(self, x: fx.Node) -> int:
        """How many marked linears read `x` as a replicated input (column-parallel candidates)."""
        if self.layout[x.name] is not None:
            return 0
        return sum(
            1
            for user in x.users
            if (
                user.target is aten.linear.default
                and user.args[0] is x
                and self._shardable(user, user.args[1])
            )
            or (
                user.target is aten.addmm.default
                and user.args[1] is x
                and self._shardable(user, user.args[2])
            )
        )

    def _embedding(self, node: fx.Node) -> None:
        weight, indices = node.args[0], node.args[1]
        bound = _bound(node)
        padding_idx = bound["padding_idx"]
        scale_by_freq, sparse = bound["scale_grad_by_freq"], bound["sparse"]
        if not self._shardable(node, weight) or scale_by_freq or sparse:
            return self._generic(node)
        vocab = weight.meta["val"].shape[0]
        if vocab % self.size:
            raise _Demote(
                _module_stack(node)[-1],
                f"its vocabulary of {vocab} does not divide by tensor_parallel_degree={self.size}",
            )
        self._add_spec(weight, ShardSpec(0))
        start = self.rank * (vocab // self.size)
        args = (self._arg(indices, None), self.env[weight.name], start, padding_idx, self.group)
        self._set(node, self._emit(torch.ops.smp.vocab_parallel_embedding.default, args), None)

    def _cross_entropy(self, node: fx.Node) -> None:
        logits, target = node.args[0], node.args[1]
        bound = _bound(node)
        weight, reduction, ignore_index = bound["weight"], bound["reduction"], bound["ignore_index"]
        smoothing = bound["label_smoothing"]
        class_dim = 1 if logits.meta["val"].dim() > 1 else 0
        if self.layout[logits.name] != (class_dim, 1) or weight is not None or smoothing:
            return self._generic(node)
        local = self.env[logits.name]
        if class_dim and logits.meta["val"].dim() > 2:
            local = self._emit(aten.movedim.int, (local, 1, -1))
        vocab_local = logits.meta["val"].shape[class_dim] // self.size
        labels = self._arg(target, None)
        losses = self._emit(
            torch.ops.smp.vocab_parallel_cross_entropy.default,
            (local, labels, self.rank * vocab_local, ignore_index, self.group),
        )
        if reduction == 0:
            result = losses
        elif reduction == 2:
            result = self._emit(aten.sum.default, (losses,))
        else:  # mean over the targets that are not ignored, as torch does
            total = self._emit(aten.sum.default, (losses,))
            kept = self._emit(aten.ne.Scalar, (labels, ignore_index))
            count = self._emit(aten.sum.default, (kept,))
            result = self._emit(aten.div.Tensor, (total, count))
        self._set(node, result, None)

    # --- layout-preserving ops ----------------------------------------------------------

    def _pointwise(self, node: fx.Node) -> None:
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor):
            return self._generic(node)
        found = set()
        for arg in node.all_input_nodes:
            layout = self.layout[arg.name]
            if layout is not None:
                found.add((layout[0] + out.dim() - arg.meta["val"].dim(), layout[1]))
        if not found:
            return self._copy(node, None)
        if len(found) > 1:
            return self._generic(node)
        ((dim, blocks),) = found
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            if self.layout[arg.name] is None and isinstance(val, torch.Tensor):
                aligned = dim - (out.dim() - val.dim())
                if aligned >= 0 and val.shape[aligned] != 1:
                    return self._generic(node)  # a full-size replicated operand: gather the others
        self._copy(node, (dim, blocks), *self._local_args(node))

    def _local_args(self, node: fx.Node):
        return fx.node.map_arg(
            (node.args, node.kwargs),
            lambda n: self.env[n.name] if self.layout[n.name] else self._arg(n, None),
        )

    def _sharded_input(self, node: fx.Node, plain_blocks: bool = True):
        """The (dim, blocks) of the first argument, or None (then the node is copied replicated)."""
        layout = self.layout[node.args[0].name]
        if layout is None:
            self._copy(node, None)
            return None
        if plain_blocks and layout[1] != 1:
            self._generic(node)
            return None
        return layout

    def _keep(self, node: fx.Node, dim: int, blocks: int = 1, args=None) -> None:
        args = list(args if args is not None else node.args)
        args[0] = self.env[node.args[0].name]
        kwargs = fx.node.map_arg(node.kwargs, lambda n: self._arg(n, None))
        self._copy(node, (dim, blocks), args, kwargs)
        if node.args[0].name in self.origin:
            self.origin[node.name] = self.origin[node.args[0].name]

    def _view(self, node: fx.Node) -> None:
        layout = self._sharded_input(node, plain_blocks=False)
        if layout is None:
            return
        before, after = list(node.args[0].meta["val"].shape), list(node.meta["val"].shape)
        dim = _view_dim(before, after, layout[0])
        if dim is None or (layout[1] != 1 and after[dim] != before[layout[0]]):
            return self._generic(node)  # blocks survive only a view that keeps their dimension
        if after[dim] % self.size:
            self._demote_block(
                node,
                f"it splits {before[layout[0]]} features into {after[dim]} parts (heads), which do not "
                f"divide by tensor_parallel_degree={self.size}",
            )
        sizes = list(after)
        sizes[dim] //= self.size
        self._keep(node, dim, layout[1], args=(None, sizes, *node.args[2:]))

    def _transpose(self, node: fx.Node) -> None:
        layout = self._sharded_input(node, plain_blocks=False)
        if layout is None:
            return
        nd = node.args[0].meta["val"].dim()
        if node.target is aten.t.default:
            a, b = 0, 1
        else:
            a, b = (d % nd for d in node.args[1:3])
        dim = {a: b, b: a}.get(layout[0], layout[0])
        self._keep(node, dim, layout[1])

    def _permute(self, node: fx.Node) -> None:
        layout = self._sharded_input(node, plain_blocks=False)
        if layout is not None:
            nd = node.args[0].meta["val"].dim()
            self._keep(node, [d % nd for d in node.args[1]].index(layout[0]), layout[1])

    def _unsqueeze(self, node: fx.Node) -> None:
        layout = self._sharded_input(node, plain_blocks=False)
        if layout is not None:
            where = node.args[1] % node.meta["val"].dim()
            self._keep(node, layout[0] + (where <= layout[0]), layout[1])

    def _squeeze(self, node: fx.Node) -> None:
        layout = self._sharded_input(node, plain_blocks=False)
        if layout is None:
            return
        before = node.args[0].meta["val"].shape
        dims = node.args[1] if len(node.args) > 1 else range(len(before))
        dims = [dims] if isinstance(dims, int) else dims
        removed = {d % len(before) for d in dims if before[d] == 1}
        self._keep(node, layout[0] - sum(d < layout[0] for d in removed), layout[1])

    def _expand(self, node: fx.Node) -> None:
        layout = self._sharded_input(node)
        if layout is None:
            return
        sizes = list(node.args[1])
        dim = layout[0] + len(sizes) - node.args[0].meta["val"].dim()
        if sizes[dim] != -1:
            sizes[dim] //= self.size
        self._keep(node, dim, args=(None, sizes, *node.args[2:]))

    def _slice(self, node: fx.Node) -> None:
        layout = self._sharded_input(node, plain_blocks=False)
        if layout is None:
            return
        shape = node.args[0].meta["val"].shape
        dim = (node.args[1] if len(node.args) > 1 else 0) % len(shape)
        if dim == layout[0] and node.meta["val"].shape[dim] != shape[dim]:
            return self._generic(node)
        self._keep(node, layout[0], layout[1])

    def _unchanged(self, node: fx.Node) -> None:
        """Ops that keep every dimension (copies, dtype casts, dropout)."""
        layout = self._sharded_input(node, plain_blocks=False)
        if layout is not None:
            self._keep(node, *layout)

    def _along_dim(self, node: fx.Node) -> None:
        """softmax-like ops: fine unless they work along the sharded dimension."""
        layout = self._sharded_input(node, plain_blocks=False)
        if layout is None:
            return
        if node.args[1] % node.args[0].meta["val"].dim() == layout[0]:
            return self._generic(node)
        self._keep(node, *layout)

    def _reduce(self, node: fx.Node) -> None:
        layout = self._sharded_input(node, plain_blocks=False)
        if layout is None:
            return
        nd = node.args[0].meta["val"].dim()
        dims = node.args[1] if len(node.args) > 1 else None
        dims = [dims] if isinstance(dims, int) else dims
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if not dims or layout[0] in {d % nd for d in dims}:
            return self._generic(node)
        shift = 0 if keepdim else sum(d % nd < layout[0] for d in dims)
        self._keep(node, layout[0] - shift, layout[1])

    def _layer_norm(self, node: fx.Node) -> None:
        layout = self._sharded_input(node, plain_blocks=False)
        if layout is None:
            return
        if layout[0] >= node.args[0].meta["val"].dim() - len(node.args[1]):
            return self._generic(node)
        self._keep(node, *layout)

    def _cat(self, node: fx.Node) -> None:
        tensors = node.args[0]
        nd = node.meta["val"].dim()
        dim = (node.args[1] if len(node.args) > 1 else 0) % nd
        layouts = {self.layout[t.name] for t in tensors}
        if len(layouts) != 1 or None in layouts or next(iter(layouts))[0] == dim:
            return self._generic(node) if layouts != {None} else self._copy(node, None)
        ((sharded, blocks),) = layouts
        args = ([self.env[t.name] for t in tensors], *node.args[1:])
        self._copy(node, (sharded, blocks), args, {})

    def _split_op(self, node: fx.Node) -> None:
        layout = self.layout[node.args[0].name]
        parts = node.meta["val"]
        if layout is None:
            return self._copy(node, None)
        shape = node.args[0].meta["val"].shape
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(shape)
        if dim != layout[0]:
            args = (self.env[node.args[0].name], *node.args[1:])
            self._copy(node, [layout] * len(parts), args, node.kwargs)
            return
        sizes = [p.shape[dim] for p in parts]
        if layout[1] != len(parts) or len(set(sizes)) != 1:
            return self._generic(node)
        second = node.args[1]
        if node.target is aten.split.Tensor:
            second = second // self.size
        elif node.target is aten.split_with_sizes.default:
            second = [s // self.size for s in second]
        args = (self.env[node.args[0].name], second, *node.args[2:])
        self._copy(node, [(dim, 1)] * len(parts), args, node.kwargs)
        for i in range(len(parts)):
            self.origin[f"{node.name}[{i}]"] = self.origin.get(node.args[0].name, "")

    def _getitem(self, node: fx.Node) -> None:
        source, index = node.args
        layouts = self.layout.get(source.name)
        layout = layouts[index] if isinstance(layouts, list) else None
        self._copy(node, layout, (self.env[source.name], index), {})
        if layout is not None:
            self.origin[node.name] = self.origin.get(f"{source.name}[{index}]", "")

    def _matmul(self, node: fx.Node) -> None:
        a, b = node.args[0], node.args[1]
        la, lb = self.layout[a.name], self.layout[b.name]
        va, vb, out = a.meta["val"], b.meta["val"], node.meta["val"]
        if (la is None and lb is None) or va.dim() < 2 or vb.dim() < 2:
            return self._copy(node, None) if la is None and lb is None else self._generic(node)
        if (la and la[1] != 1) or (lb and lb[1] != 1):
            return self._generic(node)
        nd = out.dim()

        def out_dim(layout, val, contraction: int):
            if layout is None:
                return None
            if layout[0] == contraction % val.dim():
                return "contracted"
            return layout[0] + nd - val.dim()

        da, db = out_dim(la, va, -1), out_dim(lb, vb, -2)
        if "contracted" in (da, db) or (da is not None and db is not None and da != db):
            return self._generic(node)
        dim = da if da is not None else db
        if dim >= nd - 2 and da is not None and db is not None:
            return self._generic(node)
        # The other operand must not hold full-size data along that dimension.
        for layout, val in ((la, va), (lb, vb)):
            aligned = dim - (nd - val.dim())
            is_batch = dim < nd - 2
            if layout is None and is_batch and aligned >= 0 and val.shape[aligned] != 1:
                return self._generic(node)
        self._copy(node, (dim, 1), (self.env[a.name], self.env[b.name]), {})

    def _sdpa(self, node: fx.Node) -> None:
        q, k, v = node.args[:3]
        if not all(self.layout[t.name] == (1, 1) for t in (q, k, v)) or q.meta["val"].dim() != 4:
            return self._generic(node)
        args = [self.env[q.name], self.env[k.name], self.env[v.name], *node.args[3:]]
        kwargs = dict(node.kwargs)
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            original = node.args[3] if len(node.args) > 3 else node.kwargs["attn_mask"]
            shape = original.meta["val"].shape
            head = 1 - (4 - len(shape))
            want = (head, 1) if head >= 0 and shape[head] != 1 else None
            local = self._arg(original, want)
            if len(args) > 3:
                args[3] = local
            else:
                kwargs["attn_mask"] = local
        self._copy(node, (1, 1), args, kwargs)

    # --- outputs ------------------------------------------------------------------------

    def _output(self, node: fx.Node) -> None:
        def leaf(n: fx.Node) -> fx.Node:
            value = self._arg(n, None)
            val = n.meta.get("val")
            if (
                self.scatter_batch
                and isinstance(val, torch.Tensor)
                and val.dim() >= 1
                and val.shape[0] % self.scatter_batch == 0
            ):
                local = val.new_empty((val.shape[0] // self.size, *val.shape[1:]))
                value = self._emit(
                    torch.ops.smp.tp_split.default, (value, 0, 1.0 / self.size, self.group), val=local
                )
            return value

        self.graph.output(fx.node.map_arg(node.args[0], leaf))

    def _set(self, node: fx.Node, new: fx.Node, layout) -> None:
        new.meta["val"] = _local_val(node.meta.get("val"), layout, self.size)
        self.env[node.name] = new
        self.layout[node.name] = layout


_HANDLERS = {
    aten.linear.default: _Rewrite._linear,
    aten.addmm.default: _Rewrite._addmm,
    aten.embedding.default: _Rewrite._embedding,
    aten.cross_entropy_loss.default: _Rewrite._cross_entropy,
    aten.view.default: _Rewrite._view,
    aten.reshape.default: _Rewrite._view,
    aten._unsafe_view.default: _Rewrite._view,
    aten.transpose.int: _Rewrite._transpose,
    aten.t.default: _Rewrite._transpose,
    aten.permute.default: _Rewrite._permute,
    aten.unsqueeze.default: _Rewrite._unsqueeze,
    aten.squeeze.dim: _Rewrite._squeeze,
    aten.squeeze.dims: _Rewrite._squeeze,
    aten.squeeze.default: _Rewrite._squeeze,
    aten.expand.default: _Rewrite._expand,
    aten.slice.Tensor: _Rewrite._slice,
    aten.cat.default: _Rewrite._cat,
    aten.split.Tensor: _Rewrite._split_op,
    aten.split_with_sizes.default: _Rewrite._split_op,
    aten.chunk.default: _Rewrite._split_op,
    aten.matmul.default: _Rewrite._matmul,
    aten.bmm.default: _Rewrite._matmul,
    aten.scaled_dot_product_attention.default: _Rewrite._sdpa,
    aten.softmax.int: _Rewrite._along_dim,
    aten._softmax.default: _Rewrite._along_dim,
    aten.log_softmax.int: _Rewrite._along_dim,
    aten._log_softmax.default: _Rewrite._along_dim,
    aten.sum.dim_IntList: _Rewrite._reduce,
    aten.mean.dim: _Rewrite._reduce,
    aten.amax.default: _Rewrite._reduce,
    aten.amin.default: _Rewrite._reduce,
    aten.layer_norm.default: _Rewrite._layer_norm,
    aten.dropout.default: _Rewrite._unchanged,
    aten.clone.default: _Rewrite._unchanged,
    aten.contiguous.default: _Rewrite._unchanged,
    aten.detach.default: _Rewrite._unchanged,
    aten.alias.default: _Rewrite._unchanged,
    aten._to_copy.default: _Rewrite._unchanged,
    aten.to.dtype: _Rewrite._unchanged,
    aten.to.dtype_layout: _Rewrite._unchanged,
    aten.to.device: _Rewrite._unchanged,
    aten.type_as.default: _Rewrite._pointwise,
    aten.masked_fill.Scalar: _Rewrite._pointwise,
    aten.masked_fill.Tensor: _Rewrite._pointwise,
    aten.where.self: _Rewrite._pointwise,
}


# --- helpers ------------------------------------------------------------------------------


def _view_dim(before: list[int], after: list[int], dim: int) -> int | None:
    """Where dimension `dim` of `before` lands in `after` as the leading factor of its group
    (split into heads, or merged with later dimensions), or None if it does not."""
    prefix = math.prod(before[:dim])
    n = before[dim]
    j, acc = 0, 1
    while j < len(after) and (acc < prefix or after[j] == 1):
        acc *= after[j]
        j += 1
    if j == len(after) or acc != prefix:
        return None
    m = after[j]
    if m == n:
        return j
    if m < n:  # split: n = m * (later dims of after)
        return j if n % m == 0 and _covers(after[j:], n) else None
    return j if m % n == 0 and _covers(before[dim:], m) else None  # merge


def _covers(dims: list[int], total: int) -> bool:
    acc = 1
    for d in dims:
        acc *= d
        if acc == total:
            return True
        if acc > total:
            return False
    return False


# Ops a column-parallel output flows through in its sharded layout (when the shapes allow) ...
_CARRIES = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.transpose.int,
    aten.t.default,
    aten.permute.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.cat.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.dropout.default,
    aten.clone.default,
    aten.contiguous.default,
    aten._to_copy.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten.type_as.default,
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.where.self,
    aten.softmax.int,
    aten._softmax.default,
    aten.sum.dim_IntList,
    aten.mean.dim,
    operator.getitem,
}
# ... and ops that consume it sharded (or the model's outputs, which callers may want cut as they are).
_USES_SHARDS = {
    aten.linear.default,
    aten.addmm.default,
    aten.matmul.default,
    aten.bmm.default,
    aten.scaled_dot_product_attention.default,
    aten.cross_entropy_loss.default,
    aten.log_softmax.int,
    aten._log_softmax.default,
}


def _shards_pay_off(linear: fx.Node) -> bool:
    """Whether some use of the linear's output consumes it sharded. If every path ends in an op
    that needs it whole (a LayerNorm over its features, say, as in BERT's MLM head), a
    column-parallel layer would just be gathered again: it stays replicated instead."""
    seen, todo = set(), [linear]
    while todo:
        for user in todo.pop().users:
            if user in seen:
                continue
            seen.add(user)
            t = user.target
            if user.op == "output" or t in _USES_SHARDS:
                return True
            pointwise = isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags
            if t in _CARRIES or pointwise:
                todo.append(user)
    return False


def _fused_blocks(linear: fx.Node) -> int:
    """k when the linear's only use splits its output features into k equal parts (fused q/k/v),
    directly or after a view that keeps the feature dimension (GPT-2's Conv1D works in 2-D)."""
    users = list(linear.users)
    if len(users) != 1:
        return 1
    user = users[0]
    if user.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        if user.meta["val"].shape[-1] != linear.meta["val"].shape[-1]:
            return 1
        linear = user
        users = list(user.users)
        if len(users) != 1:
            return 1
        user = users[0]
    if user.target not in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return 1
    nd = linear.meta["val"].dim()
    dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
    parts = user.meta.get("val")
    if dim % nd != nd - 1 or not isinstance(parts, (list, tuple)) or len(parts) < 2:
        return 1
    return len(parts) if len({p.shape[-1] for p in parts}) == 1 else 1


def _local_val(val, layout, size: int):
    if layout is None or val is None:
        return val
    if isinstance(layout, list):
        return [_local_val(v, lay, size) for v, lay in zip(val, layout, strict=True)]
    dim = layout[0]
    shape = list(val.shape)
    shape[dim] //= size
    return val.new_empty(shape)


def _module_stack(node: fx.Node) -> list[str]:
    return [path for path, _ in (node.meta.get("nn_module_stack") or {}).values() if path]


def _fetch(module: nn.Module, target: str):
    return functools.reduce(getattr, target.split("."), module)


def _assign(module: nn.Module, target: str, value: nn.Parameter) -> None:
    *path, name = target.split(".")
    owner = functools.reduce(getattr, path, module)
    if name in owner._parameters:
        owner._parameters[name] = value
    else:
        setattr(owner, name, value)


def _infer_val(node: fx.Node):
    """The node's result on the fake values of its inputs (fake tensors carry their own mode)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return node.target(*args, **kwargs)
    except Exception:  # an input without a recorded value: leave it unknown
        return None


def _bound(node: fx.Node) -> dict[str, Any]:
    """The op's arguments by name, defaults filled in."""
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _is_param_key(gm: fx.GraphModule, key: str) -> bool:
    try:
        return isinstance(_fetch(gm, key), torch.Tensor)
    except AttributeError:
        return False
