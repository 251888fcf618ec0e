"""Microbatches of one step that run different programs, on 2 pipeline ranks (smp.pipeline.messages).

Each stage posts its next forward's and next backward's receives a microbatch ahead, in the layout
of the program it ran. Here the step function trims each microbatch to its own length (the
program changes from microbatch to microbatch: 16, 11, 16, 7 tokens, so every link sees a change
both ways) and one microbatch of each step runs no backward (its gradients' receives were posted
and must be answered). Under 1F1B, ZB-H1 (split backward) and ZB-V (two stages per rank): the
losses and the parameters after 3 Adam steps match one process computing the same microbatches;
and the next steps run (nothing posted was left to steal their messages). On the ordered path,
where both ends post in one order, such a step is refused with an error that says what to do."""

from __future__ import annotations

import copy

import models
import torch
from harness import run_ranks

M = 4
LENGTHS = (16, 11, 16, 7)  # tokens kept by microbatch k
NO_BACKWARD = {0: 2, 1: 3, 2: 0}  # step -> the microbatch that runs no backward
STEPS = 3
LAYOUTS = ("interleaved", "zero_bubble", "zero_bubble_v")


def _batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, 64, (2 * M, 16), generator=g)
    lengths = torch.tensor([n for n in LENGTHS for _ in range(2)])
    skip = torch.tensor([k == NO_BACKWARD[step] for k in range(M) for _ in range(2)])
    return {"ids": ids, "length": lengths, "skip": skip}


def _reference():
    torch.manual_seed(0)
    model = models.GPT(layers=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        b = _batch(step)
        opt.zero_grad()
        for k in range(M):
            rows = slice(2 * k, 2 * k + 2)
            ids = b["ids"][rows, : int(b["length"][rows][0])]
            loss = models.lm_loss(model(ids), ids)
            losses.append(loss.item())
            if not bool(b["skip"][rows][0]):
                (loss / M).backward()  # (smp averages the microbatches' gradients)
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _step_function(model):
    def train_step(ids, length, skip):
        ids = ids[:, : int(length[0])]  # this microbatch's own length: its own program
        loss = models.lm_loss(model(ids), ids)
        if not bool(skip[0]):
            model.backward(loss)
        return loss

    return train_step


def _train(rank, world_size):
    import smp

    ref_losses, ref_params = _reference()
    results = {}
    for schedule in LAYOUTS:
        smp.init({"pipeline_parallel_degree": 2, "microbatches": M, "pipeline": schedule})
        torch.manual_seed(0)
        model = smp.DistributedModel(copy.deepcopy(models.GPT(layers=4)))
        opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
        train_step = smp.step(_step_function(model))
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            out = train_step(**_batch(step))
            losses += [t.item() for t in out.outputs]
            opt.step()
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
        local = dict(model.local_named_parameters())
        param_err = max((local[n] - ref_params[n]).abs().max().item() for n in local)
        results[schedule] = (loss_err, param_err, len(local))
        smp.parallel_state.reset()
    results["ordered"] = _ordered_refuses_a_change(smp)
    return results


def _ordered_refuses_a_change(smp) -> str:
    """On the ordered path both ends post in one order that a change of program would break: the
    step's second microbatch, on another program, is refused with an error (last: the step fails)."""
    smp.init({"pipeline_parallel_degree": 2, "microbatches": M, "ordered_messages": True})
    model = smp.DistributedModel(models.GPT(layers=4))
    train_step = smp.step(_step_function(model))
    try:
        train_step(**_batch(0))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_microbatches_of_one_step_on_different_programs_train_as_one_process():
    for per_rank in run_ranks(_train, 2, timeout=300):
        refused = per_rank.pop("ordered")
        assert "with ordered_messages, every microbatch of a step must run one program" in refused, refused
        assert "set ordered_messages to false" in refused, refused
        for schedule, (loss_err, param_err, held) in per_rank.items():
            assert held > 0, schedule
            assert loss_err < 1e-5 and param_err < 1e-5, (schedule, loss_err, param_err)
