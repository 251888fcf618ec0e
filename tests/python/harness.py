"""Runs a test function on N real processes over a real process group.

No mocks: every rank is a process of its own, the group is created over a
FileStore, and collectives go through the smp backend (Gloo inside on CPU).
A hang is a failure: the whole run has a deadline, a rank that fails makes the
others be stopped shortly after, and every process is reaped before returning.

Ranks are started by a fork server that has imported torch, smp and transformers
once: a spawned rank spent ~4 s importing them, and a 4-rank test on 2 cores paid
that twice over before doing anything. Each rank is still a fresh process forked
from that server (never from pytest), so no test's state leaks into another.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

# What the fork server imports once for every rank (missing ones are skipped).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "smp",
    "models",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.bert.modeling_bert",
    "hf_cases",
    "pipeline_cases",
    "rank_warm_up",
]

# After the first failing rank, how long the others get to report before they
# are killed (they are usually stuck in a collective with the dead rank).
_GRACE_SECONDS = 10.0

# The checkout these tests belong to: every rank must import its smp (an editable install points
# at whichever checkout it was installed from, and Python 3.11's fork server ignores sys.path).
_HERE = os.path.dirname(os.path.abspath(__file__))
_TREE = os.path.dirname(os.path.dirname(_HERE))
_PATHS = [_HERE, os.path.join(_TREE, "python")]


class RankFailure(AssertionError):
    pass


def _worker(fn, rank, world_size, init_file, port, env, init, group_timeout, hang_dump, args, results, out):
    # The fork server's stdout/stderr are not the test's: this rank's go to files that the test's
    # process copies to its own (so pytest's capture sees them), even if the rank is killed.
    for fd, path in zip((1, 2), out, strict=True):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    # A rank still running near the deadline prints where it is stuck.
    faulthandler.dump_traceback_later(hang_dump, exit=False)
    os.environ.update(env or {})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    # The fork server loaded OpenMP before this rank's variables were set.
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        # Ranks share a GPU, which NCCL refuses to ranks of one host: each rank reports a host of
        # its own, and NCCL's network transport over loopback is used (tests/gpu.sh runs so).
        os.environ["NCCL_HOSTID"] = f"smp-test-rank-{rank}"
        os.environ.setdefault("NCCL_P2P_DISABLE", "1")
        os.environ.setdefault("NCCL_SHM_DISABLE", "1")
    # As torchrun sets them, so code under test may use env:// (smp.init does).
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        import smp  # (registers the backend)
        import torch.distributed as dist

        _check_tree(smp)

        if init:
            dist.init_process_group(
                "smp",
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=group_timeout),
            )
        try:
            value = fn(rank, world_size, *args)
        finally:
            if init and dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # report everything, including assertion errors
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    env: dict[str, str] | None = None,
    init: bool = True,
    timeout: float = 120.0,
    group_timeout: float = 60.0,
) -> list[Any]:
    """Runs fn(rank, world_size, *args) on world_size processes; returns their results.

    fn must be a module-level function (it is pickled by name). With init=True
    the default group is an smp group; with init=False fn creates its own, and
    finds torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...) set.
    Results travel through a multiprocessing queue: return plain Python values
    (tensor.tolist()), not tensors, whose shared memory dies with the rank.
    Raises RankFailure with every failing rank's traceback.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="smp-test-") as tmp:
        init_file = os.path.join(tmp, "store")
        port = _free_port()
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    rank,
                    world_size,
                    init_file,
                    port,
                    env,
                    init,
                    group_timeout,
                    max(timeout - 5, 1),
                    args,
                    results,
                    _output_files(tmp, rank),
                ),
                # not daemonic, as under torchrun: a rank may start processes of its own (the
                # background checkpoint writer); _reap ends every rank whatever happens
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[bool, Any]] = {}
        try:
            outcomes = _collect(procs, results, world_size, timeout)
        finally:
            _reap(procs, reported=set(outcomes))
            _copy_output(tmp, world_size)
    failures = {r: o for r, (ok, o) in outcomes.items() if not ok}
    missing = sorted(set(range(world_size)) - set(outcomes))
    if failures or missing:
        lines = [f"rank {r} failed:\n{tb}" for r, tb in sorted(failures.items())]
        if missing:
            lines.append(f"ranks {missing} did not report (hung or crashed; killed)")
        raise RankFailure("\n".join(lines))
    return [outcomes[r][1] for r in range(world_size)]


def _output_files(tmp: str, rank: int) -> tuple[str, str]:
    return os.path.join(tmp, f"rank{rank}.stdout"), os.path.join(tmp, f"rank{rank}.stderr")


def _copy_output(tmp: str, world_size: int) -> None:
    """Each rank's stdout and stderr, rank by rank, onto this process's."""
    for rank in range(world_size):
        for path, stream in zip(_output_files(tmp, rank), (sys.stdout, sys.stderr), strict=True):
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    stream.write(f.read())
        sys.stdout.flush()
        sys.stderr.flush()


def _check_tree(smp) -> None:
    for name, module in (("smp", smp), ("smp.passes", sys.modules.get("smp.passes"))):
        where = os.path.abspath(getattr(module, "__file__", "") or "")
        if not where.startswith(_TREE + os.sep):
            raise RuntimeError(
                f"harness: this rank imported {name} from {where}, not from the checkout under test "
                f"({_TREE}); the tests would run another tree's code"
            )


def _context():
    # The fork server is started with this environment (it does not take sys.path over).
    python_path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ["PYTHONPATH"] = os.pathsep.join(_PATHS + [p for p in python_path if p and p not in _PATHS])
    import torch

    if torch.cuda.is_available():
        # On a GPU machine the fork server's children start with CUDA marked unusable ("Cannot
        # re-initialize CUDA in forked subprocess", seen on an H200 under Python 3.12): each rank
        # is spawned, paying its imports (seconds; the GPU machines have the cores for it).
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: the first run_ranks
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(procs, results, world_size, timeout):
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size:
        if any(not ok for ok, _ in outcomes.values()):
            deadline = min(deadline, time.monotonic() + _GRACE_SECONDS)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, value = results.get(timeout=min(remaining, 0.5))
            outcomes[rank] = (ok, value)
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in outcomes and p.exitcode not in (None, 0):
                    outcomes[rank] = (False, f"process exited with code {p.exitcode}")
    return outcomes


def _reap(procs, reported):
    # Ranks that never reported are hung or dead: kill them at once. The others
    # are finishing their teardown and get a moment to exit cleanly.
    for rank, p in enumerate(procs):
        if rank not in reported and p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
