"""Context-parallel building blocks: smp's C++ custom ops over a sequence cut between the ranks of
a context-parallel group, ``torch.ops.smp.cp_*``.

The sequence is cut load-balanced: 2C chunks of equal length, rank r holding chunk r followed by
chunk 2C-1-r (under causal attention every rank then has the same work). The ops:

* ``cp_attention(q, k, v, mask, is_causal, scale, comm, group)``: attention of this rank's query
  rows over the whole sequence's keys and values, which never exist whole outside the op:
  ``"p2p"`` passes them around the ring, the next block in flight while one is computed (ring
  attention), ``"all_gather"`` gathers them inside the op, ``"local"`` attends over this rank's
  rows alone, no group (Ulysses after its all-to-all). Blocks are merged by their
  log-sum-exps (the online softmax). q ``[B, H, L, D]``, k/v ``[B, Hkv, L, D]`` (Hkv divides H);
  the mask (bool, true: attend, or additive) covers this rank's rows against all columns.
  The backward sends each block's key/value gradients home.
* ``cp_gather(x, dim, group)``: the whole sequence from every rank's segments, in order;
  backward reduce-scatters.
* ``cp_reduce(x, group)``: the sum of every rank's partial sum (a loss over the sequence's
  tokens); backward all-reduces.
* ``cp_to_heads(x, seq_dim, head_dim, group)`` and ``cp_to_seq``: Ulysses' all-to-all, from the
  sequence cut to 1/C of the heads over the whole sequence and back; each the other's backward.

Every backward is the exact adjoint with each rank's copy of a replicated value its own: the
parameters' gradients summed over the cp group are C times the whole sequence's, and the
engine averages them over it (as over data-parallel replicas). The ops are C++ (``ops/cp_*``),
with this module's fake kernels; cp_attention's forward and backward are each one opaque op
under torch.compile.
"""

from __future__ import annotations

import torch
from torch import Tensor

import smp._C  # noqa: F401  (loads the library that defines torch.ops.smp)
from smp.ops import Group, _group_name, _group_size, _wrap_dim

__all__ = ["cp_attention", "cp_gather", "cp_reduce", "cp_to_heads", "cp_to_seq", "local_positions"]


def local_positions(seq_len: int, rank: int, size: int) -> list[int]:
    """The positions of the sequence rank `rank` of `size` holds, in its order."""
    chunk = seq_len // (2 * size)
    first, second = rank, 2 * size - 1 - rank
    return [*range(first * chunk, (first + 1) * chunk), *range(second * chunk, (second + 1) * chunk)]


def cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    comm: str = "p2p",
    group: Group = None,
) -> Tensor:
    """Attention of this rank's rows over the whole cut sequence (see the module's docstring)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.smp.cp_attention(q, k, v, mask, is_causal, scale, comm, _group_name(group))


def cp_gather(input: Tensor, dim: int, group: Group = None) -> Tensor:
    return torch.ops.smp.cp_gather(input, dim, _group_name(group))


def cp_reduce(input: Tensor, group: Group = None) -> Tensor:
    return torch.ops.smp.cp_reduce(input, _group_name(group))


def cp_to_heads(input: Tensor, seq_dim: int, head_dim: int, group: Group = None) -> Tensor:
    return torch.ops.smp.cp_to_heads(input, seq_dim, head_dim, _group_name(group))


def cp_to_seq(input: Tensor, seq_dim: int, head_dim: int, group: Group = None) -> Tensor:
    return torch.ops.smp.cp_to_seq(input, seq_dim, head_dim, _group_name(group))


# --- fake kernels -------------------------------------------------------------


def _check_attention(q: Tensor, k: Tensor, v: Tensor, comm: str) -> None:
    op = "smp::cp_attention"
    torch._check(q.dim() == 4 and k.dim() == 4, lambda: f"{op}: q, k, v must be [B, H, L, D]")
    torch._check(k.shape == v.shape, lambda: f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: f"{op}: kv heads do not divide the query heads")
    torch._check(
        comm in ("p2p", "all_gather", "local"), lambda: f"{op}: comm must be 'p2p', 'all_gather' or 'local'"
    )


@torch.library.register_fake("smp::cp_attention")
def _cp_attention_fake(q, k, v, mask, is_causal, scale, comm, group_name):
    _check_attention(q, k, v, comm)
    return q.new_empty(q.shape)


@torch.library.register_fake("smp::cp_attention_forward")
def _cp_attention_forward_fake(q, k, v, mask, is_causal, scale, comm, group_name):
    _check_attention(q, k, v, comm)
    lse = torch.float64 if q.dtype == torch.float64 else torch.float32  # the C++ accType
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=lse)


@torch.library.register_fake("smp::cp_attention_backward")
def _cp_attention_backward_fake(grad_out, q, k, v, mask, out, lse, is_causal, scale, comm, group_name):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("smp::cp_gather")
def _cp_gather_fake(input, dim, group_name):
    d = _wrap_dim("smp::cp_gather", dim, input)
    shape = list(input.shape)
    shape[d] = shape[d] * _group_size(group_name)
    return input.new_empty(shape)


@torch.library.register_fake("smp::cp_reduce")
def _cp_reduce_fake(input, group_name):
    return input.new_empty(input.shape)


def _moved(op: str, input: Tensor, seq_dim: int, head_dim: int, size: int, to_heads: bool) -> Tensor:
    s, h = _wrap_dim(op, seq_dim, input), _wrap_dim(op, head_dim, input)
    shape = list(input.shape)
    if to_heads:
        torch._check(shape[h] % size == 0, lambda: f"{op}: {shape[h]} heads do not divide by {size}")
        shape[s], shape[h] = shape[s] * size, shape[h] // size
    else:
        shape[s], shape[h] = shape[s] // size, shape[h] * size
    return input.new_empty(shape)


@torch.library.register_fake("smp::cp_to_heads")
def _cp_to_heads_fake(input, seq_dim, head_dim, group_name):
    return _moved("smp::cp_to_heads", input, seq_dim, head_dim, _group_size(group_name), True)


@torch.library.register_fake("smp::cp_to_seq")
def _cp_to_seq_fake(input, seq_dim, head_dim, group_name):
    return _moved("smp::cp_to_seq", input, seq_dim, head_dim, _group_size(group_name), False)
