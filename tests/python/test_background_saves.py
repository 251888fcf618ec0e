"""Background saves (issue 49, item 4): a second save started while one is being written waits for
it and never interleaves with it. Each checkpoint holds its own state (what the model held when
its save was called), only its own files, and the first is complete and named newest before the
second writes anything. The second copies the state into the first's host buffers."""

from __future__ import annotations

import os
import time

import torch
from harness import run_ranks
from tiny_training import tiny

FILES = {
    ".metadata",
    "__0_0.distcp",
    "__1_0.distcp",
    "smp_meta.pt",
    "user_content.pt",
    "rank_0.pt",
    "rank_1.pt",
}


def _read(filename):
    return open(filename).read() if os.path.exists(filename) else None


def _two_saves_back_to_back(rank, world_size, folder):
    import smp
    from smp.state import folders, storage

    model, optimizer, train = tiny(smp, {}, width=32, optimizer=torch.optim.Adam)

    def step(i):
        train(torch.full((4, 32), float(i + 1)))

    events = []
    write, publish = storage.save, folders.publish

    def recorded_write(tensors, target, *args):
        tag = os.path.basename(target).split("_")[0]
        seen = {
            "newest": _read(os.path.join(folder, "newest")),
            "listing": sorted(os.listdir(folder)),
            "first files": sorted(os.listdir(os.path.join(folder, "first_partial")))
            if os.path.isdir(os.path.join(folder, "first_partial"))
            else None,
        }
        events.append(("write", tag, seen))
        if tag == "first":
            time.sleep(1.0)  # a slow disk: a second save that did not wait would start meanwhile
        seconds = write(tensors, target, *args)
        events.append(("written", tag, None))
        return seconds

    def recorded_publish(incomplete, final):
        events.append(("publish", os.path.basename(final).split("_")[0], None))
        publish(incomplete, final)

    storage.save, folders.publish = recorded_write, recorded_publish
    step(0)
    held, buffers = {}, []
    for i, tag in enumerate(("first", "second")):
        held[tag] = {k: v.tolist() for k, v in model.local_state_dict().items()}
        smp.save_checkpoint(
            folder, tag, model=model, optimizer=optimizer, user_content={"tag": tag}, async_save=True
        )
        buffers.append(sorted(b.data_ptr() for b in smp.checkpoint._staging._buffers.values()))
        step(i + 1)  # the live state changes while the checkpoint is written
    smp.wait_for_checkpoint()
    smp.checkpoint.release_staging()
    reused = buffers[0] == buffers[1]
    return events, held, (reused, len(buffers[0])), len(smp.checkpoint._staging._buffers)


def test_a_second_background_save_waits_for_the_first(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = str(tmp_path)
    results = run_ranks(_two_saves_back_to_back, 2, folder, timeout=180)
    for rank, (events, *_) in enumerate(results):
        order = [(kind, tag) for kind, tag, _ in events]
        published = [("publish", "first")] if rank == 0 else []
        assert order == [
            ("write", "first"),
            ("written", "first"),
            *published,
            ("write", "second"),
            ("written", "second"),
            *([("publish", "second")] if rank == 0 else []),
        ], order
        seen = events[order.index(("write", "second"))][2]
        assert seen["newest"] == "first", seen  # complete and named before the second writes
        assert set(seen["first files"]) == FILES, seen
        assert "first_partial.incomplete" not in seen["listing"], seen
    held = results[0][1]
    assert held == results[1][1] and held["first"] != held["second"]
    # the second copied into the first's buffers (no fresh pages), which release_staging gives back
    # (rank 0 writes every tensor here: the model and the optimizer state are replicated)
    assert all(reused and kept == 0 for _, _, (reused, _), kept in results), results
    assert results[0][2][1] > 0, results
    for tag in ("first", "second"):
        path = tmp_path / f"{tag}_partial"
        assert set(os.listdir(path)) == FILES  # only its own files
        dcp_to_torch_save(str(path), str(tmp_path / f"{tag}.pt"))
        saved = torch.load(tmp_path / f"{tag}.pt")
        model = {k[len("model/") :]: v.tolist() for k, v in saved.items() if k.startswith("model/")}
        assert model == held[tag], tag  # the state when its save was called, not later
        assert torch.load(path / "user_content.pt") == {"tag": tag}
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["first_partial", "second_partial", "newest", "first.pt", "second.pt"]
    )


def _saved_by_each_writer(rank, world_size, folder):
    import signal
    import warnings

    import smp
    from smp.state import writer_process

    model, optimizer, train = tiny(smp, {}, width=32, optimizer=torch.optim.Adam)
    train(torch.full((4, 32), 1.0))
    try:
        smp.save_checkpoint(folder, "bad", model=model, optimizer=optimizer, async_save="fast")
    except ValueError as err:
        refused = str(err)
    pids = {}
    for how in ("thread", "process"):
        pending = smp.save_checkpoint(folder, f"by_{how}", model=model, optimizer=optimizer, async_save=how)
        pids[how] = pending.writer_pid
        pending.wait()
    os.kill(pids["process"], signal.SIGKILL)  # a writer lost between saves (the OOM killer's pick)
    os.waitpid(pids["process"], 0)
    pending = smp.save_checkpoint(folder, "by_new", model=model, optimizer=optimizer, async_save="process")
    pids["new"] = pending.writer_pid
    pending.wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer_process.supported = lambda: False  # as off Linux
        pending = smp.save_checkpoint(
            folder, "by_fallback", model=model, optimizer=optimizer, async_save="process"
        )
        pids["fallback"] = pending.writer_pid
        pending.wait()
    return os.getpid(), pids, [str(w.message) for w in caught], refused


def test_a_writer_process_writes_what_a_thread_would(tmp_path):
    """async_save="process" writes the tensor files from a process of each rank's own, which ends
    with the rank (one lost between saves is replaced); the files are those the thread writer
    makes. Where no writer process can run, a warning says so and a thread writes it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    results = run_ranks(_saved_by_each_writer, 2, str(tmp_path), timeout=180)
    for pid, pids, caught, refused in results:
        assert "async_save='fast'" in refused and "'process'" in refused, refused
        assert pids["thread"] is None and pids["fallback"] is None, pids
        assert pids["process"] is not None and pids["process"] != pid, pids
        assert pids["new"] not in (None, pids["process"]), pids  # a new writer for the next save
        assert _ends(pids["process"]), f"the writer {pids['process']} outlived its rank"
        assert len(caught) == 1 and "a writer process needs Linux" in caught[0], caught
    assert results[0][1]["process"] != results[1][1]["process"]  # one writer per rank
    saved = {}
    for how in ("thread", "process", "new", "fallback"):
        dcp_to_torch_save(str(tmp_path / f"by_{how}_partial"), str(tmp_path / f"{how}.pt"))
        saved[how] = torch.load(tmp_path / f"{how}.pt")
    for how in ("process", "new", "fallback"):
        assert saved[how].keys() == saved["thread"].keys(), how
        for key, value in saved["thread"].items():
            assert torch.equal(value, saved[how][key]), (how, key)


def _killed_while_writing(rank, world_size, folder, pids_file):
    import signal

    import smp

    model, optimizer, train = tiny(smp, {}, width=1024, optimizer=torch.optim.Adam)
    train(torch.full((4, 1024), 1.0))
    pending = smp.save_checkpoint(folder, "torn", model=model, optimizer=optimizer, async_save="process")
    with open(f"{pids_file}.{rank}", "w") as f:
        f.write(str(pending.writer_pid))
    written = os.path.join(folder, "torn_partial.incomplete", "__0_0.distcp")
    deadline = time.monotonic() + 60
    while not os.path.exists(written) and time.monotonic() < deadline:
        time.sleep(0.01)  # until rank 0's writer is writing (rank 0 holds this model's tensors)
    os.kill(os.getpid(), signal.SIGKILL)  # as torchrun's peer would be: no exit handler runs


def test_a_writer_process_dies_with_its_rank(tmp_path):
    """A rank SIGKILLed while its writer process works leaves no writer behind (it would hold the
    shared memory and write into the folder while the restarted job runs) and no checkpoint."""
    from harness import RankFailure

    folder, pids_file = tmp_path / "ckpt", str(tmp_path / "writer_pid")
    folder.mkdir()
    try:
        run_ranks(_killed_while_writing, 2, str(folder), pids_file, timeout=120)
    except RankFailure as failure:
        assert "exited with code -9" in str(failure), failure
    else:
        raise AssertionError("the ranks were to kill themselves")
    for rank in range(2):
        pid = int(open(f"{pids_file}.{rank}").read())
        assert _ends(pid), f"writer {pid} outlived rank {rank}"
    assert not (folder / "torn_partial").exists() and not (folder / "newest").exists()


def _ends(pid: int, within: float = 10.0) -> bool:
    """Whether process `pid` is gone (or a zombie no one has reaped yet) within `within` s."""
    deadline = time.monotonic() + within
    while _state(pid) not in ("gone", "Z"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling for the kernel to end it
    return True


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def _copied_while_the_next_step_runs(rank, world_size, folder):
    import threading

    import smp

    smp.init({})
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))

    @smp.step
    def train(x):
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    def step() -> None:
        optimizer.zero_grad()
        train(torch.randn(4, 8))
        optimizer.step()

    step()
    held = {k: v.tolist() for k, v in model.local_state_dict().items()}
    gate, copy = threading.Event(), smp.checkpoint._staging.copy

    def held_back(*args, **kwargs):  # the save thread's copy waits for the gate
        copies, rest = copy(*args, **kwargs)
        return copies, lambda: (gate.wait(), rest())

    smp.checkpoint._staging.copy = held_back
    pending = smp.save_checkpoint(folder, "t", model=model, optimizer=optimizer, async_save=True)
    called = time.monotonic()
    threading.Timer(2.0, gate.set).start()
    step()  # its forward changes the running statistics at once; its optimizer step waits
    waited = time.monotonic() - called
    pending.wait()
    after = {k: v.tolist() for k, v in model.local_state_dict().items()}
    return held, after, waited


def test_parameters_are_copied_while_the_next_step_runs(tmp_path):
    """A background save copies the buffers at the call and the parameters and optimizer state in
    its thread: the next step's forward and backward run meanwhile, its optimizer step waits for
    the copy, and the checkpoint holds the state of the call (the running statistics as well)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    held, after, waited = run_ranks(_copied_while_the_next_step_runs, 1, str(tmp_path), timeout=120)[0]
    assert waited >= 2.0, waited  # the optimizer step waited for the copy
    dcp_to_torch_save(str(tmp_path / "t_partial"), str(tmp_path / "t.pt"))
    saved = {
        k[len("model/") :]: v.tolist()
        for k, v in torch.load(tmp_path / "t.pt").items()
        if k.startswith("model/")
    }
    assert saved == held
    assert after["1.running_mean"] != held["1.running_mean"] and after["0.weight"] != held["0.weight"]
