"""smp.save_checkpoint / smp.resume_from_checkpoint: training resumed from a checkpoint continues
exactly as uninterrupted training does."""

from __future__ import annotations

import pipeline_cases
import torch
from harness import run_ranks

GLOBAL_BATCH = 8


def _build(smp):
    torch.manual_seed(0)
    with smp.tensor_parallelism(smp.tp_size() > 1):
        model, batch, forward, loss_fn = pipeline_cases.CASES["gpt"]()
    dmodel = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.Adam(dmodel.parameters(), lr=1e-2))

    @smp.step
    def train_step(b):
        loss = loss_fn(forward(dmodel, b), b)
        dmodel.backward(loss)
        return loss

    def train(steps):
        per = GLOBAL_BATCH // smp.dp_size()
        for s in steps:
            b = {
                k: v[smp.dp_rank() * per : (smp.dp_rank() + 1) * per]
                for k, v in batch(s, GLOBAL_BATCH).items()
            }
            opt.zero_grad()
            train_step(b)
            opt.step()

    return dmodel, opt, train


def _resume(rank, world_size, configs, folder):
    import smp

    results = []
    for i, config in enumerate(configs):
        smp.init(config)
        dmodel, _, train = _build(smp)
        train(range(4))
        expected = dmodel.state_dict()
        smp.parallel_state.reset()

        smp.init(config)
        dmodel, opt, train = _build(smp)
        train(range(2))
        smp.save_checkpoint(f"{folder}/{i}", "step2", model=dmodel, optimizer=opt, user_content={"step": 2})
        smp.parallel_state.reset()

        smp.init(config)
        dmodel, opt, train = _build(smp)
        user = smp.resume_from_checkpoint(f"{folder}/{i}")
        train(range(user["step"], 4))
        got = dmodel.state_dict()
        results.append(max((got[k] - expected[k]).abs().max().item() for k in expected))
        smp.parallel_state.reset()
    return results


def test_resume_continues_training_exactly(tmp_path):
    configs = [
        {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2},
        {"pipeline_parallel_degree": 2, "microbatches": 2, "shard_optimizer_state": True},
    ]
    for errs in run_ranks(_resume, 4, configs, str(tmp_path), timeout=400):
        assert all(e < 1e-6 for e in errs), errs


def _change_layout(rank, world_size, folder):
    """A full checkpoint written by pp=2 x tp=2 loads into plain data parallelism (rdp=4)."""
    import smp

    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2})
    dmodel, opt, train = _build(smp)
    train(range(2))
    saved = dmodel.state_dict()
    smp.save_checkpoint(folder, "full", partial=False, model=dmodel, optimizer=opt, user_content=None)
    smp.parallel_state.reset()

    smp.init({})
    dmodel, _, train = _build(smp)
    smp.resume_from_checkpoint(folder, partial=False, load_optimizer=False)
    local = dmodel.state_dict()
    err = max((local[k] - saved[k]).abs().max().item() for k in saved)
    train(range(2, 3))  # and it trains on
    smp.parallel_state.reset()
    return err


def test_full_checkpoint_changes_layout(tmp_path):
    for err in run_ranks(_change_layout, 4, str(tmp_path), timeout=300):
        assert err == 0.0, err


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    import pytest

    for message in run_ranks(_missing, 2, str(tmp_path), timeout=120):
        assert "no checkpoint in" in message and "newest" in message, message
    with pytest.raises(FileNotFoundError, match="does not exist"):
        import smp.checkpoint

        smp.checkpoint.load(str(tmp_path / "nothing"), partial=False)


def _missing(rank, world_size, folder):
    import smp

    smp.init({"pipeline_parallel_degree": 2})
    _build(smp)
    try:
        smp.resume_from_checkpoint(folder)
    except FileNotFoundError as err:
        return str(err)
    finally:
        smp.parallel_state.reset()
    return "no error"
