"""Expert parallelism's C++ ops, smp::moe_dispatch and smp::moe_combine (ops/moe.cpp).

On 2 and 4 real processes: tokens routed to experts held by other ranks and back, forward and
backward, against every expert run in one process on every rank's tokens (each rank makes every
rank's data from seeds, so it computes the whole reference itself); routing sent mostly to one
expert, and a rank sending nothing. In this process: gradcheck in float64, the fake kernels under
torch.export, and the argument checks.
"""

from __future__ import annotations

import pytest
import smp  # noqa: F401  (registers the backend and the ops)
import torch
import torch.distributed as dist
from harness import run_ranks
from smp import ops

H, K, EXPERTS = 6, 2, 4


def _data(rank: int, tokens: int, skew: bool, dtype=torch.float64):
    """Rank `rank`'s tokens, top-k expert ids (distinct per token) and router weights."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, H, generator=g, dtype=dtype)
    scores = torch.rand(tokens, EXPERTS, generator=g)
    if skew:  # almost every token picks expert 0 first
        scores[:, 0] += 10.0
    index = scores.topk(K, dim=-1).indices
    weights = torch.rand(tokens, K, generator=g, dtype=dtype)
    return x, index, weights


def _experts(dtype=torch.float64):
    return torch.randn(EXPERTS, H, H, generator=torch.Generator().manual_seed(7), dtype=dtype)


def _dense(x, index, weights, banks):
    """Every token through its k experts in one process: sum_j w[n, j] * banks[id] @ x[n]."""
    picked = banks[index]  # [N, k, H, H]
    return torch.einsum("nk,nkoi,ni->no", weights, picked, x)


def _local_experts(routed, counts, banks):
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        outs.append(routed[start : start + n] @ banks[e].T)
        start += n
    return torch.cat(outs)


def _exchange(rank, world, tokens_of, skew):
    """This rank's output and gradients through dispatch/combine, and the one-process reference."""
    group = dist.group.WORLD
    local = EXPERTS // world
    banks = _experts()
    mine = banks[rank * local : (rank + 1) * local].clone().requires_grad_(True)
    x, index, weights = _data(rank, tokens_of[rank], skew)
    x.requires_grad_(True)
    weights.requires_grad_(True)
    routed, counts, route = ops.moe_dispatch(x, index, EXPERTS, group)
    out = ops.moe_combine(_local_experts(routed, counts, mine), weights, route, group)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank), dtype=out.dtype)
    (out * upstream).sum().backward()
    # The reference: every rank's tokens through every expert, in this process.
    ref_banks = banks.clone().requires_grad_(True)
    total = 0
    for r in range(world):
        xr, ir, wr = _data(r, tokens_of[r], skew)
        xr.requires_grad_(True)
        wr.requires_grad_(True)
        ref = _dense(xr, ir, wr, ref_banks)
        up = torch.randn(ref.shape, generator=torch.Generator().manual_seed(r), dtype=ref.dtype)
        total = total + (ref * up).sum()
        if r == rank:
            ref_out, ref_x, ref_w = ref, xr, wr
    total.backward()
    errors = {
        "out": _gap(out, ref_out),
        "x": _gap(x.grad, ref_x.grad),
        "weights": _gap(weights.grad, ref_w.grad),
        "experts": _gap(mine.grad, ref_banks.grad[rank * local : (rank + 1) * local]),
    }
    return errors, counts.tolist()


def _gap(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("skew", [False, True])
def test_exchange_equals_one_process(world, skew):
    tokens_of = [5, 0, 7, 3][:world]  # uneven batches, and a rank that sends nothing
    results = run_ranks(_exchange, world, tokens_of, skew, timeout=120)
    print({k: max(e[k] for e, _ in results) for k in results[0][0]})
    for errors, _ in results:
        assert max(errors.values()) < 1e-12, errors
    if skew:  # the rank holding expert 0 receives nearly every token
        received = [sum(counts) for _, counts in results]
        assert received[0] >= sum(tokens_of) > max(received[1:])


def test_gradcheck_float64(group):
    x, index, weights = _data(0, 5, False)
    banks = _experts()

    def fn(x, weights, banks):
        routed, counts, route = ops.moe_dispatch(x, index, EXPERTS, group)
        return ops.moe_combine(_local_experts(routed, counts, banks), weights, route, group)

    inputs = (x.requires_grad_(True), weights.requires_grad_(True), banks.requires_grad_(True))
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.allclose(fn(*inputs), _dense(x, index, weights, banks))


def test_plain_kernels_without_autograd(group):
    x, index, weights = _data(0, 4, True, torch.float32)
    with torch.inference_mode():
        routed, counts, route = ops.moe_dispatch(x, index, EXPERTS, group)
        out = ops.moe_combine(_local_experts(routed, counts, _experts(torch.float32)), weights, route, group)
    assert torch.allclose(out, _dense(x, index, weights, _experts(torch.float32)), atol=1e-5)


def test_fake_kernels_under_export(group):
    class Exchange(torch.nn.Module):
        def forward(self, x, index, weights):
            routed, counts, route = ops.moe_dispatch(x, index, EXPERTS, group)
            return ops.moe_combine(routed * 2.0, weights, route, group)

    x, index, weights = _data(0, 5, False, torch.float32)
    program = torch.export.export(Exchange(), (x, index, weights), strict=False)
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert torch.ops.smp.moe_dispatch.default in targets and torch.ops.smp.moe_combine.default in targets
    assert torch.allclose(program.module()(x, index, weights), 2.0 * _dense(x, index, weights, _eye()))


def _eye():
    return torch.eye(H).expand(EXPERTS, H, H)


def test_bad_arguments_are_named(group):
    x, index, weights = _data(0, 3, False, torch.float32)
    with pytest.raises(RuntimeError, match=r"expert ids must be in \[0, 4\), got ids in"):
        ops.moe_dispatch(x, index + 3, EXPERTS, group)
    with pytest.raises(RuntimeError, match="top_k_index must be integer"):
        ops.moe_dispatch(x, weights, EXPERTS, group)
    with pytest.raises(RuntimeError, match="hidden must be"):
        ops.moe_dispatch(x[None], index, EXPERTS, group)
    _, _, route = ops.moe_dispatch(x, index, EXPERTS, group)
    with pytest.raises(RuntimeError, match="route must be the int64 route moe_dispatch returned"):
        ops.moe_combine(x, weights[:2], route, group)
    with pytest.raises(RuntimeError, match="one row per pair moe_dispatch routed to this rank"):
        ops.moe_combine(x, weights, route, group)
