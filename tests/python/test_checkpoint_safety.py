"""Checkpoints are atomic (a save killed at any point leaves the previous one whole and `newest`
naming a complete one) and safe to load (a pickled object that would run code is refused)."""

from __future__ import annotations

import os
import pickle
import random
import shutil
import signal

import torch
from harness import run_ranks
from torch import nn

TAGS = ["t1", "t2", "t1", "t3", "t4"]  # t1 twice: saving a tag again replaces it
EXPECTED = {".metadata", "__0_0.distcp", "smp_meta.pt", "user_content.pt", "rank_0.pt"}  # DCP's, then smp's


def _saving_child(folder: str, kill_at: int) -> None:
    """Trains one step, then saves checkpoints in a loop; SIGKILLs itself at the kill_at-th file
    write, fsync, rename or removal the saves make (counted from the first save; DCP's own writes
    are counted by their fsyncs)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)  # a plain process: smp runs as a world of one
    # The thread pools were inherited from the parent mid-flight: rebuild them on this thread
    # before backward starts autograd's worker, whose own set_num_threads otherwise races this
    # thread's first parallel op over the pool ("Invalid thread pool!", SIGABRT: seen in CI).
    torch.set_num_threads(1)
    import smp
    from smp.state import storage as checkpoint_storage

    smp.init({})
    torch.manual_seed(0)
    model = smp.DistributedModel(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(x):
        loss = model(x).square().mean()
        model.backward(loss)

    train_step(torch.randn(4, 64))
    opt.step()
    events = [0]

    def counted(fn):
        def run(*args, **kwargs):
            events[0] += 1
            if events[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)

        return run

    checkpoint_storage.write = counted(checkpoint_storage.write)
    os.rename, os.replace, shutil.rmtree = counted(os.rename), counted(os.replace), counted(shutil.rmtree)
    os.fsync = counted(os.fsync)
    while True:
        for tag in TAGS:
            smp.save_checkpoint(folder, tag, model=model, optimizer=opt, user_content={"tag": tag})


def _check(folder: str) -> str | None:
    """The tag `newest` names, after checking its checkpoint is complete and loads (None: no save
    has completed yet)."""
    newest = os.path.join(folder, "newest")
    if not os.path.exists(newest):
        return None
    tag = open(newest).read().strip()
    path = os.path.join(folder, f"{tag}_partial")
    if not os.path.isdir(path):
        assert os.path.isdir(path + ".replaced"), (tag, sorted(os.listdir(folder)))
        path += ".replaced"  # killed between the two renames of a re-save; resume reads it
    assert set(os.listdir(path)) == EXPECTED, (tag, os.listdir(path))
    from smp.state import storage as checkpoint_storage

    reader = checkpoint_storage.Reader(path, whole=False)
    stored = reader.stored("")
    assert any(k.startswith("model/") for k in stored) and any(k.startswith("optimizer/") for k in stored)
    reader.load({k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in stored.items()})  # every byte
    torch.load(os.path.join(path, "smp_meta.pt"), weights_only=True)
    assert torch.load(os.path.join(path, "user_content.pt"), weights_only=True) == {"tag": tag}
    return tag


def _kill_trials(rank, world_size, folder, trials):
    """Forks a saving child per trial (torch already imported here) and kills it at a random point
    of its saves; the checkpoints left must always be whole."""
    import time

    import smp  # noqa: F401  (imported once here, inherited by every forked child)
    import torch._dynamo  # noqa: F401  (what the first optimizer imports: 2 s per child otherwise)

    rng = random.Random(1234)
    seen = []
    for _ in range(trials):
        kill_at = rng.randint(1, 45)  # about four saves' worth of file operations
        pid = os.fork()  # (the harness's processes are daemons: multiprocessing cannot nest)
        if pid == 0:
            try:
                _saving_child(folder, kill_at)
            finally:
                os._exit(1)  # only reached if the kill never came
        deadline = time.monotonic() + 120
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"the saving child (kill_at={kill_at}) never reached its kill point")
            time.sleep(0.01)  # polling a child process with a deadline
        assert os.WIFSIGNALED(done[1]) and os.WTERMSIG(done[1]) == signal.SIGKILL, (kill_at, done)
        seen.append((kill_at, _check(folder)))
    return seen


def test_a_save_killed_at_any_point_leaves_a_complete_newest(tmp_path):
    (seen,) = run_ranks(_kill_trials, 1, str(tmp_path), 20, init=False, timeout=300)
    tags = [tag for _, tag in seen]
    assert tags[0] is None or tags[0] in TAGS
    assert sum(tag is not None for tag in tags) >= 15, seen  # most trials get past a first save


class _RunsCode:
    """Unpickling this calls a function: what a malicious checkpoint does."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (_touch, (self.marker,))


def _touch(path: str) -> None:
    open(path, "w").close()


def _unsafe(rank, world_size, folder):
    import smp

    smp.init({})
    model = smp.DistributedModel(nn.Linear(4, 4))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    marker = os.path.join(folder, "code_ran")
    smp.save_checkpoint(folder, "bad", model=model, optimizer=opt, user_content={"x": _RunsCode(marker)})
    smp.save(_RunsCode(marker), os.path.join(folder, "obj.pt"), partial=False)
    out = {}
    for key, load in (
        ("resume", lambda **kw: smp.resume_from_checkpoint(folder, **kw)),
        ("load", lambda **kw: smp.load(os.path.join(folder, "obj.pt"), partial=False, **kw)),
    ):
        try:
            load()
            out[key] = "loaded"
        except pickle.UnpicklingError as err:
            out[key] = str(err)
        out[key + "_ran"] = os.path.exists(marker)
    smp.resume_from_checkpoint(folder, weights_only=False)  # the explicit opt-in loads it
    out["opt_in_ran"] = os.path.exists(marker)
    os.remove(marker)
    # DCP's .metadata is a pickle: a doctored one is refused whatever weights_only says
    smp.save_checkpoint(folder, "doctored", model=model, optimizer=opt, user_content=None)
    with open(os.path.join(folder, "doctored_partial", ".metadata"), "wb") as f:
        pickle.dump(_RunsCode(marker), f)
    try:
        smp.resume_from_checkpoint(folder, tag="doctored", weights_only=False)
        out["metadata"] = "loaded"
    except pickle.UnpicklingError as err:
        out["metadata"] = str(err)
    out["metadata_ran"] = os.path.exists(marker)
    smp.parallel_state.reset()
    return out


def test_a_pickled_object_that_runs_code_is_refused(tmp_path):
    (out,) = run_ranks(_unsafe, 1, str(tmp_path), timeout=120)
    for key in ("resume", "load"):
        assert "holds objects other than tensors, plain containers" in out[key], out[key]
        assert "pass weights_only=False" in out[key]
        assert not out[key + "_ran"]
    assert out["opt_in_ran"]
    assert "is not part of torch.distributed.checkpoint's metadata" in out["metadata"], out["metadata"]
    assert not out["metadata_ran"]


def _export_gpt2(rank, world_size, folder):
    import hf_cases
    import smp

    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        model = smp.DistributedModel(hf_cases.gpt2())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))

    @smp.step
    def train_step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    @smp.step
    def logits_of(ids):
        return model(input_ids=ids, labels=ids).logits  # (the structure captured at the first step)

    for s in range(2):
        opt.zero_grad()
        train_step(hf_cases.causal_batch(s, 8)["ids"])
        opt.step()
    model.eval()
    ids = hf_cases.causal_batch(99, 8)["ids"]  # (the shapes captured at the first step)
    logits = logits_of(ids).concat()
    model.save_pretrained(folder)
    smp.parallel_state.reset()
    return ids.tolist(), logits.tolist()


def test_save_pretrained_loads_in_plain_transformers(tmp_path):
    """GPT-2 trained at pp2 x tp2, saved with save_pretrained, loaded by transformers without smp:
    the same logits."""
    from transformers import AutoModelForCausalLM

    ids, logits = run_ranks(_export_gpt2, 4, str(tmp_path), timeout=300)[0]
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        expected = plain(input_ids=torch.tensor(ids)).logits
    torch.testing.assert_close(torch.tensor(logits), expected, rtol=1e-5, atol=1e-5)
