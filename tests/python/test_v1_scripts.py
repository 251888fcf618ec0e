"""Scripts in the patterns of real SMP v1 training scripts, under torchrun on CPU processes, each
checked against the same training in one process (plain torch)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_main_job import run_torchrun

ROOT = Path(__file__).resolve().parents[2]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _smp_imports(name: str) -> list[str]:
    lines = (ROOT / "examples" / f"{name}.py").read_text().splitlines()
    return [
        line for line in lines if line.startswith(("import", "from")) and ("smp" in line or "smdist" in line)
    ]


def _mnist_reference(mnist, steps: list[int]):
    """One process, plain torch: the script's net, data and Adadelta, batch 16."""
    torch.manual_seed(1)
    net = mnist.Net()
    opt = torch.optim.Adadelta(net.parameters(), lr=1.0)
    data = mnist.digits(64 * 16, 0)
    losses = []
    for step in steps:
        images, labels = data[step * 16 : (step + 1) * 16]
        opt.zero_grad()
        loss = F.nll_loss(net(images), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    images, labels = mnist.digits(64, 1)[:]
    with torch.no_grad():
        out = net(images)
    test_loss = F.nll_loss(out, labels, reduction="sum").item() / 64
    correct = out.argmax(1).eq(labels).sum().item()
    return losses, test_loss, correct, net.state_dict()


def _check(result_file: Path, reference, what: str, replicas: int):
    got = json.loads(result_file.read_text())
    losses, test_loss, correct, params = reference
    # Rank 0's training loss is its replica's: the whole batch's only with one replica.
    assert replicas > 1 or max(abs(a - b) for a, b in zip(got["losses"], losses, strict=True)) < 1e-5, (
        what,
        got["losses"],
        losses,
    )
    assert abs(got["test_loss"] - test_loss) < 1e-5 and got["correct"] == correct, (
        what,
        got,
        test_loss,
        correct,
    )
    err = max((torch.tensor(got["params"][k]) - v).abs().max().item() for k, v in params.items())
    assert err < 1e-5, (what, err)


def test_mnist_style_script_pp2_dp2_saves_and_loads_before_the_first_step(tmp_path):
    assert _smp_imports("v1_mnist") == ["import smdistributed.modelparallel.torch as smp"]
    mnist = _example("v1_mnist")
    partial, full = tmp_path / "partial.pt", tmp_path / "full.pt"
    # Run 1: 4 processes (2 stages x 2 replicas), 3 steps, then a partial and a full save.
    out = run_torchrun(
        "examples/v1_mnist.py", 4, "--steps", "3", "--save-partial", str(partial), "--save-full", str(full),
        "--results", str(tmp_path / "run1.json"), timeout=300,
    )  # fmt: skip
    _check(tmp_path / "run1.json", _mnist_reference(mnist, [0, 1, 2]), "run 1", replicas=2)
    assert sorted(p.name for p in tmp_path.glob("partial.pt_*")) == [
        "partial.pt_0",
        "partial.pt_1",
    ]  # per mp_rank
    assert full.exists() and "test loss" in out
    # Runs 2 and 3: new processes load (before the first step: deferred) and train one more step,
    # continuing exactly where run 1 stopped, on one replica (2 processes) instead of two.
    continued = _mnist_reference(mnist, [0, 1, 2, 0])
    continued = (continued[0][-1:], *continued[1:])
    run_torchrun(
        "examples/v1_mnist.py", 2, "--steps", "1", "--load", str(partial),
        "--results", str(tmp_path / "run2.json"), timeout=300,
    )  # fmt: skip
    _check(tmp_path / "run2.json", continued, "partial load", replicas=1)
    run_torchrun(
        "examples/v1_mnist.py", 2, "--steps", "1", "--load", str(full), "--load-partial", "0",
        "--results", str(tmp_path / "run3.json"), timeout=300,
    )  # fmt: skip
    _check(tmp_path / "run3.json", continued, "full load", replicas=1)


# The notebook's lr is 1e-3; at 2e-2 a step moves the bf16 weights far beyond their rounding.
GPT2_LR = 2e-2


def _gpt2_reference(notebook, optimizer_steps: int, passes: int = 2, batch: int = 4):
    """One process, plain torch and transformers: the same model, data, Adam and accumulation."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(notebook.model_config())
    opt = torch.optim.Adam(net.parameters(), lr=GPT2_LR)
    data = notebook.token_batches(optimizer_steps * passes, batch)
    losses = []
    for step in range(optimizer_steps):
        opt.zero_grad()
        for k in range(passes):
            ids = data[step * passes + k]
            loss = net(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)["loss"]
            (loss / passes).backward()
            losses.append(loss.item())
        opt.step()
    return losses, net.state_dict()


def test_gpt2_notebook_style_script_fp32_then_resumed_in_bf16(tmp_path):
    pytest.importorskip("transformers")
    assert _smp_imports("v1_gpt2_notebook") == [
        "import smdistributed.modelparallel",
        "import smdistributed.modelparallel.torch as smp",
        "from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2",
    ]
    notebook = _example("v1_gpt2_notebook")
    ckpt = tmp_path / "ckpt"
    # 2 pipeline stages (manual partition), 2 optimizer steps of 2 accumulated passes, fp32.
    common = ("--checkpoint_dir", str(ckpt), "--lr", str(GPT2_LR), "--results")
    run_torchrun("examples/v1_gpt2_notebook.py", 2, *common, str(tmp_path / "fp32.json"), timeout=300)
    got = json.loads((tmp_path / "fp32.json").read_text())
    losses, at_step2 = _gpt2_reference(notebook, 2)
    assert max(abs(a - b) for a, b in zip(got["losses"], losses, strict=True)) < 1e-5, (got["losses"], losses)
    # (measured 3.5e-5, where the 2 steps moved the weights by 0.04)
    err = max((torch.tensor(got["params"][k]) - v).abs().max().item() for k, v in at_step2.items())
    assert err < 1e-4 and got["overflow"] == [False, False], err
    assert (ckpt / "newest").read_text() == "step_2"
    # A new run resumes that checkpoint in bf16 (the same dynamic-loss arguments: no scaling there).
    run_torchrun(
        "examples/v1_gpt2_notebook.py", 2, "--bf16", "1", "--resume", "1", "--steps", "1",
        *common, str(tmp_path / "bf16.json"), timeout=300,
    )  # fmt: skip
    got = json.loads((tmp_path / "bf16.json").read_text())
    losses, params = _gpt2_reference(notebook, 3)
    # The losses of step 3's passes, on the weights resumed (measured 1.4e-4).
    assert max(abs(a - b) for a, b in zip(got["losses"], losses[-2:], strict=True)) < 1e-3, (got, losses)
    # Step 3 itself, in bf16: under Adam bf16's rounding of tiny gradients moves single weights as far
    # as the step does, so the whole step is compared: its error within 1/10 of the step (measured
    # 1/21; the step skipped is 1/1 off, and masters not taken from the fp32 checkpoint 2.5/1).
    weights = {k: torch.tensor(got["params"][k]) for k in params}
    err, step = _norm(weights, params), _norm(params, at_step2)
    assert err < step / 10 and got["overflow"] == [False], (err, step)


def _norm(a: dict, b: dict) -> float:
    """The L2 norm of a - b over every tensor of a model."""
    return sum(((a[k].double() - b[k].double()) ** 2).sum().item() for k in b) ** 0.5
