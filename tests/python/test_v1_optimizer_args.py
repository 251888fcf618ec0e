"""SMP v1's real DistributedOptimizer signature, as the notebooks call it, and optimizer.overflow."""

from __future__ import annotations

import torch
from harness import run_ranks

NOTEBOOK_ARGS = {
    "static_loss_scale": None,
    "dynamic_loss_scale": True,
    "dynamic_loss_args": {"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
}


def _one_run(config: dict, kwargs: dict, batches: list[torch.Tensor]):
    import smp

    smp.init(config)
    torch.manual_seed(0)
    model = smp.DistributedModel(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    )
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)

    @smp.step
    def train(x):
        loss = model(x).float().pow(2).mean()
        model.backward(loss)
        return loss

    record = []
    for x in batches:
        opt.zero_grad()
        train(x)
        opt.step()
        record.append((opt.overflow, opt.loss_scale))
    smp.parallel_state.reset()
    return record


def _signature_and_overflow(rank, world_size):
    good = [torch.ones(2, 4)] * 2
    poisoned = [torch.ones(2, 4), torch.full((2, 4), float("inf")), torch.ones(2, 4)]
    out = {
        "fp32": _one_run({}, NOTEBOOK_ARGS, good),
        "bf16": _one_run({"bf16": True}, NOTEBOOK_ARGS, good),
        "fp16_dict": _one_run(
            {"fp16": True},
            {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0**10, "delayed_shift": 1}},
            poisoned,
        ),
        "fp16_static": _one_run({"fp16": True}, {"static_loss_scale": 8.0}, good),
        "fp32_static": _one_run({}, {"static_loss_scale": 8.0}, good),
    }
    errors = {}
    import smp

    smp.init({})
    smp.DistributedModel(torch.nn.Linear(2, 2))
    model = smp.state.model
    for name, kwargs in {
        "not_a_dict": {"dynamic_loss_args": 1000},
        "unknown": {"dynamic_loss_args": {"window": 5}},
        "twice": {"dynamic_loss_args": {"min_scale": 1}, "min_scale": 2},
        "bad_scale": {"static_loss_scale": 0},
    }.items():
        try:
            smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        except (TypeError, ValueError) as e:
            errors[name] = str(e)
    return out, errors


def test_notebook_arguments_scale_only_in_fp16_and_overflow_is_reported():
    [(out, errors)] = run_ranks(_signature_and_overflow, 1, timeout=120)
    # fp32 and bf16: the dynamic-scaling arguments are accepted and scale nothing, as in SMP.
    assert out["fp32"] == [(False, 1.0), (False, 1.0)]
    assert out["bf16"] == [(False, 1.0), (False, 1.0)]
    assert out["fp32_static"] == [(False, 1.0), (False, 1.0)]
    # fp16: the dict keyword configures dynamic scaling; the inf batch's step is skipped and halves it.
    assert out["fp16_dict"] == [(False, 2.0**10), (True, 2.0**9), (False, 2.0**9)]
    assert out["fp16_static"] == [(False, 8.0), (False, 8.0)]
    assert "dynamic_loss_args must be a dict" in errors["not_a_dict"]
    assert "unknown dynamic_loss_args ['window']" in errors["unknown"]
    assert "['min_scale'] given both in dynamic_loss_args and as keywords" in errors["twice"]
    assert "static_loss_scale must be > 0" in errors["bad_scale"]
