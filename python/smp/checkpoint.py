"""Checkpoints in SMP v1's shape: smp.save / smp.load, smp.save_checkpoint / smp.resume_from_checkpoint.

A partial checkpoint (the default) is one model file per model-parallel rank (its stage, its
tensor-parallel shard) and one optimizer file per rank that owns distinct optimizer state; it
resumes on the same layout. A full checkpoint holds the whole unsharded model in one file and
resumes on any layout (its optimizer files only on the same layout).

Resuming before the first step is deferred until the model is partitioned, as in SMP v1: the
files are read at once (so a wrong path fails at the call), applied after partitioning.

Saves are atomic: every rank writes and fsyncs its files in `<folder>.incomplete`, which rank 0
renames to the checkpoint's folder once all are done; `newest` is replaced (write, fsync,
rename) only after that. A job killed at any point of a save leaves the previous checkpoint
whole and `newest` naming a complete one.

Loads are safe: files are read with `torch.load(weights_only=True)`, which rebuilds tensors and
plain containers, plus the data types SMP v1 scripts keep in user_content (numpy scalars, dtypes
and arrays, transformers configurations: smp.state.safe_load), and refuses any other pickled
object (it could run code). Content of your own that needs more (e.g. an argparse Namespace)
loads only when you pass `weights_only=False`, for files you trust.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from smp import comm, parallel_state
from smp.state import (
    folders,
    layout_free,
    model_state,
    rank_state,
    safe_load,
    snapshot,
    storage,
    writer_process,
)


def save(obj: Any, f: str, partial: bool = True, v3: bool = False, **kwargs) -> None:
    """torch.save; with partial=True each model-parallel rank writes its own file (`f` + `_{mp_rank}`).
    Call it on the ranks that should write (usually those with rdp_rank() == 0). With partial=False
    the file is written once, by global rank 0, as in SMP. `v3` (SMP's sharded-checkpoint format flag,
    which transformers passes) is accepted: the file is the same."""
    del v3
    if partial:
        storage.write(obj, _partial_name(f), **kwargs)
    elif not parallel_state.is_initialized() or parallel_state.rank() == 0:
        storage.write(obj, f, **kwargs)


def load(
    f: str, map_location=None, partial: bool = True, back_compat: bool = False, weights_only: bool = True
) -> Any:
    """Reads what smp.save wrote; with partial=True, this model-parallel rank's file. `back_compat`
    (SMP's flag for its older file formats) is accepted: smp has one format. Only tensors, plain
    containers and smp.state.safe_load's data types load unless `weights_only=False` (then the file
    may run code: trusted files only)."""
    del back_compat
    path = _partial_name(f) if partial else f
    if not os.path.exists(path):
        partial_file = parallel_state.is_initialized() and not partial and os.path.exists(_partial_name(f))
        hint = " (it was saved with partial=True: load it with partial=True)" if partial_file else ""
        raise FileNotFoundError(f"smp.load: {path} does not exist{hint}")
    return safe_load.load(path, map_location, weights_only, "smp.load")


def save_checkpoint(
    path: str,
    tag: str,
    partial: bool = True,
    model=None,
    optimizer=None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
    async_save: bool | str = False,
) -> PendingSave | None:
    """Writes model, optimizer and user content under `path/tag[_partial]` and records the tag as
    newest. A collective: call it on every rank. Either kind resumes on any layout: a partial
    checkpoint is a torch.distributed.checkpoint folder (each rank writes its own slices), a full
    one holds the whole model in one torch.save file (`model.pt`, a plain state_dict).

    With `async_save=True` (smp's own argument) the state is copied to host memory and the files
    are written in the background while training goes on; the returned PendingSave's wait()
    returns once the checkpoint is complete and named newest. The next save_checkpoint or
    resume_from_checkpoint waits for it; so must the script before it exits. A thread of this
    process writes the files; with `async_save="process"` a partial checkpoint's tensor files are
    written by a process of this rank's own instead (smp.state.writer_process: the copy is in
    shared memory, and the writing never holds this interpreter; off Linux a thread writes them,
    with a warning). On the 2-core VM the thread stalls training less (docs/benchmarks.md)."""
    del translate_if_full  # smp's checkpoints already use the original module's keys
    if async_save not in _ASYNC_SAVES:
        raise ValueError(
            f"smp.save_checkpoint: async_save={async_save!r}; pass False, True or 'thread' (a writer "
            "thread), or 'process' (a writer process per rank)"
        )
    wait_for_checkpoint()
    model = model if model is not None else parallel_state.state().model
    final = os.path.join(path, folders.folder(tag, partial))
    folder = final + folders.INCOMPLETE  # nothing here counts until rank 0 renames it
    if parallel_state.rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)  # left by a save that was killed
        os.makedirs(folder)
    comm.barrier()
    tensors, meta = _state_to_save(model, optimizer)
    metas: list[Any] = [None] * parallel_state.size()
    torch.distributed.all_gather_object(metas, meta)  # small: hyperparameters and plain values
    keep = num_kept_partial_checkpoints
    ranked = rank_state.capture(_layout())  # (now: the generators as this step leaves them)
    job = _SaveJob(path, tag, partial, folder, final, keep, tensors, _merge_meta(metas), user_content, ranked)
    if not async_save:
        job.run(None)
        return None
    global _pending
    staged_bytes = storage.nbytes(tensors)
    job.process = _writer_process(async_save) if partial else None
    # Buffers (a forward may change them) are copied now; parameters and optimizer state, which
    # only the optimizer's step changes (it waits: smp.state.snapshot), by the save's thread.
    later = _copied_later(model, optimizer, tensors)
    job.tensors, job.copy_rest = _staging.copy(
        tensors, shared=job.process is not None, now=lambda key: key not in later
    )
    job.arena = _staging.arena
    snapshot.begin()
    _pending = PendingSave(job, parallel_state.checkpoint_group())
    _pending.staged_bytes = staged_bytes
    return _pending


_ASYNC_SAVES = (False, True, "thread", "process")


def _copied_later(model, optimizer, tensors: dict[str, Any]) -> set[str]:
    """The keys a background save may copy after its call returns: none unless the optimizer is
    smp's (its step waits for the copy); then all but the model's buffers."""
    from smp.optimizer import DistributedOptimizer  # (imports this module's users)

    if model is None or not isinstance(optimizer, DistributedOptimizer):
        return set()
    buffers = {_MODEL + k for k, _ in model.engine.state.module.named_buffers(remove_duplicate=False)}
    return {key for key in tensors if key not in buffers}


_writer: writer_process.WriterProcess | None = None


def _writer_process(async_save: bool | str) -> writer_process.WriterProcess | None:
    """The process that writes background saves' tensor files (started by the first asking for
    one), or None where a thread writes them: asked for, or not on Linux (a warning says so)."""
    global _writer
    if async_save != "process":
        return None
    if not writer_process.supported():
        warnings.warn(
            f"smp.save_checkpoint(async_save='process'): a writer process needs Linux (memfd_create, "
            f"SCM_RIGHTS), not {sys.platform}; a thread of this process writes the checkpoint (training "
            "slows more while it writes)",
            stacklevel=3,
        )
        return None
    if _writer is None or not _writer.alive():
        _writer = writer_process.WriterProcess()
    return _writer


def release_staging() -> None:
    """Gives back the host memory background saves keep for their copy of the state (it is kept
    from one background save to the next, which then copies without page faults)."""
    wait_for_checkpoint()
    _staging.release()


def wait_for_checkpoint() -> None:
    """Waits for a checkpoint being written in the background (async_save) and raises its error."""
    global _pending
    pending, _pending = _pending, None
    if pending is not None:
        pending.wait()


class PendingSave:
    """A checkpoint written by a background thread: wait() returns when it is complete and newest.
    `staged_bytes`: the host memory its copy of this rank's state holds until then;
    `cpu_seconds`: the processor time its thread and the writer process have taken (what it
    costs a busy host); `writer_pid`: the writer process's (None where a thread writes it all)."""

    def __init__(self, job: _SaveJob, group):
        self.staged_bytes = 0
        self.cpu_seconds = 0.0
        self.writer_pid = job.process.pid if job.process is not None else None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(job, group), name="smp-checkpoint")
        self._thread.start()

    def _run(self, job: _SaveJob, group) -> None:
        start = time.thread_time()
        try:
            try:
                job.copy_rest()
            finally:
                snapshot.done()
            job.run(group)
        except BaseException as err:  # handed to the training thread by wait()
            self._error = err
        finally:
            self.cpu_seconds = time.thread_time() - start + job.seconds_elsewhere

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(
                f"smp: a checkpoint saved in the background failed: {self._error}"
            ) from self._error


_pending: PendingSave | None = None
_staging = storage.Staging()


@dataclasses.dataclass
class _SaveJob:
    path: str
    tag: str
    partial: bool
    folder: str
    final: str
    keep: int | None
    tensors: dict[str, Any]
    meta: dict
    user_content: Any
    ranked: dict  # this rank's generators and registered objects
    process: writer_process.WriterProcess | None = None  # writes the tensor files, where given
    arena: writer_process.Arena | None = None  # where `tensors` are, for `process`
    seconds_elsewhere: float = 0.0  # the processor time `process` spent on them
    copy_rest: Callable[[], None] = lambda: None  # copies what the call left to the thread

    def run(self, group) -> None:
        """Writes the files, then (rank 0, once every rank's are synced) publishes the checkpoint.
        A collective over `group` (None: the world's default group)."""
        if self.partial:
            self.seconds_elsewhere = storage.save(self.tensors, self.folder, group, self.process, self.arena)
        else:
            storage.save_whole(self.tensors, self.folder, group)
        rank0 = torch.distributed.get_rank() == 0
        storage.write(self.ranked, _rank_file(self.folder, torch.distributed.get_rank()))

        def barrier() -> None:
            comm.barrier() if group is None else torch.distributed.barrier(group=group)

        if rank0:
            storage.write(self.meta, os.path.join(self.folder, _META))
            storage.write(self.user_content, os.path.join(self.folder, _USER_CONTENT))
        barrier()  # every rank's files are written and synced
        if rank0:
            folders.publish(self.folder, self.final)
            folders.replace_text(os.path.join(self.path, folders.NEWEST), self.tag)
            if self.partial and self.keep:
                folders.prune(self.path, self.tag, self.keep)
        barrier()


def resume_from_checkpoint(
    path: str,
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    load_sharded_optimizer_state: bool = True,
    translate_function=None,
    weights_only: bool = True,
) -> Any:
    """Loads a checkpoint written by save_checkpoint (the newest when tag is None) into the
    DistributedModel and its DistributedOptimizer, whatever layout wrote it; returns the user
    content, or None when `path` holds no checkpoint yet (a fresh start: a script resumes with
    this one call, under `torchrun --max-restarts` too). A save that a kill left incomplete is
    never read (a warning names it). Each rank's random number generators and registered
    objects (smp.register_stateful: data positions) are put back (smp.state.rank_state).
    Files hold tensors and plain containers; user content may also hold numpy values and
    transformers configurations (smp.state.safe_load); other objects need `weights_only=False`
    (trusted files only: unpickling them may run code).

    `load_sharded_optimizer_state` is accepted for SMP v1 scripts: any optimizer state resumes on
    any layout, sharded or not. `translate_function` is accepted too: checkpoints hold the
    original module's keys, so there is nothing to translate."""
    del translate_function, load_sharded_optimizer_state
    wait_for_checkpoint()
    model = parallel_state.state().model
    if model is None:
        raise RuntimeError(
            "smp.resume_from_checkpoint: create smp.DistributedModel and smp.DistributedOptimizer first"
        )
    if tag is None:
        tag = folders.newest_tag(path, "smp.resume_from_checkpoint")
        if tag is None:
            return None  # a fresh start: nothing saved yet
    folder = os.path.join(path, folders.folder(tag, partial))
    if not os.path.exists(folder) and os.path.exists(folder + folders.REPLACED):
        folder += folders.REPLACED  # a save of the same tag was killed between its two renames
    if not partial and os.path.isfile(folder):
        # SMP also resumed a full checkpoint that is one state_dict file, `path/tag`: transformers'
        # Trainer resumes its pytorch_model.bin this way (with load_optimizer=False).
        model_state = safe_load.load(folder, "cpu", weights_only, "smp.resume_from_checkpoint")
        model.register_post_partition_hook(
            lambda model, optimizer: model.load_state_dict(model_state, strict)
        )
        return None
    meta_file = os.path.join(folder, _META)
    if not os.path.exists(meta_file):
        other = os.path.join(path, folders.folder(tag, not partial))
        hint = f" ({other} exists: pass partial={not partial})" if os.path.exists(other) else ""
        raise FileNotFoundError(f"smp.resume_from_checkpoint: {meta_file} does not exist{hint}")
    meta = safe_load.load(meta_file, None, True, "smp.resume_from_checkpoint")
    user_content = safe_load.load(
        os.path.join(folder, _USER_CONTENT), None, weights_only, "smp.resume_from_checkpoint"
    )
    source = storage.Reader(folder, whole=not partial)  # opened now: a torn folder fails here
    _restore_rank_state(folder, weights_only)

    def apply(model, optimizer) -> None:
        places = model.engine.state.places()
        items, install = {}, None
        if load_optimizer and optimizer is not None:
            if meta.get("optimizer") is None:
                raise ValueError(
                    f"smp.resume_from_checkpoint: {folder} holds no optimizer state; "
                    "pass load_optimizer=False"
                )
            # first: the optimizer may move the parameters into its flat buffers
            items, install = optimizer.checkpoint_destinations(places, source.stored(layout_free.PREFIX))
        items |= _model_destinations(model, places, source, strict)
        source.load(items)
        if install is not None:
            install(meta["optimizer"])

    model.register_post_partition_hook(apply)
    return user_content


def newest_user_content(path: str, weights_only: bool = True) -> Any:
    """The user content of the newest complete checkpoint in `path` (None if there is none),
    read without a model: a script can size its run from it before smp.init (the main job keeps
    its global batch when it resumes on another number of processes)."""
    tag = folders.newest_tag(path, "smp.checkpoint.newest_user_content")
    if tag is None:
        return None
    for partial in (True, False):
        filename = os.path.join(path, folders.folder(tag, partial), _USER_CONTENT)
        if os.path.exists(filename):
            return safe_load.load(filename, None, weights_only, "smp.checkpoint.newest_user_content")
    return None


# --- what a checkpoint holds -----------------------------------------------------------------

_META = "smp_meta.pt"
_USER_CONTENT = "user_content.pt"


def _rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank_{rank}.pt")


def _layout() -> tuple:
    topology = parallel_state.state().topology
    return (topology.world_size, topology.pp, topology.tp, topology.sdp, topology.order, topology.cp)


def _restore_rank_state(folder: str, weights_only: bool) -> None:
    """This rank's generators and registered objects (smp.state.rank_state), where saved."""
    first = _rank_file(folder, 0)
    if not os.path.exists(first):
        return  # (a checkpoint written before ranks kept state)
    own = _rank_file(folder, parallel_state.rank())
    read = lambda f: safe_load.load(f, None, weights_only, "smp.resume_from_checkpoint")  # noqa: E731
    rank_state.restore(read(own) if os.path.exists(own) else None, read(first), _layout())


_MODEL = storage.MODEL_PREFIX


def _state_to_save(model, optimizer) -> tuple[dict[str, Any], dict]:
    """(the tensors this rank writes, keyed for the checkpoint; this rank's metadata)."""
    tensors: dict[str, Any] = {}
    meta: dict = {"format": 1, "optimizer": None}
    if model is None:
        return tensors, meta
    places = model.engine.state.places()
    if optimizer is not None:  # first: it may move the parameters into its flat buffers
        tensors, meta["optimizer"] = optimizer.checkpoint_state(places)
    tensors |= {_MODEL + k: v for k, v in model_state.model_slices(places, for_save=True).items()}
    return tensors, meta


def _merge_meta(metas: list[dict]) -> dict:
    """One metadata for the checkpoint: the ranks agree on everything but each parameter's plain
    values, which only the rank writing that parameter reports."""
    merged = dict(metas[0])
    if merged.get("optimizer") is not None:
        values: dict = {}
        for meta in metas:
            values |= meta["optimizer"]["values"]
        merged["optimizer"] = {**merged["optimizer"], "values": values}
    return merged


def _model_destinations(model, places, source, strict: bool) -> dict[str, Any]:
    """The model's tensors to fill from `source` (all this rank holds), after checking keys."""
    wanted = model_state.model_slices(places, for_save=False)
    shapes = {k[len(_MODEL) :]: shape for k, (shape, _) in source.stored(_MODEL).items()}
    stored = set(shapes)
    missing = sorted(set(wanted) - stored)
    unexpected = sorted(stored - set(model.engine.state_keys))
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"smp.resume_from_checkpoint: the checkpoint lacks {missing[:5]} and has keys this model does "
            f"not {unexpected[:5]}; pass strict=False to load the keys both have"
        )
    for name, slices in wanted.items():
        if name in stored:
            shape = shapes[name]
            if tuple(shape) != tuple(slices.global_shape):
                raise ValueError(
                    f"smp.resume_from_checkpoint: {name} has shape {tuple(shape)} in the checkpoint and "
                    f"{tuple(slices.global_shape)} in this model"
                )
    return {_MODEL + k: v for k, v in wanted.items() if k in stored}


def _partial_name(f: str) -> str:
    return f"{f}_{parallel_state.mp_rank()}"
