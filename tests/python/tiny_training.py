"""A two-layer model under smp, trained one step: for tests of what checkpoints keep."""

from __future__ import annotations

import torch


def tiny(smp, config: dict, width: int = 4, optimizer=torch.optim.SGD):
    """smp.init(config), a DistributedModel of two Linear(width, width) layers and its
    DistributedOptimizer (lr 0.1), after one step on ones; returns (model, optimizer, step), where
    step(x) trains one more step on the batch x."""
    smp.init(config)
    torch.manual_seed(0)
    model = smp.DistributedModel(
        torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    )
    optimizer = smp.DistributedOptimizer(optimizer(model.parameters(), lr=0.1))

    @smp.step
    def train(x):
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    def step(x) -> None:
        optimizer.zero_grad()
        train(x)
        optimizer.step()

    step(torch.ones(4, width))
    return model, optimizer, step
