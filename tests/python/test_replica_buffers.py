"""Buffers across data-parallel replicas, as DDP keeps them (broadcast_buffers=True, the default):
at each step's start every replica takes the first replica's buffers (BatchNorm's running
statistics), so replicas fed different data still hold one model; broadcast_buffers=False leaves
each replica its own."""

from __future__ import annotations

import torch
from harness import run_ranks


def _buffers_seen_at_forward(rank, world, broadcast):
    import smp
    from smp import parallel_state

    smp.init({})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    model = smp.DistributedModel(net, broadcast_buffers=broadcast)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []

    @smp.step
    def train(x):
        seen.append(net[1].running_mean.tolist())  # after the step's start, before its forward
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    try:
        for s in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * s + rank)) + rank
            opt.zero_grad()
            train(x)
            opt.step()
        return seen, net[1].running_mean.tolist()
    finally:
        parallel_state.reset()


def test_replicas_take_the_first_replicas_buffers_each_step():
    (seen0, end0), (seen1, end1) = run_ranks(_buffers_seen_at_forward, 2, True, timeout=120)
    assert seen0 == seen1  # every step starts from rank 0's statistics, on both replicas
    assert end0 != end1  # (each replica's forward then updated them with its own data)
    (seen0, _), (seen1, _) = run_ranks(_buffers_seen_at_forward, 2, False, timeout=120)
    assert seen0[0] == seen1[0] and seen0[1:] != seen1[1:]  # without it, each keeps its own
