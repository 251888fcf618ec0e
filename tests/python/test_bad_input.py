"""Bad input to smp.step is a ValueError that names the value and the fix (a world of one)."""

from __future__ import annotations

import numpy as np
import torch
from harness import run_ranks

CASES = {
    "empty batch": (lambda: (torch.zeros(0, 4), torch.zeros(0, 4)), "'x' is an empty batch"),
    "mismatched batch sizes": (lambda: (torch.zeros(4, 4), torch.zeros(6, 4)), "different batch sizes"),
    "wrong device": (lambda: (torch.zeros(4, 4, device="meta"), torch.zeros(4, 4)), "is on device meta"),
    "numpy array": (lambda: (np.zeros((4, 4)), torch.zeros(4, 4)), "torch.from_numpy"),
    "0-dim tensor": (lambda: (torch.tensor(1.0), torch.zeros(4, 4)), "non_split_inputs"),
    "indivisible batch": (lambda: (torch.zeros(3, 4), torch.zeros(3, 4)), "does not divide into 2"),
}


def _bad_inputs(rank, world):
    import smp

    smp.init({"microbatches": 2})
    model = smp.DistributedModel(torch.nn.Linear(4, 4))

    @smp.step
    def train_step(x, y):
        loss = (model(x) - y).pow(2).mean()
        model.backward(loss)
        return loss

    messages = {}
    for case, (make, _) in CASES.items():
        try:
            train_step(*make())
        except ValueError as e:
            messages[case] = str(e)
    return messages


def test_step_arguments_by_message():
    (messages,) = run_ranks(_bad_inputs, 1, init=False)
    for case, (_, expected) in CASES.items():
        assert expected in messages.get(case, ""), (case, messages.get(case))
