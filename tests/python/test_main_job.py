"""The README's main job runs under torchrun (env:// init) and checks itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_torchrun(script: str, nproc: int, *args: str, timeout: float = 180.0) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(ROOT / script),
        *args,
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


def test_smp_v1_script_trains_under_torchrun(tmp_path):
    script = (ROOT / "examples/smp_v1_script.py").read_text()
    # Only the import line would differ from an SMP v1 script.
    assert [
        line for line in script.splitlines() if line.startswith(("import", "from")) and "smp" in line
    ] == ["import smp"]
    out = run_torchrun("examples/smp_v1_script.py", 4, "--epochs", "1", "--save", str(tmp_path / "ckpt"))
    before = float(out.split("test loss before training ")[1].split()[0])
    after = float(out.split("Test epoch 1: loss ")[1].split()[0])
    assert before > 3.5 and after < 0.3 * before, out  # counting is learnable: ln 64 = 4.16 at start
    assert "done: 1 epochs on 4 processes (pp=2, tp=2)" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ckpt_{r}" for r in range(4)]  # one per mp_rank


def test_main_job_smoke(tmp_path):
    """The README's main job, a few steps: the CSV log, the PNG curve, a checkpoint, and a resume."""
    out_dir, ckpt = tmp_path / "out", tmp_path / "ckpt"
    common = (
        "--out-dir",
        str(out_dir),
        "--checkpoint-dir",
        str(ckpt),
        "--save-every",
        "4",
        "--log-every",
        "1",
    )
    out = run_torchrun("examples/train_gpt2.py", 4, "--steps", "8", *common, timeout=300)
    assert "pp=2 tp=2 rdp=1" in out and "done: 8 steps" in out, out
    rows = (out_dir / "log.csv").read_text().splitlines()
    assert rows[0] == "step,loss,lr,tokens_per_s" and len(rows) == 9, rows
    losses = [float(r.split(",")[1]) for r in rows[1:]]
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.0, losses  # ln 256 = 5.55 at the start
    assert (out_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ckpt / "newest").read_text() == "step_8" and (ckpt / "step_4_partial").is_dir()
    # Resuming continues from step 8 with the restored model: no jump back to the initial loss.
    out = run_torchrun("examples/train_gpt2.py", 4, "--steps", "10", *common, timeout=300)
    rows = (out_dir / "log.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[-3:]] == ["8", "9", "10"], rows
    assert float(rows[-2].split(",")[1]) < losses[0] - 1.0, rows


def test_main_job_mixtral_ep(tmp_path):
    """The main job on transformers' Mixtral with its experts divided over 2 ranks (--ep 2): it trains."""
    out_dir = tmp_path / "out"
    args = ("--model", "mixtral", "--pp", "1", "--tp", "1", "--ep", "2", "--layers", "2", "--dim", "64")
    out = run_torchrun(
        "examples/train_gpt2.py", 2, "--steps", "8", "--log-every", "1", "--out-dir", str(out_dir), *args
    )
    assert "Mixtral" in out and "pp=1 tp=1 rdp=2 sdp=1 ep=2" in out and "done: 8 steps" in out, out
    losses = [float(r.split(",")[1]) for r in (out_dir / "log.csv").read_text().splitlines()[1:]]
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.0, losses  # ln 256 = 5.55 at the start


def test_main_job_sdp(tmp_path):
    """The main job with --sdp 2 over two pipeline stages (4 processes): it trains (sharded data
    parallelism clipping at --clip) and checkpoints."""
    out_dir, ckpt = tmp_path / "out", tmp_path / "ckpt"
    common = (
        "--pp",
        "2",
        "--tp",
        "1",
        "--sdp",
        "2",
        "--out-dir",
        str(out_dir),
        "--checkpoint-dir",
        str(ckpt),
    )
    out = run_torchrun("examples/train_gpt2.py", 4, "--steps", "8", "--log-every", "1", *common, timeout=300)
    assert "pp=2 tp=1 rdp=2 sdp=2" in out and "done: 8 steps" in out, out
    losses = [float(r.split(",")[1]) for r in (out_dir / "log.csv").read_text().splitlines()[1:]]
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.0, losses
    # (resumed by the main job in test_main_job_smoke; sdp checkpoints across layouts in test_sdp.py)
    assert (ckpt / "newest").read_text() == "step_8", sorted(p.name for p in ckpt.iterdir())


def test_main_job_cp_matches_one_process(tmp_path):
    """--cp 2 (ring attention) on 2 processes logs one process's losses on the same global batch,
    with rows of varied length padded to a multiple of 2 x cp; a length that does not cut is
    refused with the one to use."""
    job = ("--pp", "1", "--tp", "1", "--layers", "2", "--dim", "64", "--seq-len", "64", "--dynamic-padding")
    job += ("--steps", "4", "--log-every", "1")

    def losses(nproc: int, *more: str) -> list[float]:
        out_dir = tmp_path / f"out{nproc}"
        out = run_torchrun("examples/train_gpt2.py", nproc, *job, "--out-dir", str(out_dir), *more)
        assert "done: 4 steps" in out and ("cp=2 (p2p)" in out) == (nproc == 2), out
        return [float(r.split(",")[1]) for r in (out_dir / "log.csv").read_text().splitlines()[1:]]

    one, cut = losses(1), losses(2, "--cp", "2")  # (the header names smp's cp degree, not the flag)
    assert len(one) == 4 and one[-1] < one[0] - 0.5, one  # it trains
    assert max(abs(a - b) / a for a, b in zip(one, cut, strict=True)) < 1e-5, (one, cut)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), WORLD_SIZE="2")
    refused = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/train_gpt2.py"),
            "--pp",
            "1",
            "--tp",
            "1",
            "--cp",
            "2",
            "--seq-len",
            "66",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "use --seq-len 68" in refused.stderr, refused.stderr
