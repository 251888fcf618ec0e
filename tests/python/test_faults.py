"""A dead or failing rank fails the job quickly: every survivor raises and exits non-zero within the
group timeout plus a margin, in pp=2 x rdp=2 and tp=2 x rdp=2, wherever it was waiting.

Processes are started without torchrun (no agent kills the survivors for us): one long-lived
parent (fault_trials.py) imports torch once and forks the real smp processes of each trial.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile

import pytest
from fault_trials import PHASES, STEPS

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 4.0  # the group timeout the trials configure (seconds)
MARGIN = 4.0  # exit after the failure is noticed: traceback, report, os._exit
TRIAL_DEADLINE = 60.0  # a child still alive then is a hang: killed, and the test fails
STARTUP = 60.0  # the parent's import of torch and smp on a loaded 2-core machine


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_trials(trials: list[dict], world: int) -> list[list[dict]]:
    """Runs the trials on `world` parents; per trial, each rank's {code, end, log text}."""
    for t in trials:
        t.update(port=_port(), timeout=TIMEOUT, deadline=TRIAL_DEADLINE)
    with tempfile.TemporaryDirectory(prefix="smp-faults-") as tmp:
        results = os.path.join(tmp, "results")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.join(HERE, "..", "..", "python")])}
        parent = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "fault_trials.py"), str(world), json.dumps(trials), results],
            env=env,
        )
        try:
            parent.wait(timeout=STARTUP + len(trials) * TRIAL_DEADLINE)
        finally:  # reap: a parent still running past the deadline is killed
            if parent.poll() is None:
                parent.kill()
                parent.wait()
        assert parent.returncode == 0, parent.returncode
        by_trial: list[list[dict]] = [[{}] * world for _ in trials]
        with open(results) as f:
            for line in f:
                row = json.loads(line)
                with open(row["log"], errors="replace") as log:
                    row["text"] = log.read()
                by_trial[row["trial"]][row["rank"]] = row
    for t, ranks in zip(trials, by_trial, strict=True):
        t0 = min(r["start"] for r in ranks)
        print(t["layout"], t["phase"], t["step"], [(r["code"], round(r["end"] - t0, 2)) for r in ranks])
    return by_trial


def _check_survivors(trial: dict, ranks: list[dict]) -> float:
    """Every survivor exited non-zero within the bound after the victim's end; returns the slowest."""
    victim = ranks[trial["victim"]]
    expected = {"kill": -9, "stop": "stopped", "raise": 1}[trial["action"]]
    assert victim["code"] == expected, (trial, victim["code"], victim["text"][-3000:])
    slowest = 0.0
    for rank, row in enumerate(ranks):
        if rank == trial["victim"]:
            continue
        late = row["end"] - victim["end"]
        assert row["code"] not in (None, 0), (trial, rank, row["code"], row["text"][-3000:])
        assert late <= TIMEOUT + MARGIN, (trial, rank, late, row["text"][-3000:])
        assert "smp.faults.CommunicationError: smp: rank" in row["text"], (trial, rank, row["text"][-3000:])
        slowest = max(slowest, late)
    return slowest


def _kill_trials(n: int, seed: int) -> list[dict]:
    """n trials over both layouts, every victim and phase in turn, random steps; one in ten
    victims hangs (SIGSTOP) instead of dying, which only the group timeout can bound."""
    rng = random.Random(seed)
    trials = []
    for i in range(n):
        trials.append(
            {
                "layout": ("pp2_rdp2", "tp2_rdp2")[i % 2],
                "victim": i % 4,
                "phase": PHASES[(i * 5 + seed) % len(PHASES)],
                "step": rng.randrange(STEPS),
                "action": "stop" if i % 10 == 3 else "kill",
            }
        )
    return trials


def _run_kill_trials(n: int, seed: int) -> None:
    trials = _kill_trials(n, seed)
    slowest = []
    for trial, ranks in zip(trials, run_trials(trials, 4), strict=True):
        slowest.append(_check_survivors(trial, ranks))
        if trial["action"] == "stop":
            texts = [r["text"][-1500:] for r in ranks]
            assert any("did not answer within the group timeout" in t for t in texts), (trial, texts)
    print(
        f"{n} kill trials: slowest survivor exit {max(slowest):.2f} s after the victim "
        f"(bound {TIMEOUT + MARGIN} s)"
    )


def test_kill_a_rank():
    _run_kill_trials(4, seed=1)


@pytest.mark.slow  # 20 trials (87 s); test_kill_a_rank's 4 run by default
def test_kill_a_rank_many():
    _run_kill_trials(20, seed=2)


def test_exception_on_one_stage():
    """A user's bug on stage 1 only: it fails with its own traceback, stage 0 with "rank 1 failed"."""
    trials = [
        {"layout": "pp2", "victim": 1, "phase": phase, "step": 1, "action": "raise"}
        for phase in ("forward", "backward")
    ]
    for trial, (stage0, stage1) in zip(trials, run_trials(trials, 2), strict=True):
        _check_survivors(trial, [stage0, stage1])
        assert (
            "in train_step" in stage1["text"]
            and "UserBug: a bug in the user's step function" in stage1["text"]
        )
        assert "rank 1 failed: UserBug: a bug in the user's step function" in stage0["text"], stage0["text"][
            -3000:
        ]
