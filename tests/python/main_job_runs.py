"""The main job (examples/train_gpt2.py) under torchrun, for tests and benchmarks that kill it:
start it, find its workers, wait for a step or a save in flight, finish it (the process group
killed on a timeout), and read its final parameters and logged losses.

Each run has a folder of its own: `log.txt` (torchrun's and the workers' output), `ck/` (the
checkpoint directory), `out/` (rank 0's log.csv).
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_gpt2.py"


def torchrun(procs: int, folder: Path, job: list[str], restarts: int = 0) -> subprocess.Popen:
    """Starts `torchrun --standalone` of the main job with `job`'s flags, checkpointing to
    folder/ck and logging to folder/out, in a session of its own (killpg ends all of it)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
    args += [f"--max-restarts={restarts}", str(SCRIPT), *job, "--checkpoint-dir", str(folder / "ck")]
    args += ["--out-dir", str(folder / "out")]
    log = open(folder / "log.txt", "a")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def tail(folder: Path, chars: int = 3000) -> str:
    return (folder / "log.txt").read_text()[-chars:]


def finish(proc: subprocess.Popen, folder: Path, timeout: float = 300) -> None:
    """Waits for the job; kills its process group if it outlives `timeout`; it must exit 0."""
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, tail(folder)


def kill_all(proc: subprocess.Popen) -> None:
    """The whole job lost at once (torchrun and every worker)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def newest(folder: Path) -> str:
    newest = folder / "ck" / "newest"
    return newest.read_text().strip() if newest.exists() else ""


def _waiting(folder: Path, proc: subprocess.Popen, deadline: float) -> None:
    assert proc.poll() is None and time.monotonic() < deadline, tail(folder)
    time.sleep(0.002)


def saving(folder: Path) -> list[str]:
    """The checkpoint folders being written now (a kill tears them)."""
    try:
        return sorted(p.name for p in (folder / "ck").iterdir() if p.name.endswith(".incomplete"))
    except FileNotFoundError:
        return []


def during_a_save(folder: Path, proc: subprocess.Popen, timeout: float = 240, after: int = 0) -> str:
    """Waits until a save of a step > `after` is being written (its .incomplete folder exists: a
    kill now tears it) once a first checkpoint is complete (any, when `after` > 0); returns the
    newest complete checkpoint then."""
    deadline = time.monotonic() + timeout
    while True:
        done = newest(folder)
        torn = [name for name in saving(folder) if step_of(name) > after]
        if (done or after) and torn:
            return done
        _waiting(folder, proc, deadline)


def at_step(folder: Path, proc: subprocess.Popen, step: int, timeout: float = 240) -> None:
    """Waits until rank 0 has logged step `step` (the job runs with --log-every 1)."""
    deadline = time.monotonic() + timeout
    while max(losses(folder), default=0) < step:
        _waiting(folder, proc, deadline)


def step_of(name: str) -> int:
    """The step in a checkpoint folder's name (step_15_partial[.incomplete] -> 15; 0 if none)."""
    parts = name.split("_")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "step" and parts[1].isdigit() else 0


def workers(proc: subprocess.Popen) -> list[int]:
    """The worker processes torchrun started (its descendants running the script)."""
    found, frontier = [], [proc.pid]
    while frontier:
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(frontier.pop())], capture_output=True, text=True
        )
        children = [int(pid) for pid in out.stdout.split()]
        frontier += children
        for pid in children:
            try:
                if SCRIPT.name in Path(f"/proc/{pid}/cmdline").read_text():
                    found.append(pid)
            except FileNotFoundError:
                pass  # (gone since ps listed it)
    return sorted(found)


def writers(proc: subprocess.Popen) -> list[int]:
    """The background-save writer processes (smp/state/writer_process.py) of the job's workers."""
    found = []
    for worker in workers(proc):
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(worker)], capture_output=True, text=True)
        for pid in (int(p) for p in out.stdout.split()):
            try:
                if b"writer_process" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except FileNotFoundError:
                pass
    return sorted(found)


def still_running(pids: list[int], within: float = 10.0) -> list[int]:
    """Those of `pids` still running (not ended, nor a zombie) after up to `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        running = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                continue
            if state != "Z":
                running.append(pid)
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)  # polling for the kernel to end them


def ranks(proc: subprocess.Popen) -> dict[int, int]:
    """The workers by their global rank (RANK in each one's environment): {rank: pid}."""
    found = {}
    for pid in workers(proc):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        for entry in environ:
            if entry.startswith(b"RANK="):
                found[int(entry[5:])] = pid
    return found


def final_state(folder: Path, steps: int) -> dict:
    """The parameters and optimizer state of the checkpoint at `steps`, as one plain dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder / "ck" / f"step_{steps}_partial"), str(folder / "final.pt"))
    return torch.load(folder / "final.pt")


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(
        (a[k].double() - b[k].double()).abs().max().item() for k in a if isinstance(a[k], torch.Tensor)
    )


def losses(folder: Path) -> dict[int, float]:
    """Rank 0's logged loss by step; a step logged again (redone after a resume) by its last row."""
    try:
        with open(folder / "out" / "log.csv", newline="") as f:
            rows = [r for r in csv.reader(f) if r and r[0].isdigit() and len(r) >= 2 and r[1]]
    except FileNotFoundError:
        return {}
    return {int(r[0]): float(r[1]) for r in rows}
