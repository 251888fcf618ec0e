"""Training that survives a lost rank (issue 49): a resume with no checkpoint yet is a fresh start,
a save a kill left torn is never read (and is named), each rank's generators and registered
objects (data positions) come back, a data loader's place moves between replica counts, and the
main job under `torchrun --max-restarts` comes back from a killed rank with the uninterrupted run's
weights, and resumes on fewer processes with the same global batch."""

from __future__ import annotations

import os
import signal
import warnings

import main_job_runs as runs
import torch
from harness import run_ranks
from tiny_training import tiny

# --- in-process: fresh starts, torn saves, generators, registered objects, data positions ------


class Counter:
    """A user's stateful object (what a data loader of one's own would be)."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def _fresh_torn_and_rank_state(rank, world_size, folder):
    import smp

    out = {}
    model, optimizer, _ = tiny(smp, {})
    out["fresh"] = (
        smp.resume_from_checkpoint(os.path.join(folder, "nothing_here")),
        smp.resume_from_checkpoint(folder),
    )
    counter = Counter()
    smp.register_stateful("counter", counter)
    loader = smp.data_loader(list(range(40)), batch_size=2, shuffle=True, seed=3)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    counter.n = 7
    smp.save_checkpoint(folder, tag="s1", model=model, optimizer=optimizer, user_content={"s": 1})
    after = {"rand": torch.rand(3).tolist(), "batches": [next(batches).tolist() for _ in range(2)]}
    counter.n = 99
    smp.barrier()
    if rank == 0:  # a save killed mid-write: its folder is left, `newest` still names s1
        os.makedirs(os.path.join(folder, "s2_partial.incomplete"))
    smp.barrier()
    smp.parallel_state.reset()
    model, optimizer, _ = tiny(smp, {})
    late = Counter()
    loader = smp.data_loader(list(range(40)), batch_size=2, shuffle=True, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        content = smp.resume_from_checkpoint(folder)
    smp.register_stateful("counter", late)  # registered after the resume: gets its state then
    out["content"] = content
    out["torn_named"] = any("s2_partial.incomplete" in str(w.message) for w in caught)
    batches = iter(loader)
    out["again"] = {"rand": torch.rand(3).tolist(), "batches": [next(batches).tolist() for _ in range(2)]}
    out["after"] = after
    out["counter"] = late.n
    try:
        smp.register_stateful("bad", object())
        out["bad"] = None
    except TypeError as e:
        out["bad"] = str(e)
    return out


def test_fresh_start_torn_save_and_each_ranks_state_resume(tmp_path):
    for r in run_ranks(_fresh_torn_and_rank_state, 2, str(tmp_path), timeout=180):
        assert r["fresh"] == (None, None)
        assert r["content"] == {"s": 1} and r["torn_named"]
        assert r["again"] == r["after"]  # the same random draws and the same next batches
        assert r["counter"] == 7
        assert "has no state_dict() and load_state_dict()" in r["bad"]


def _loader_on_replicas(rank, world_size, folder, config, batch_size, save):
    """Reads 3 batches, saves (if `save`), returns the next one; or resumes and returns the next."""
    import smp

    model, optimizer, _ = tiny(smp, config)
    loader = smp.data_loader(list(range(64)), batch_size=batch_size, shuffle=True, seed=5)
    if save:
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        smp.save_checkpoint(folder, tag="data", model=model, optimizer=optimizer)
        return next(batches).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the generators start afresh on another layout)
        smp.resume_from_checkpoint(folder)
    return next(iter(loader)).tolist()


def test_data_loader_resumes_on_fewer_replicas_with_the_same_global_batch(tmp_path):
    """Saved at 2 data-parallel replicas of 2 samples, resumed at 1 (pp=2) of 4: the next global
    batch is the same samples."""
    folder = str(tmp_path)
    two = run_ranks(_loader_on_replicas, 2, folder, {}, 2, True, timeout=180)
    one = run_ranks(_loader_on_replicas, 2, folder, {"pipeline_parallel_degree": 2}, 4, False, timeout=180)
    assert sorted(two[0] + two[1]) == sorted(one[0]) and one[0] == one[1]


# --- the main job under torchrun: a killed rank, and fewer processes ----------------------------

STEPS, SAVE_EVERY = 16, 4
JOB = [
    *("--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--layers", "2", "--dim", "32"),
    *(
        "--seq-len",
        "32",
        "--log-every",
        "4",
        "--microbatches",
        "2",
        "--batch-size",
        "4",
        "--tp",
        "1",
        "--pp",
        "1",
    ),
]


def test_main_job_survives_a_killed_rank_and_resumes_on_fewer_processes(tmp_path):
    """Two data-parallel replicas: uninterrupted; with one rank SIGKILLed while a background save's
    writer processes write a checkpoint, under --max-restarts=1 (torchrun restarts the workers, the
    job resumes by itself from the newest complete checkpoint, the torn one ignored: the same
    weights bit for bit; no writer outlives its rank); and the
    whole job killed the same way and resumed on 1 process (the same global batch, two microbatches
    of the 2-process run's size: within 1e-6). (Pipeline and tensor degrees changing at a resume:
    benchmarks/fault_tolerance.py.)"""
    plain, killed, fewer = (tmp_path / name for name in ("plain", "killed", "fewer"))
    for folder in (plain, killed, fewer):
        folder.mkdir()
    runs.finish(runs.torchrun(2, plain, JOB), plain)
    # killed while the writer processes write a background save
    proc = runs.torchrun(2, killed, [*JOB, "--async-save", "process"], restarts=1)
    runs.during_a_save(killed, proc)
    writing = runs.writers(proc)  # the ranks' writer processes, writing now
    os.kill(runs.workers(proc)[-1], signal.SIGKILL)
    runs.finish(proc, killed)
    stray = runs.still_running(writing)
    proc = runs.torchrun(2, fewer, JOB)
    runs.during_a_save(fewer, proc)
    runs.kill_all(proc)  # the whole job lost; it comes back on one process
    runs.finish(runs.torchrun(1, fewer, JOB), fewer)
    reference = runs.final_state(plain, STEPS)
    assert runs.max_difference(reference, runs.final_state(killed, STEPS)) == 0.0
    assert runs.max_difference(reference, runs.final_state(fewer, STEPS)) < 1e-6
    starts = (killed / "log.txt").read_text().count(" parameters, pp=")  # rank 0's line at each start
    assert starts == 2, starts  # torchrun restarted the workers once
    assert len(writing) == 2 and not stray, f"writer processes {stray} outlived their ranks ({writing})"
