"""The non-finite check ("check_finite", or "debug"): a NaN/inf in fp32 training is reported on
every rank with the step and the stage where it first appeared."""

from __future__ import annotations

import torch
from harness import run_ranks


def _train(rank, world, config, bad_step, where):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, **config})
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(x, y):
        loss = (model(x) - y).pow(2).mean()
        model.backward(loss)
        return loss

    for step in range(1, 5):
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        if step == bad_step:
            if where == "input":
                x[3, 0] = float("inf")  # microbatch 1: stage 0's activations
            else:
                y[0, 0] = float("nan")  # the loss only
        try:
            optimizer.zero_grad()
            train_step(x, y)
            optimizer.step()
        except FloatingPointError as e:
            return str(e)
    return None


SCENARIOS = {
    "input": ({"check_finite": True}, 3, "input"),
    "debug": ({"debug": True}, 2, "target"),
    "off": ({}, 2, "target"),
    "fp16": ({"check_finite": True, "fp16": True}, 2, "target"),
    # Four stages in a V: each rank runs two, and a finding names the stage that computed it.
    "input_v": ({"check_finite": True, "pipeline": "zero_bubble_v"}, 3, "input"),
    "target_v": ({"check_finite": True, "pipeline": "zero_bubble_v"}, 2, "target"),
}


def _all(rank, world):
    """Every scenario in one pair of processes (spawning one costs seconds)."""
    from smp import parallel_state

    out = {}
    for name, (config, bad_step, where) in SCENARIOS.items():
        out[name] = _train(rank, world, config, bad_step, where)
        parallel_state.reset()
    return out


def test_nonfinite_reports():
    for out in run_ranks(_all, 2, init=False):
        # Where it first appeared: stage 0's activations; then what followed, on stage 1 too.
        message = out["input"]
        assert message.startswith("smp check_finite: a NaN or inf first appeared at step 3 in activation ")
        assert "of microbatch 1 on pipeline stage 0 (rank 0)" in message, message
        assert "then activation " in message and "on pipeline stage 1 (rank 1)" in message, message
        # "debug" turns it on; a NaN target shows first in the loss.
        assert "first appeared at step 2 in the loss of microbatch 0 on pipeline stage " in out["debug"]
        # Off: training goes on (SMP's behaviour); fp16: the loss scaler's overflow handling decides.
        assert out["off"] is None and out["fp16"] is None
        message = out["input_v"]
        assert "of microbatch 1 on pipeline stage 0 (rank 0)" in message, message
        assert "on pipeline stage 1 (rank 1)" in message, message
        assert "in the loss of microbatch 0 on pipeline stages 0, 3 (rank 0)" in out["target_v"], out[
            "target_v"
        ]
