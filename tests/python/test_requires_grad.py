"""Which parameters train: requires_grad set before the first training step is followed (the
gradient averaging of a whole model is set up when it is wrapped, so it must follow a change made
after smp.DistributedModel(...)); a change after that step is a clear error at the next backward,
not gradients silently left out or never averaged (both happened before). Forward-only steps may
run with anything frozen. Each case against one process training the same model."""

from __future__ import annotations

import copy

import models
import torch
from harness import run_ranks

STEPS = 3


def _train(rank, world, config, when):
    import smp
    from smp import parallel_state

    smp.init(config)
    torch.manual_seed(0)
    net = models.GPT(layers=2)
    if when == "frozen when wrapped, unfrozen before step 1":
        net.blocks[0].requires_grad_(False)
    ref = copy.deepcopy(net)
    model = smp.DistributedModel(net)

    def set_block0(flag: bool) -> None:
        model.get_module().blocks[0].requires_grad_(flag)
        ref.blocks[0].requires_grad_(flag)

    if when == "frozen when wrapped, unfrozen before step 1":
        set_block0(True)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    if when == "frozen after the optimizer, before step 1":
        set_block0(False)
    if when == "frozen after the optimizer built its state":
        opt.state_dict()  # builds the flat (sharded) state for the parameters requiring grad now
        set_block0(False)

    @smp.step
    def train_step(ids):
        loss = models.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    @smp.step
    def eval_step(ids):
        return models.lm_loss(model(ids), ids)

    whole = smp.pp_size() > 1  # the pipeline takes the global batch; data parallelism its shard
    try:
        for s in range(STEPS):
            if when == "frozen after step 1" and s == 1:
                set_block0(False)
            length = 16
            if when == "evaluated all frozen on a new shape, then trained on it" and s == STEPS - 1:
                length = 12  # a signature first captured by the frozen evaluation below
                model.get_module().requires_grad_(False)
                with torch.no_grad():
                    eval_step(torch.zeros(8 if whole else 4, length, dtype=torch.long))
                model.get_module().requires_grad_(True)
            ids = torch.randint(0, 64, (8, length), generator=torch.Generator().manual_seed(s))
            opt.zero_grad()
            train_step(ids if whole else ids[rank * 4 : (rank + 1) * 4])
            opt.step()
            ref_opt.zero_grad()
            models.lm_loss(ref(ids), ids).backward()
            ref_opt.step()
        if when == "all frozen for evaluation":
            model.get_module().requires_grad_(False)
            with torch.no_grad():
                eval_step(ids if whole else ids[rank * 4 : (rank + 1) * 4])
    except (ValueError, RuntimeError) as error:
        return str(error)
    finally:
        parallel_state.reset()
    reference = dict(ref.named_parameters())
    return max((p - reference[n]).abs().max().item() for n, p in model.local_named_parameters())


CASES = [
    ({"microbatches": 2}, "frozen when wrapped, unfrozen before step 1"),
    ({"microbatches": 2, "shard_optimizer_state": True}, "frozen after the optimizer, before step 1"),
    ({"microbatches": 2}, "all frozen for evaluation"),
    ({"microbatches": 2}, "frozen after step 1"),
    (
        {"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": "zero_bubble"},
        "evaluated all frozen on a new shape, then trained on it",
    ),
]
NAMED = "smp: requires_grad of 'blocks.0.ln1.weight' (True -> False)"


def _all_cases(rank, world):
    return [_train(rank, world, config, when) for config, when in CASES]


def test_requires_grad_is_followed_until_the_first_step_and_refused_after():
    per_rank = run_ranks(_all_cases, 2, timeout=300)
    for i, (config, when) in enumerate(CASES):
        got = [results[i] for results in per_rank]
        if when == "frozen after step 1":
            assert all(isinstance(m, str) and NAMED in m for m in got), (config, when, got)
            assert "Set requires_grad before the first smp.step call" in got[0], got[0]
        else:
            assert all(isinstance(err, float) and err < 1e-5 for err in got), (config, when, got)


def _pipeline_frozen_after_step_1(rank, world):
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": "zero_bubble"}
    return _train(rank, world, config, "frozen after step 1")


def test_a_pipeline_refuses_requires_grad_changed_after_step_1():
    """Its own launch: a process reports only its first failure to the others."""
    stage0, stage1 = run_ranks(_pipeline_frozen_after_step_1, 2, timeout=120)
    # Stage 0 holds blocks.0 and raises; stage 1, waiting on it, names stage 0's error.
    assert isinstance(stage0, str) and NAMED in stage0, stage0
    assert isinstance(stage1, str) and "rank 0 failed: ValueError: " + NAMED in stage1, stage1


def _frozen_after_optimizer_state(rank, world):
    config = {"microbatches": 2, "shard_optimizer_state": True}
    return _train(rank, world, config, "frozen after the optimizer built its state")


def test_requires_grad_changed_after_the_optimizer_built_its_state_is_refused():
    """Sharded (or mixed-precision) optimizer state holds the parameters requiring grad when it is
    built: after that, as after step 1, a change is refused. Its own launch (it fails)."""
    for message in run_ranks(_frozen_after_optimizer_state, 2, timeout=120):
        assert isinstance(message, str) and NAMED in message, message
