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

    def recorded_write(tensors, target, group=None):
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
        write(tensors, target, group)
        events.append(("written", tag, None))

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
