"""The fault trials' processes (test_faults.py): one parent imports torch and smp once, then forks
the ranks of each trial, so a trial costs forks, not imports (4 concurrent imports of torch take
about 30 s on 2 cores).

    python fault_trials.py WORLD TRIALS_JSON RESULTS_FILE

Each child is a real smp process started without torchrun (env:// over the trial's port):
smp.init with a short group timeout, the GPT test model, a few training steps. A trial names a
victim rank, a step and a phase; the victim SIGKILLs itself there ("kill"), or raises from its
step function ("raise"). A child's own exit is natural: an uncaught exception ends it as it
would end a user's script, so a microbatch thread or a teardown that blocks exit would show as a
survivor that does not exit. The parent records each child's exit status and wall-clock exit time
as one JSON line per rank and trial.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

LAYOUTS = {
    "pp2_rdp2": {"pipeline_parallel_degree": 2, "microbatches": 2, "shard_optimizer_state": True},
    "tp2_rdp2": {"tensor_parallel_degree": 2, "microbatches": 2, "shard_optimizer_state": True},
    "pp2": {"pipeline_parallel_degree": 2, "microbatches": 2},
}
PHASES = ("idle", "forward", "backward", "grad_sync", "optimizer", "barrier")
STEPS = 4


class UserBug(Exception):
    pass


def _die(trial: dict) -> None:
    if trial.get("action") == "raise":
        raise UserBug(f"a bug in the user's step function at step {trial['step']}")
    sys.stdout.flush()
    sys.stderr.flush()
    # "stop": a hung peer (its sockets stay open), which only the group timeout can bound.
    os.kill(os.getpid(), signal.SIGSTOP if trial.get("action") == "stop" else signal.SIGKILL)


def run_trial(rank: int, world: int, trial: dict) -> None:
    """The child: trains until the victim dies, then (a survivor) fails; never returns normally
    unless no failure reached it."""
    import datetime

    import models
    import smp
    import torch

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(trial["port"]),
    )
    print(f"child {time.time() - trial['t0']:.2f}", flush=True)
    smp.init(LAYOUTS[trial["layout"]], timeout=datetime.timedelta(seconds=trial["timeout"]))
    print(f"init {time.time() - trial['t0']:.2f}", flush=True)
    victim = rank == trial["victim"]
    torch.manual_seed(0)
    with smp.tensor_parallelism(smp.tp_size() > 1):
        net = models.GPT(layers=2)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    step = 0

    def at(phase: str) -> bool:
        return victim and step == trial["step"] and trial["phase"] == phase

    def at_phase(phase: str):
        def hook(*args):
            if at(phase):
                _die(trial)

        return hook

    # Dying as a gradient arrives: its replicas are in (or about to start) the bucket all-reduces.
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(at_phase("grad_sync"))
    # Dying before the step: the other replicas wait in the optimizer's publish.
    optimizer.optimizer.register_step_pre_hook(at_phase("optimizer"))

    @smp.step
    def train_step(ids):
        if at("forward"):  # the other stages wait for this stage's activations or outputs
            _die(trial)
        loss = models.lm_loss(model(ids), ids)
        if at("backward"):  # the other stages wait for gradients, its replicas in all-reduces
            _die(trial)
        model.backward(loss)
        return loss

    gen = torch.Generator().manual_seed(smp.rdp_rank())
    print(f"ready {time.time() - trial['t0']:.2f}", flush=True)
    for step in range(STEPS):  # noqa: B007  (read by at())
        print(f"step {step} {time.time() - trial['t0']:.2f}", flush=True)
        if at("idle"):
            _die(trial)
        ids = torch.randint(0, 64, (4, 16), generator=gen)
        optimizer.zero_grad()
        train_step(ids)
        optimizer.step()
        if at("barrier"):
            _die(trial)
        smp.barrier()


def _wait_all(pids: list[int], deadline: float) -> list[tuple[int | str | None, float]]:
    """Per child: (exit status; "stopped" for one that stopped itself, killed once the others are
    done; None if it was still running at the deadline and killed) and time.time() at its exit
    (or stop)."""
    out: dict[int, tuple[int | str | None, float]] = {}
    while len(out) < len(pids):
        for pid in pids:
            if pid in out:
                continue
            done, status = os.waitpid(pid, os.WNOHANG | os.WUNTRACED)
            if done and os.WIFSTOPPED(status):
                out[pid] = ("stopped", time.time())
            elif done:
                out[pid] = (os.waitstatus_to_exitcode(status), time.time())
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                out[pid] = (None, time.time())
        time.sleep(0.01)  # polling children with a deadline
    for pid, (code, _) in out.items():
        if code == "stopped":
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return [out[pid] for pid in pids]


def _warm_up(torch) -> None:
    """Does once, before forking, what each child would otherwise pay for: the first optimizer
    step and the first torch.export import what they need (seconds on 2 cores). Starts no thread."""
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    torch.optim.Adam([p]).step()
    torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), strict=False)


def main() -> None:
    world = int(sys.argv[1])
    trials = json.loads(sys.argv[2])
    results_file = sys.argv[3]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import models  # noqa: F401  (imported once, before forking)
    import smp  # noqa: F401
    import torch

    torch.set_num_threads(1)
    _warm_up(torch)
    assert threading.active_count() == 1, threading.enumerate()  # forking copies no thread
    for i, trial in enumerate(trials):
        trial["t0"] = start = time.time()
        logs = [f"{results_file}.{i}.rank{rank}.log" for rank in range(world)]
        pids = []
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                fd = os.open(logs[rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                run_trial(rank, world, trial)
                sys.exit(0)  # no failure reached this rank: a natural, clean exit
            pids.append(pid)
        ended = _wait_all(pids, time.monotonic() + trial["deadline"])
        with open(results_file, "a") as f:
            for rank, (code, end) in enumerate(ended):
                row = {"trial": i, "rank": rank, "code": code, "start": start, "end": end, "log": logs[rank]}
                f.write(json.dumps(row) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip tearing down what the warm-up built (seconds)


if __name__ == "__main__":
    main()
