"""Tensor-parallel building blocks: smp's C++ custom ops, ``torch.ops.smp.*``.

Tensor parallelism (Megatron-LM) shards a layer's weights over the ranks of a tensor-parallel group.
A linear layer is sharded in one of two roles:

* **column parallel** (``column_parallel_linear``): the input is replicated (the same on every rank),
  the weight and the bias are sharded along the output features, and so is the output. The forward
  needs no communication; the backward all-reduces the input gradient, of which each rank holds a
  partial sum (its output slice's contribution).
* **row parallel** (``row_parallel_linear``): the input is sharded along its last dimension (as a
  column-parallel layer leaves it), the weight along the input features; the forward all-reduces the
  partial products (the output is reduced, hence replicated) and adds the replicated bias once. The
  backward needs no communication.

A Megatron MLP is column then row (``fc1`` column, activation on the shards, ``fc2`` row): one
all-reduce forward and one backward for the whole block; attention is the same with heads as the
sharded features. The vocabulary is sharded the same way: ``vocab_parallel_embedding`` (each rank
holds a slice of the table's rows) and ``vocab_parallel_cross_entropy`` (each rank holds a slice of the
LM head's logits; the loss over the full vocabulary is computed without gathering them).
``tp_gather``, ``tp_split`` and ``tp_reduce`` convert between sharded, replicated and partial
layouts, each with the conjugate collective in its backward.

These ops are the building blocks the tensor-parallel graph pass (``smp.passes``) rewrites a captured
model into; they can be used directly too. They are C++ (``ops/``): plain CPU and CUDA kernels, and
``torch::autograd::Function`` kernels at the Autograd key whose forward and backward call ATen ops and
torch's functional collectives (``_c10d_functional::all_reduce``, ``all_gather_into_tensor``,
``wait_tensor``) through the dispatcher, by process-group name. Under ``torch.compile`` AOTAutograd
therefore traces each op into ATen ops and visible ``_c10d_functional`` collectives, in the forward and
the backward graph. This module registers their fake kernels (``import smp`` imports it) and provides
documented wrappers that take a ``ProcessGroup``, a group name or ``None`` (the default group).

Every op works on CPU and CUDA tensors of float32, float64, bfloat16 and float16, with any leading
dimensions, and is collective: every rank of the group must call it, in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401  (fake kernels of _c10d_functional)
from torch import Tensor

import smp._C  # noqa: F401  (loads the library that defines torch.ops.smp)

__all__ = [
    "column_parallel_linear",
    "moe_combine",
    "moe_dispatch",
    "row_parallel_linear",
    "tp_gather",
    "tp_reduce",
    "tp_copy",
    "tp_split",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]

Group = dist.ProcessGroup | str | None


def _group_name(group: Group) -> str:
    """The name the ops take: a group name as is, a ProcessGroup's name, or the default group's."""
    if isinstance(group, str):
        return group
    if group is None:
        group = dist.group.WORLD
        if group is None:
            raise RuntimeError(
                "smp.ops: torch.distributed is not initialized; call smp.init() or "
                "torch.distributed.init_process_group(backend='smp'), or pass a group"
            )
    return group.group_name


# --- wrappers -----------------------------------------------------------------


def column_parallel_linear(
    input: Tensor, weight: Tensor, bias: Tensor | None = None, group: Group = None
) -> Tensor:
    """Column-parallel linear: ``input @ weight.T + bias`` with the output features sharded.

    input: ``[..., in]``, the same on every rank of ``group``. weight: ``[out_local, in]``, this rank's
    slice of the output features; bias: ``[out_local]`` or None. Returns ``[..., out_local]``.
    No communication forward; the backward all-reduces (sums) the input gradient over the group.
    """
    return torch.ops.smp.column_parallel_linear(input, weight, bias, _group_name(group))


def row_parallel_linear(
    input: Tensor, weight: Tensor, bias: Tensor | None = None, group: Group = None
) -> Tensor:
    """Row-parallel linear: ``all_reduce_sum(input @ weight.T) + bias`` with the input features sharded.

    input: ``[..., in_local]``, this rank's slice of the last dimension; weight: ``[out, in_local]``;
    bias: ``[out]`` (the full bias, the same on every rank, added once after the reduction) or None.
    Returns ``[..., out]``, the same on every rank. The backward needs no communication.
    """
    return torch.ops.smp.row_parallel_linear(input, weight, bias, _group_name(group))


def vocab_parallel_embedding(
    indices: Tensor, weight: Tensor, vocab_start: int, padding_idx: int | None = None, group: Group = None
) -> Tensor:
    """Embedding lookup with the table's rows sharded over the group.

    weight: ``[V_local, D]``, rows ``[vocab_start, vocab_start + V_local)`` of the full table; indices:
    global ids, int64 or int32, any shape. Returns ``[..., D]`` equal to ``F.embedding`` with the full
    table: each rank looks up the ids it owns (zero rows for the others) and the results are summed
    over the group. ``padding_idx`` (a global id, or None) gets no gradient, as in ``nn.Embedding``.
    """
    pad = -1 if padding_idx is None else padding_idx
    return torch.ops.smp.vocab_parallel_embedding(indices, weight, vocab_start, pad, _group_name(group))


def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, vocab_start: int, ignore_index: int = -100, group: Group = None
) -> Tensor:
    """Per-element cross entropy with the classes sharded over the group, never gathering the logits.

    logits: ``[..., V_local]``, classes ``[vocab_start, vocab_start + V_local)``; target: ``[...]``
    int64 global class ids. Returns ``[...]`` in the logits' dtype, equal to
    ``F.cross_entropy(full_logits, target, reduction="none", ignore_index=ignore_index)`` (0 where the
    target is ``ignore_index``): logsumexp over the full vocabulary minus the target's logit, from an
    all-reduce of the row max and one of the sum of exps and the target logit (per row: three numbers
    cross the group). Half and bfloat16 logits are accumulated in float32. Reduce it yourself
    (e.g. ``loss[target != ignore_index].mean()``).
    """
    return torch.ops.smp.vocab_parallel_cross_entropy(
        logits, target, vocab_start, ignore_index, _group_name(group)
    )


def tp_gather(input: Tensor, dim: int = -1, group: Group = None) -> Tensor:
    """All-gather along ``dim``: the ranks' tensors concatenated in group-rank order (shards -> replicated).

    Backward: this rank's slice of the gradient.
    """
    return torch.ops.smp.tp_gather(input, dim, _group_name(group))


def tp_split(input: Tensor, dim: int = -1, grad_scale: float = 1.0, group: Group = None) -> Tensor:
    """This rank's contiguous slice of ``input`` along ``dim`` (replicated -> shards), as a copy.

    The size of ``dim`` must divide by the group size. Backward: all-gather of the gradient along
    ``dim``, times ``grad_scale``.
    """
    return torch.ops.smp.tp_split(input, dim, grad_scale, _group_name(group))


def tp_reduce(input: Tensor, group: Group = None) -> Tensor:
    """All-reduce (sum) over the group (partial sums -> replicated). Backward: identity."""
    return torch.ops.smp.tp_reduce(input, _group_name(group))


def tp_copy(input: Tensor, group: Group = None) -> Tensor:
    """A copy of a replicated input that several column-parallel layers read (then as plain local
    linears): backward all-reduces the gradient once for all of them. Megatron's `f`."""
    return torch.ops.smp.tp_copy(input, _group_name(group))


def moe_dispatch(
    hidden: Tensor, top_k_index: Tensor, num_experts: int, group: Group = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Expert parallelism's dispatch: each (token, chosen expert) pair to the rank holding the expert.

    hidden: ``[N, H]``; top_k_index: ``[N, k]`` integer expert ids in ``[0, num_experts)``. The group's
    ranks hold consecutive blocks of ``num_experts / size`` experts. Counts the pairs per expert,
    exchanges the counts, and all-to-alls the tokens with those uneven splits (dropless). Returns the
    pairs routed to this rank's experts ``[M, H]`` (expert-major: all of its first expert's, from every
    rank in rank order, then the next expert's), their count per local expert (int64), and the route
    ``moe_combine`` takes. Backward: the pairs' gradients back home, summed into their tokens.
    """
    return torch.ops.smp.moe_dispatch(hidden, top_k_index, num_experts, _group_name(group))


def moe_combine(expert_out: Tensor, top_k_weights: Tensor, route: Tensor, group: Group = None) -> Tensor:
    """Expert parallelism's combine: the experts' outputs ``[M, H]`` (``moe_dispatch``'s rows) back to
    their tokens, each token's k outputs weighted by ``top_k_weights`` ``[N, k]`` and summed: ``[N, H]``.
    Backward: gradients for the expert outputs (sent back to the experts' ranks) and the weights."""
    out, _ = torch.ops.smp.moe_combine(expert_out, top_k_weights, route, _group_name(group))
    return out


# --- fake kernels -------------------------------------------------------------
# Shapes only, for FakeTensor tracing (torch.compile, torch.export) where the
# ops are not decomposed by their Autograd kernels (e.g. under inference_mode).
# Symbolic sizes flow through; the checks mirror the C++ ones.


def _group_size(group_name: str) -> int:
    return dist.distributed_c10d._resolve_process_group(group_name).size()


def _wrap_dim(op: str, dim: int, t: Tensor) -> int:
    ndim = t.dim()
    torch._check_index(
        ndim > 0 and -ndim <= dim < ndim,
        lambda: (
            f"{op}: dim {dim} is out of range for a tensor of {ndim} dimension(s) (shape {tuple(t.shape)})"
        ),
    )
    return dim + ndim if dim < 0 else dim


def _check_linear(op: str, input: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    torch._check(input.dim() >= 1, lambda: f"{op}: input must have at least one dimension")
    torch._check(weight.dim() == 2, lambda: f"{op}: weight must be 2-D, got shape {tuple(weight.shape)}")
    torch._check(
        input.shape[-1] == weight.shape[1],
        lambda: (
            f"{op}: the input's last dimension ({input.shape[-1]}) must equal weight.size(1) "
            f"({weight.shape[1]}); input shape {tuple(input.shape)}, weight shape {tuple(weight.shape)}"
        ),
    )
    if bias is not None:
        torch._check(
            bias.dim() == 1 and bias.shape[0] == weight.shape[0],
            lambda: f"{op}: bias must have shape [{weight.shape[0]}], got shape {tuple(bias.shape)}",
        )


@torch.library.register_fake("smp::column_parallel_linear")
def _column_parallel_linear_fake(input, weight, bias, group_name):
    _check_linear("smp::column_parallel_linear", input, weight, bias)
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


@torch.library.register_fake("smp::row_parallel_linear")
def _row_parallel_linear_fake(input, weight, bias, group_name):
    _check_linear("smp::row_parallel_linear", input, weight, bias)
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


@torch.library.register_fake("smp::vocab_parallel_embedding")
def _vocab_parallel_embedding_fake(indices, weight, vocab_start, padding_idx, group_name):
    torch._check(
        weight.dim() == 2, lambda: f"smp::vocab_parallel_embedding: weight must be 2-D, got {weight.shape}"
    )
    return weight.new_empty((*indices.shape, weight.shape[1]))


@torch.library.register_fake("smp::vocab_parallel_cross_entropy")
def _vocab_parallel_cross_entropy_fake(logits, target, vocab_start, ignore_index, group_name):
    op = "smp::vocab_parallel_cross_entropy"
    torch._check(logits.dim() >= 1, lambda: f"{op}: logits must be [..., V_local], got a 0-d tensor")
    torch._check(
        target.dim() == logits.dim() - 1,
        lambda: (
            f"{op}: target shape {tuple(target.shape)} must equal the logits' shape without the last "
            f"dimension (logits shape {tuple(logits.shape)})"
        ),
    )
    for t, s in zip(target.shape, logits.shape[:-1], strict=True):
        torch._check(
            t == s, lambda: f"{op}: target shape {target.shape} does not match logits {logits.shape}"
        )
    return logits.new_empty(logits.shape[:-1])


@torch.library.register_fake("smp::tp_gather")
def _tp_gather_fake(input, dim, group_name):
    d = _wrap_dim("smp::tp_gather", dim, input)
    shape = list(input.shape)
    shape[d] = shape[d] * _group_size(group_name)
    return input.new_empty(shape)


@torch.library.register_fake("smp::tp_split")
def _tp_split_fake(input, dim, grad_scale, group_name):
    d = _wrap_dim("smp::tp_split", dim, input)
    size = _group_size(group_name)
    shape = list(input.shape)
    torch._check(
        shape[d] % size == 0,
        lambda: (
            f"smp::tp_split: the size of dim {dim} ({shape[d]}) does not divide by the group size "
            f"({size}); input shape {tuple(input.shape)}"
        ),
    )
    shape[d] = shape[d] // size
    return input.new_empty(shape)


@torch.library.register_fake("smp::tp_reduce")
def _tp_reduce_fake(input, group_name):
    return input.new_empty(input.shape)


@torch.library.register_fake("smp::tp_copy")
def _tp_copy_fake(input, group_name):
    return input.new_empty(input.shape)


@torch.library.register_fake("smp::moe_dispatch")
def _moe_dispatch_fake(hidden, top_k_index, num_experts, group_name):
    ranks = _group_size(group_name)
    torch._check(
        num_experts % ranks == 0,
        lambda: f"smp::moe_dispatch: {num_experts} experts do not divide among the group's {ranks} ranks",
    )
    routed = torch.library.get_ctx().new_dynamic_size()  # how many pairs arrive: data dependent
    slots = top_k_index.shape[0] * top_k_index.shape[1]
    return (
        hidden.new_empty((routed, hidden.shape[1])),
        hidden.new_empty((num_experts // ranks,), dtype=torch.int64),
        hidden.new_empty((2 * num_experts + slots,), dtype=torch.int64),
    )


@torch.library.register_fake("smp::moe_combine")
def _moe_combine_fake(expert_out, top_k_weights, route, group_name):
    tokens, top_k = top_k_weights.shape
    return (
        expert_out.new_empty((tokens, expert_out.shape[1])),
        expert_out.new_empty((tokens * top_k, expert_out.shape[1])),  # the outputs back home
    )
