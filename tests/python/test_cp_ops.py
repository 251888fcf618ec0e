"""Tests of the context-parallel custom ops (ops/cp_*.cpp, python/smp/cp_ops.py).

On 2 and 4 real processes, every op against plain attention over the whole sequence in one
process, forward and every gradient: cp_attention ("p2p" ring and "all_gather") causal, masked
(bool and additive, sliding window, padding), grouped-query and float64; cp_gather, cp_reduce
and the all-to-alls against their dense meaning and as each other's inverse. In this process over
a group of one: opcheck, the fake kernels, torch.compile and torch.export.
"""

from __future__ import annotations

import pytest
import smp  # noqa: F401  (registers the backend and the ops)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from smp import cp_ops

ATOL = RTOL = 1e-5  # float32 parity


def _whole_inputs(seq, heads=4, kv_heads=4, batch=2, dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=dtype)
    weight = torch.randn(batch, heads, seq, dim, generator=g, dtype=dtype)  # d(loss)/d(out)
    return q, k, v, weight


def _mask(kind, seq, batch=2, dtype=torch.float32):
    rows, cols = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    if kind == "causal_bool":
        return (cols <= rows).expand(batch, 1, seq, seq)
    if kind == "window":  # Mistral's sliding window of 3 over a causal mask
        return ((cols <= rows) & (rows - cols < 3)).expand(batch, 1, seq, seq)
    if kind == "padding":  # BERT: the last 3 keys of the second row are padding, no causal mask
        keep = torch.ones(batch, seq, dtype=torch.bool)
        keep[1, -3:] = False
        return keep[:, None, None, :].expand(batch, 1, seq, seq)
    if kind == "additive":
        bias = torch.randn(batch, 4, seq, seq, generator=torch.Generator().manual_seed(3), dtype=dtype)
        return bias.masked_fill(cols > rows, float("-inf"))
    return None


def _dense(q, k, v, mask, causal):
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


def check_attention(rank, world, comm, mask_kind, causal, kv_heads, dtype):
    group = dist.group.WORLD
    seq = 8 * world
    q, k, v, weight = _whole_inputs(seq, kv_heads=kv_heads, dtype=dtype)
    mask = _mask(mask_kind, seq, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _dense(*leaves, mask, causal)
    (expected * weight).sum().backward()
    mine = cp_ops.local_positions(seq, rank, world)
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    local_mask = None if mask is None else mask[:, :, mine]
    out = cp_ops.cp_attention(*local, mask=local_mask, is_causal=causal, comm=comm, group=group)
    # Every rank's loss is its rows' part of the whole one: the gradients are the dense ones.
    (out * weight[:, :, mine]).sum().backward()
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, expected[:, :, mine].detach(), atol=tol, rtol=tol)
    errors = [(out - expected[:, :, mine]).abs().max().item()]
    for mine_t, whole in zip(local, leaves, strict=True):
        torch.testing.assert_close(mine_t.grad, whole.grad[:, :, mine], atol=tol, rtol=tol)
        errors.append((mine_t.grad - whole.grad[:, :, mine]).abs().max().item())
    return max(errors)  # the largest error of the output and the three gradients


@pytest.mark.parametrize(
    "world, comm, mask_kind, causal, kv_heads, dtype",
    [
        (2, "p2p", None, True, 4, torch.float32),
        (4, "p2p", None, True, 2, torch.float32),  # grouped-query attention
        (2, "p2p", "causal_bool", False, 4, torch.float64),
        (4, "p2p", "window", False, 4, torch.float32),
        (2, "p2p", "padding", False, 4, torch.float32),
        (2, "p2p", "additive", False, 4, torch.float32),
        (2, "p2p", None, False, 1, torch.float32),  # multi-query, no mask
        (4, "all_gather", None, True, 4, torch.float32),
        (2, "all_gather", "padding", False, 2, torch.float32),
        (2, "p2p", None, True, 4, torch.bfloat16),
    ],
)
def test_cp_attention_matches_dense(world, comm, mask_kind, causal, kv_heads, dtype):
    args = (comm, mask_kind, causal, kv_heads, dtype)
    errors = run_ranks(check_attention, world, *args, timeout=120)
    case = f"{comm} world={world} mask={mask_kind} causal={causal} kv_heads={kv_heads} {dtype}"
    print(f"cp_attention {case}: max error {max(errors):.2e}")


def check_comm_ops(rank, world):
    group = dist.group.WORLD
    seq = 4 * world
    g = torch.Generator().manual_seed(1)
    whole = torch.randn(2, 4 * world, seq, 3, generator=g, dtype=torch.float64)  # [B, H, S, D]
    mine = cp_ops.local_positions(seq, rank, world)
    local = whole[:, :, mine].clone().requires_grad_()
    # cp_gather: the whole sequence in order; its backward sums every rank's copy's gradient.
    gathered = cp_ops.cp_gather(local, 2, group)
    torch.testing.assert_close(gathered, whole)
    gathered.backward(torch.ones_like(gathered) * (rank + 1))
    torch.testing.assert_close(local.grad, torch.full_like(local, world * (world + 1) / 2))
    # cp_reduce: the sum of the ranks' parts, its backward the sum of their gradients.
    part = torch.tensor([float(rank + 1)], dtype=torch.float64, requires_grad=True)
    total = cp_ops.cp_reduce(part, group)
    total.backward(torch.tensor([2.0], dtype=torch.float64))
    assert total.item() == world * (world + 1) / 2 and part.grad.item() == 2.0 * world
    # cp_to_heads: this rank's heads over the whole sequence; cp_to_seq brings them back.
    per = whole.shape[1] // world
    heads = cp_ops.cp_to_heads(local.detach(), 2, 1, group)
    torch.testing.assert_close(heads, whole[:, rank * per : (rank + 1) * per])
    torch.testing.assert_close(cp_ops.cp_to_seq(heads, 2, 1, group), local.detach())
    # The heads on another dim than the sequence's left ([B, S, H, D]), and the adjoints.
    x = local.detach().transpose(1, 2).contiguous().requires_grad_()
    y = cp_ops.cp_to_heads(x, 1, 2, group)
    torch.testing.assert_close(y, whole.transpose(1, 2)[:, :, rank * per : (rank + 1) * per])
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(9 + rank), dtype=torch.float64)
    (y * w).sum().backward()
    torch.testing.assert_close(x.grad, cp_ops.cp_to_seq(w, 1, 2, group))
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_cp_comm_ops(world):
    assert run_ranks(check_comm_ops, world, timeout=120) == [True] * world


def check_bad_input(rank, world):
    group = dist.group.WORLD
    q = torch.randn(1, 3, 4, 2)
    with pytest.raises(RuntimeError, match=r"head count \(dim 1, size 3\) does not divide into 2"):
        cp_ops.cp_to_heads(q, 2, 1, group)
    with pytest.raises(RuntimeError, match="is not two segments of equal length"):
        cp_ops.cp_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], group=group)
    with pytest.raises(RuntimeError, match="key/value heads do not divide"):
        cp_ops.cp_attention(q, q[:, :2], q[:, :2], group=group)
    with pytest.raises(RuntimeError, match="comm must be"):
        cp_ops.cp_attention(q, q, q, comm="ring", group=group)
    return True


def test_cp_bad_input():
    assert run_ranks(check_bad_input, 2, timeout=60) == [True, True]


# --- one process ------------------------------------------------------------------


def test_opcheck_and_fake_kernels(group):
    q, k, v, _ = _whole_inputs(4, kv_heads=2)
    mask = _mask("causal_bool", 4)
    for args in [(q, k, v, None, True, 0.3, "p2p"), (q, k, v, mask, False, 0.3, "all_gather")]:
        inputs = [
            a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
        ]
        torch.library.opcheck(torch.ops.smp.cp_attention.default, (*inputs, group.group_name))
    x = torch.randn(2, 4, 6, 3, requires_grad=True)
    for op, args in [
        (torch.ops.smp.cp_gather.default, (x, 2)),
        (torch.ops.smp.cp_reduce.default, (x,)),
        (torch.ops.smp.cp_to_heads.default, (x, 2, 1)),
        (torch.ops.smp.cp_to_seq.default, (x, 2, 1)),
    ]:
        from torch._subclasses.fake_tensor import FakeTensorMode

        real = op(*args, group.group_name)
        with FakeTensorMode() as mode, torch._C._AutoDispatchBelowAutograd():
            fake = op(mode.from_tensor(args[0]), *args[1:], group.group_name)
        assert fake.shape == real.shape and fake.dtype == real.dtype


def test_compile_and_export(group):
    q, k, v, w = _whole_inputs(8)

    def f(q, k, v):
        return cp_ops.cp_attention(q, k, v, is_causal=True, group=group) * w

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    compiled(*leaves).sum().backward()
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    f(*eager).sum().backward()
    dense = [t.clone().requires_grad_() for t in (q, k, v)]
    (_dense(*dense, None, True) * w).sum().backward()  # over a group of one: plain attention
    for a, b, c in zip(leaves, eager, dense, strict=True):
        torch.testing.assert_close(a.grad, b.grad)
        torch.testing.assert_close(b.grad, c.grad, atol=ATOL, rtol=RTOL)
    program = torch.export.export(_Attend(group.group_name), (q, k, v))
    assert any(n.target is torch.ops.smp.cp_attention.default for n in program.graph.nodes)


class _Attend(torch.nn.Module):
    def __init__(self, group_name):
        super().__init__()
        self.group_name = group_name

    def forward(self, q, k, v):
        return torch.ops.smp.cp_attention(q, k, v, None, True, 0.5, "p2p", self.group_name)
