"""The README's main job runs under torchrun (env:// init) and checks itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_torchrun(script: str, nproc: int, timeout: float = 180.0) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(ROOT / script),
    ]
    # Own session, so a hang kills torchrun and every worker it started.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{script} hung for {timeout}s:\n{out}") from None
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{out}"
    return out


def test_backend_demo_under_torchrun():
    out = run_torchrun("examples/backend_demo.py", nproc=2)
    assert "demo finished: every collective matched its reference" in out, out
    assert "all_to_all_single" in out and "throttle stats (cpu)" in out


def test_main_job_trains_gpt_with_pipeline_under_torchrun():
    out = run_torchrun("examples/train_gpt.py", nproc=2)
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 7, out
    # Counting sequences are learnable: the loss falls far below uniform guessing (ln 128 = 4.85).
    assert losses[0] > 4.0 and losses[-1] < 0.6 * losses[0], out
    assert "stage 1" in out and "tok.weight: stages [0, 1]" in out
    assert "done: 30 steps on 2 processes (pp=2, dp=1)" in out
