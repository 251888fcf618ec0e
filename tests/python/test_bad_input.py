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


def _bad_inputs(rank, world, microbatches=2):
    import smp

    smp.init({"microbatches": microbatches})
    model = smp.DistributedModel(torch.nn.Linear(4, 4))

    @smp.step
    def train_step(x, y):
        loss = (model(x) - y).pow(2).mean()
        model.backward(loss)
        return loss

    train_step(torch.zeros(4, 4), torch.zeros(4, 4))  # a good call first: its shape is known to bind
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


def test_step_arguments_by_message_with_one_microbatch():
    """One microbatch takes a shorter way through the arguments: the same errors come out of it."""
    (messages,) = run_ranks(_bad_inputs, 1, 1, init=False)
    for case, (_, expected) in CASES.items():
        if case != "indivisible batch":  # (any batch divides into one)
            assert expected in messages.get(case, ""), (case, messages.get(case))


def _misuse(rank, world):
    import smp

    smp.init({})
    model = smp.DistributedModel(torch.nn.Linear(4, 4))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def manual_backward(x):
        loss = model(x).sum()
        loss.backward()
        return loss

    @smp.step
    def train_step(x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    @smp.step
    def evaluate_then_manual_backward(x, train):
        loss = model(x).sum()
        if train:
            loss.backward()
        return loss

    messages = {}
    for case, call in {
        "optimizer before any step": optimizer.step,
        "manual loss.backward()": lambda: manual_backward(torch.zeros(2, 4)),
        "loss.backward() after forward-only steps": lambda: [
            evaluate_then_manual_backward(torch.zeros(2, 4), train) for train in (False, False, True)
        ],
        "wrong arguments": lambda: train_step(torch.zeros(2, 4), torch.zeros(2, 4)),
    }.items():
        try:
            call()
        except (ValueError, RuntimeError) as e:
            messages[case] = str(e)
    return messages


def test_misuse_by_message():
    (messages,) = run_ranks(_misuse, 1, init=False)
    assert (
        "optimizer.step() was called before any @smp.step function" in messages["optimizer before any step"]
    )
    assert "call model.backward(loss) instead" in messages["manual loss.backward()"]
    assert "call model.backward(loss) instead" in messages["loss.backward() after forward-only steps"]
    assert "train_step(x) cannot take these arguments" in messages["wrong arguments"]


class _Returns(torch.nn.Module):
    """Two linear layers (one per stage) returning `kind` of output."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.b(self.a(x))
        if self.kind == "sparse":
            return y.to_sparse()
        if self.kind == "view":
            return y.t()  # non-contiguous: sent contiguous
        return {"y": y, "name": "a string"}  # a non-tensor output: a constant of the graph


def _output_of(kind: str) -> str:
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout": 5})
    model = smp.DistributedModel(_Returns(kind))

    @smp.step
    def train_step(x):
        out = model(x)
        y = out["y"] if isinstance(out, dict) else out
        loss = y.to_dense().sum() if y.is_sparse else y.sum()
        model.backward(loss)
        return out

    try:
        result = train_step(torch.randn(4, 8))
        if kind == "autocast":  # captured without it: stage 0 would now send bfloat16
            with torch.autocast("cpu", dtype=torch.bfloat16):
                result = train_step(torch.randn(4, 8))
        return "ok" if kind == "view" else result["name"][0]
    except (ValueError, RuntimeError) as e:
        return str(e)


def _outputs(rank, world):
    from smp import parallel_state

    out = {}
    for kind in ("view", "non-tensor", "sparse"):  # sparse last: it fails the pipeline
        out[kind] = _output_of(kind)
        parallel_state.reset()
    return out


def test_outputs_that_cannot_be_sent():
    stage0, stage1 = run_ranks(_outputs, 2, init=False)
    assert stage0["view"] == stage1["view"] == "ok"
    assert stage0["non-tensor"] == stage1["non-tensor"] == "a string"
    assert "is a torch.sparse_coo tensor, which the pipeline cannot send" in stage1["sparse"]
    assert "return it dense (tensor.to_dense())" in stage1["sparse"]
    # Stage 0, waiting for that output, names the rank that failed (it stayed alive: the timeout).
    assert "rank 1 failed: ValueError: smp: the model's value" in stage0["sparse"], stage0["sparse"]


def _autocast_after_capture(rank, world):
    return _output_of("autocast")


def test_a_step_under_autocast_after_a_capture_without_it():
    stage0, stage1 = run_ranks(_autocast_after_capture, 2, init=False)
    # A step under autocast after a capture without it: the value sent would not match the buffer
    # the receiver sizes from the capture (Gloo fails on the size; NCCL would hang or mix up data).
    assert "is (2, 8) torch.bfloat16, but the stage graph was captured with (2, 8) torch.float32" in stage0, (
        stage0
    )
    assert "under the autocast setting of the step that captured the graph" in stage0
    assert "from stage 0 with rank 0" in stage1, stage1  # the other rank does not hang: names it
