"""The pipeline timeline: a pp=2, m=4 run's trace against the schedule, its picture, the config
key's errors, and the text rendering of a schedule."""

from __future__ import annotations

import json
import os

import pytest
from harness import run_ranks
from smp import config
from smp import schedules as schedule

M = 4
SCHEDULES = ("interleaved", "simple")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _train(rank, world_size, out):
    """Two steps under each schedule: "interleaved" writes by itself after its `steps`,
    "simple" records until the script calls smp.write_timeline()."""
    import smp
    import torch
    from models import GPT, lm_loss

    written = {}
    for name in SCHEDULES:
        timeline = {"path": os.path.join(out, name)} | ({"steps": 2} if name == "interleaved" else {})
        smp.init({"pipeline_parallel_degree": 2, "microbatches": M, "pipeline": name, "timeline": timeline})
        torch.manual_seed(0)
        model = smp.DistributedModel(GPT(layers=2, dim=16, heads=2))
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        @smp.step
        def train_step(ids, model=model):
            loss = lm_loss(model(ids), ids)
            model.backward(loss)
            return loss

        for step in range(2):
            optimizer.zero_grad()
            train_step(torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(step)))
            optimizer.step()
        if name == "simple":
            written[name] = smp.write_timeline()
        smp.parallel_state.reset()
    return written


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("timeline"))
    written = run_ranks(_train, 2, out, timeout=180)
    assert written[0]["simple"] == os.path.join(out, "simple", "timeline.json")
    assert written[1]["simple"] is None  # only rank 0 writes
    loaded = {}
    for name in SCHEDULES:
        with open(os.path.join(out, name, "timeline.json")) as f:
            loaded[name] = json.load(f)["traceEvents"]
    return out, loaded


def _by_rank(events, phase="X"):
    ranks: dict[int, list[dict]] = {}
    for e in events:
        if e["ph"] == phase:
            ranks.setdefault(e["pid"], []).append(e)
    return ranks


@pytest.mark.parametrize("name", SCHEDULES)
def test_actions_follow_the_schedule(traces, name):
    _, loaded = traces
    compute = {
        pid: sorted((e for e in events if e["cat"] in ("F", "B")), key=lambda e: e["ts"])
        for pid, events in _by_rank(loaded[name]).items()
    }
    assert sorted(compute) == [0, 1]
    for stage, events in compute.items():
        expected = [f"{a.kind}{a.microbatch}" for a in schedule.rank_actions(name, stage, 2, M, M)]
        for step in (1, 2):
            got = [e["name"] for e in events if e["args"]["step"] == step]
            assert got == expected, (name, stage, step)
        assert all(e["args"]["stage"] == stage for e in events)
        # One compute track: an action ends before the next begins.
        for a, b in zip(events, events[1:], strict=False):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)
    names = {e["pid"]: e["args"]["name"] for e in loaded[name] if e["name"] == "process_name"}
    assert names == {0: "rank 0 (stage 0, tp 0, rdp 0)", 1: "rank 1 (stage 1, tp 0, rdp 0)"}


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_send_has_its_receive(traces, name):
    _, loaded = traces
    begins = [e for e in loaded[name] if e["ph"] == "b"]
    sends = [e for e in begins if e["cat"] == "send"]
    recvs = [e for e in begins if e["cat"] == "recv"]

    def key(e, src, dst):
        a = e["args"]
        return (a["step"], a["microbatch"], a["what"], a["value"], src, dst, a["bytes"])

    sent = sorted(key(e, e["pid"], e["args"]["peer_rank"]) for e in sends)
    received = sorted(key(e, e["args"]["peer_rank"], e["pid"]) for e in recvs)
    assert sent == received
    # Stage 0 sends activations forward, stage 1 gradients (and the loss's output) back.
    assert {e["args"]["what"] for e in sends if e["pid"] == 0} == {"activation"}
    assert "gradient" in {e["args"]["what"] for e in sends if e["pid"] == 1}
    assert len(sent) >= 2 * 2 * M  # per step and microbatch: an activation and its gradient
    ends = {e["id"]: e["ts"] for e in loaded[name] if e["ph"] == "e"}
    assert all(ends[e["id"]] >= e["ts"] for e in begins)
    flows = [e for e in loaded[name] if e["ph"] in ("s", "f")]
    assert len(flows) == 2 * len(sent)  # an arrow per message


def test_picture(traces):
    out, _ = traces
    for name in SCHEDULES:
        with open(os.path.join(out, name, "timeline.png"), "rb") as f:
            data = f.read()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000


@pytest.mark.parametrize(
    "value, message",
    [
        (3, "'timeline' must be true, false or a dict"),
        ("dir", "'timeline' must be true, false or a dict"),
        ({"paht": "x"}, "'timeline' has unknown key(s) 'paht'; valid keys: every, path, start, steps"),
        ({"path": ""}, "'timeline' path must be a non-empty string"),
        ({"every": 0}, "'timeline' every must be a positive integer"),
        ({"steps": True}, "'timeline' steps must be a positive integer"),
        ({"start": 1.5}, "'timeline' start must be a positive integer"),
    ],
)
def test_config_errors(value, message):
    with pytest.raises(ValueError) as raised:
        config.parse({"timeline": value})
    assert message in str(raised.value)


def test_config_values(monkeypatch):
    monkeypatch.delenv(config.TIMELINE_VAR, raising=False)
    assert config.parse({}).timeline is None
    assert config.parse({"timeline": False}).timeline is None
    assert config.parse({"timeline": True}).timeline == config.TimelineOptions()
    got = config.parse({"timeline": {"path": "t", "every": 5}}).timeline
    assert got == config.TimelineOptions(path="t", start=1, steps=None, every=5)
    monkeypatch.setenv(config.TIMELINE_VAR, "from_env")
    assert config.parse({}).timeline == config.TimelineOptions(path="from_env")
    assert config.parse({"timeline": False}).timeline is None  # the config's key wins


def test_text_rendering():
    expected = "\n".join(
        [
            "stage 0: F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3",
            "stage 1: .  F0 F1 .  B0 F2 B1 F3 B2 .  B3",
            "stage 2: .  .  F0 B0 F1 B1 F2 B2 F3 B3",
            "12 slots; idle 12 of 36 rank-slots (33%)",
        ]
    )
    assert schedule.render_text("interleaved", 3, 4, 4) == expected
    simple = schedule.render_text("simple", 2, 2, 2)
    assert (
        simple
        == "stage 0: F0 F1 .  .  B0 B1\nstage 1: .  F0 F1 B0 B1\n6 slots; idle 4 of 12 rank-slots (33%)"
    )


def test_recorder_windows():
    """Which steps are recorded and when the files are due: `start`, `steps` and `every`."""
    from smp.services import timeline

    def due_steps(**options):
        rec = timeline.Recorder(config.TimelineOptions(**options), {"rank": 0}, 0)
        recorded, due = [], []
        for step in range(1, 11):
            if rec.begin_step():
                recorded.append(step)
                rec.record("F", 0, 1, microbatch=0)
                if rec.end_step():
                    due.append(step)
        return recorded, due

    assert due_steps() == (list(range(1, 11)), [])  # until smp.write_timeline()
    assert due_steps(start=3, steps=2) == ([3, 4], [4])
    assert due_steps(start=2, steps=5, every=2) == ([2, 3, 4, 5, 6], [3, 5, 6])
    assert due_steps(every=4) == (list(range(1, 11)), [4, 8])


def test_a_later_action_kind_is_drawn_like_the_others():
    """A "W" action (zero-bubble's weight gradient) needs no change: a compute event like F and B."""
    from smp.services import timeline_files

    identity = {"rank": 0, "stages": (0,), "tp": 0, "rdp": 0}
    events = [
        (kind, 1000 * i, 1000 * i + 900, 1, {"microbatch": 0, "stage": 0}) for i, kind in enumerate("FBW")
    ]
    compute = [e for e in timeline_files.trace_events([(identity, events)]) if e["ph"] == "X"]
    assert [(e["name"], e["cat"], e["tid"]) for e in compute] == [
        ("F0", "F", 0),
        ("B0", "B", 0),
        ("W0", "W", 0),
    ]


def test_a_rank_of_two_stages_is_named_by_both():
    from smp.services import timeline_files

    assert timeline_files.rank_name({"rank": 1, "stages": (1, 2), "tp": 0, "rdp": 1}) == (
        "rank 1 (stages 1, 2, tp 0, rdp 1)"
    )
    assert (
        timeline_files.rank_name({"rank": 0, "stages": (0,), "tp": 1, "rdp": 0})
        == "rank 0 (stage 0, tp 1, rdp 0)"
    )
