"""Layers that own the parameters the pass cuts: linear (and GPT-2's Conv1D addmm), embedding,
and the cross entropy that reads vocab-sharded logits.

A marked linear whose input is replicated becomes column-parallel (weight rows sliced, output
sharded on features); one whose input is sharded on its features becomes row-parallel (weight
columns sliced, output all-reduced). Megatron's pairing falls out of the dataflow: q/k/v and
MLP up/gate projections come first, attention-output and MLP-down projections second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx

from ...fx_utils import bound_args, module_stack, parent_path
from ...linear_forms import grouped_linear, linear_in_out
from .. import registry
from ..driver import Demote
from ..layout import Shard, ShardSpec, local_val
from ..registry import rule

if TYPE_CHECKING:
    from ..driver import Rewrite

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)


@rule(aten.linear.default, uses_shards=True)
def linear(rw: Rewrite, node: fx.Node) -> None:
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    _linear_layer(rw, node, x, weight, bias, transposed=False)


@rule(aten.addmm.default, uses_shards=True)
def addmm(rw: Rewrite, node: fx.Node) -> None:
    """addmm(bias, x, weight) with a [in, out] weight: HF's Conv1D (GPT-2) is a linear layer."""
    bias, x, weight = node.args[:3]
    bound = bound_args(node)
    plain = bound["beta"] == 1 and bound["alpha"] == 1 and bias.meta["val"].dim() == 1
    if not plain:
        return rw.generic(node)
    _linear_layer(rw, node, x, weight, bias, transposed=True)


@rule(linear_in_out, uses_shards=True)
def linear_on_in_out_weight(rw: Rewrite, node: fx.Node) -> None:
    """x @ W (+ b) on a [in, out] weight (linear_forms made it of a matmul or an einsum)."""
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    _linear_layer(rw, node, x, weight, bias, transposed=True)


def _linear_layer(rw: Rewrite, node: fx.Node, x: fx.Node, weight: fx.Node, bias, transposed: bool) -> None:
    """x @ W^T + b (or x @ W + b when `transposed`, the weight stored [in, out])."""
    if not rw.shardable(node, weight):
        return rw.generic(node)
    if rw.layout[x.name] == Shard(x.meta["val"].dim() - 1):  # input sharded on its features
        return _row_parallel(rw, node, x, weight, bias, transposed)
    if not shards_pay_off(node):
        return rw.generic(node)  # its output would only be gathered again
    _column_parallel(rw, node, x, weight, bias, transposed)


def _row_parallel(rw: Rewrite, node, x, weight, bias, transposed: bool) -> None:
    """Each rank multiplies its feature slice by its columns of W; one all-reduce sums them."""
    spec = ShardSpec(0 if transposed else 1)  # the input-features dimension
    rw.add_spec(weight, spec)
    w = _local_weight(rw, weight, spec, transposed)
    args = (rw.env[x.name], w, rw.arg(bias, None) if bias else None)
    rw.set(node, rw.emit(torch.ops.smp.row_parallel_linear.default, (*args, rw.group)), None)


def _column_parallel(rw: Rewrite, node, x, weight, bias, transposed: bool) -> None:
    """Each rank computes its slice of the output features from the whole input."""
    out_dim = 1 if transposed else 0  # the output-features dimension
    out_features = weight.meta["val"].shape[out_dim]
    blocks = _fused_blocks(node)
    module = module_stack(node)[-1]
    if (out_features // blocks) % rw.size:
        raise Demote(
            parent_path(module) or module,
            f"the {out_features} output features of {module} do not divide by "
            f"tensor_parallel_degree={rw.size}",
        )
    spec = ShardSpec(out_dim, blocks)
    rw.add_spec(weight, spec)
    if bias is not None:
        rw.add_spec(bias, ShardSpec(0, blocks))
    local = (_local_weight(rw, weight, spec, transposed), rw.env[bias.name] if bias else None)
    if _column_readers(rw, x) > 1:
        # q/k/v or gate/up on one input: one copy whose backward all-reduces once for all.
        shared = rw.cached(
            (x.name, "copy"), lambda: rw.emit(torch.ops.smp.tp_copy.default, (rw.arg(x, None), rw.group))
        )
        new = rw.emit(aten.linear.default, (shared, *local))
    else:
        new = rw.emit(torch.ops.smp.column_parallel_linear.default, (rw.arg(x, None), *local, rw.group))
    rw.set(node, new, Shard(node.meta["val"].dim() - 1, blocks))
    rw.origin[node.name] = module


@rule(grouped_linear, uses_shards=True)
def expert_bank(rw: Rewrite, node: fx.Node) -> None:
    """A mixture-of-experts bank [experts, out, in] applied to tokens sorted by expert: cut like a
    linear layer, every expert's matrix the same way (Megatron's column/row pairing inside each
    expert; the router stays whole, so every rank routes every token alike and no token moves).
    The up (and gate) bank is column-parallel, the down bank row-parallel."""
    x, bank, offsets = node.args
    if not rw.shardable(node, bank):
        return rw.generic(node)
    module = module_stack(node)[-1]
    if rw.layout[x.name] == Shard(1):  # [tokens, in] sharded on its features: row-parallel
        rw.add_spec(bank, ShardSpec(2))
        partial = rw.emit(grouped_linear, (rw.env[x.name], rw.env[bank.name], rw.arg(offsets, None)))
        rw.set(node, rw.emit(torch.ops.smp.tp_reduce.default, (partial, rw.group)), None)
        return
    if rw.layout[x.name] is not None or not shards_pay_off(node):
        return rw.generic(node)
    out_features, blocks = bank.meta["val"].shape[1], _fused_blocks(node)
    if (out_features // blocks) % rw.size:
        raise Demote(
            module,
            f"the {out_features} output features of its experts do not divide by "
            f"tensor_parallel_degree={rw.size}",
        )
    rw.add_spec(bank, ShardSpec(1, blocks))
    shared = rw.cached(
        (x.name, "copy"), lambda: rw.emit(torch.ops.smp.tp_copy.default, (rw.arg(x, None), rw.group))
    )
    new = rw.emit(grouped_linear, (shared, rw.env[bank.name], rw.arg(offsets, None)))
    rw.set(node, new, Shard(1, blocks))
    rw.origin[node.name] = module


def _local_weight(rw: Rewrite, weight: fx.Node, spec: ShardSpec, transposed: bool) -> fx.Node:
    """The local shard as a [out, in] linear weight."""
    if not transposed:
        return rw.env[weight.name]
    local = local_val(weight.meta["val"], spec.layout, rw.size)
    return rw.emit(aten.t.default, (rw.env[weight.name],), val=local.t())


def _column_readers(rw: Rewrite, x: fx.Node) -> int:
    """How many marked linears read `x` as a replicated input (column-parallel candidates)."""
    if rw.layout[x.name] is not None:
        return 0
    return sum(
        1
        for user in x.users
        if (
            user.target in (aten.linear.default, linear_in_out)
            and user.args[0] is x
            and rw.shardable(user, user.args[1])
        )
        or (user.target is aten.addmm.default and user.args[1] is x and rw.shardable(user, user.args[2]))
    )


def shards_pay_off(linear: fx.Node) -> bool:
    """Whether some use of the linear's output consumes it sharded. If every path ends in an op
    that needs it whole (a LayerNorm over its features, say, as in BERT's MLM head), a
    column-parallel layer would just be gathered again: it stays replicated instead. Model
    outputs count as uses: callers may want them cut as they are."""
    seen, todo = set(), [linear]
    while todo:
        for user in todo.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "output" or registry.uses_shards(user.target):
                return True
            if registry.carries(user.target):
                todo.append(user)
    return False


def _fused_blocks(linear: fx.Node) -> int:
    """k when the linear's only use splits its output features into k equal parts (fused q/k/v),
    directly or after a view that keeps the feature dimension (GPT-2's Conv1D works in 2-D)."""
    users = list(linear.users)
    if len(users) != 1:
        return 1
    user = users[0]
    if user.target in _VIEWS:
        if user.meta["val"].shape[-1] != linear.meta["val"].shape[-1]:
            return 1
        linear = user
        users = list(user.users)
        if len(users) != 1:
            return 1
        user = users[0]
    if user.target not in _SPLITS:
        return 1
    nd = linear.meta["val"].dim()
    dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
    parts = user.meta.get("val")
    if dim % nd != nd - 1 or not isinstance(parts, (list, tuple)) or len(parts) < 2:
        return 1
    return len(parts) if len({p.shape[-1] for p in parts}) == 1 else 1


@rule(aten.embedding.default)
def embedding(rw: Rewrite, node: fx.Node) -> None:
    """A marked embedding becomes vocab-parallel: each rank holds a range of rows, looks up the
    ids that fall in it, and one all-reduce assembles the rows."""
    weight, indices = node.args[0], node.args[1]
    bound = bound_args(node)
    if not rw.shardable(node, weight) or bound["scale_grad_by_freq"] or bound["sparse"]:
        return rw.generic(node)
    vocab = weight.meta["val"].shape[0]
    if vocab % rw.size:
        raise Demote(
            module_stack(node)[-1],
            f"its vocabulary of {vocab} does not divide by tensor_parallel_degree={rw.size}",
        )
    rw.add_spec(weight, ShardSpec(0))
    start = rw.rank * (vocab // rw.size)
    args = (rw.arg(indices, None), rw.env[weight.name], start, bound["padding_idx"], rw.group)
    rw.set(node, rw.emit(torch.ops.smp.vocab_parallel_embedding.default, args), None)


@rule(aten.cross_entropy_loss.default, uses_shards=True)
def cross_entropy(rw: Rewrite, node: fx.Node) -> None:
    """Cross entropy over vocab-sharded logits runs vocab-parallel: the logits are never gathered."""
    logits, target = node.args[0], node.args[1]
    bound = bound_args(node)
    class_dim = 1 if logits.meta["val"].dim() > 1 else 0
    if rw.layout[logits.name] != Shard(class_dim) or bound["weight"] is not None or bound["label_smoothing"]:
        return rw.generic(node)
    local = rw.env[logits.name]
    if class_dim and logits.meta["val"].dim() > 2:
        local = rw.emit(aten.movedim.int, (local, 1, -1))  # the op wants classes last
    vocab_local = logits.meta["val"].shape[class_dim] // rw.size
    labels = rw.arg(target, None)
    ignore_index = bound["ignore_index"]
    losses = rw.emit(
        torch.ops.smp.vocab_parallel_cross_entropy.default,
        (local, labels, rw.rank * vocab_local, ignore_index, rw.group),
    )
    rw.set(node, _reduce_losses(rw, losses, labels, bound["reduction"], ignore_index), None)


def _reduce_losses(
    rw: Rewrite, losses: fx.Node, labels: fx.Node, reduction: int, ignore_index: int
) -> fx.Node:
    if reduction == 0:  # none
        return losses
    total = rw.emit(aten.sum.default, (losses,))
    if reduction == 2:  # sum
        return total
    # mean over the targets that are not ignored, as torch does
    kept = rw.emit(aten.ne.Scalar, (labels, ignore_index))
    count = rw.emit(aten.sum.default, (kept,))
    return rw.emit(aten.div.Tensor, (total, count))
