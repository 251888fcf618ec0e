"""Checkpoints in SMP v1's shape: smp.save / smp.load, smp.save_checkpoint / smp.resume_from_checkpoint.

A partial checkpoint (the default) is one model file per model-parallel rank (its stage, its
tensor-parallel shard) and one optimizer file per rank that owns distinct optimizer state; it
resumes on the same layout. A full checkpoint holds the whole unsharded model in one file and
resumes on any layout (its optimizer files only on the same layout).

Resuming before the first step is deferred until the model is partitioned, as in SMP v1: the
files are read at once (so a wrong path fails at the call), applied after partitioning.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from smp import comm, parallel_state

_NEWEST = "newest"


def save(obj: Any, f: str, partial: bool = True, v3: bool = False, **kwargs) -> None:
    """torch.save; with partial=True each model-parallel rank writes its own file (`f` + `_{mp_rank}`).
    Call it on the ranks that should write (usually those with rdp_rank() == 0). With partial=False
    the file is written once, by global rank 0, as in SMP. `v3` (SMP's sharded-checkpoint format flag,
    which transformers passes) is accepted: the file is the same."""
    del v3
    if partial:
        torch.save(obj, _partial_name(f), **kwargs)
    elif not parallel_state.is_initialized() or parallel_state.rank() == 0:
        torch.save(obj, f, **kwargs)


def load(f: str, map_location=None, partial: bool = True, back_compat: bool = False) -> Any:
    """Reads what smp.save wrote; with partial=True, this model-parallel rank's file. `back_compat`
    (SMP's flag for its older file formats) is accepted: smp has one format."""
    del back_compat
    path = _partial_name(f) if partial else f
    if not os.path.exists(path):
        partial_file = parallel_state.is_initialized() and not partial and os.path.exists(_partial_name(f))
        hint = " (it was saved with partial=True: load it with partial=True)" if partial_file else ""
        raise FileNotFoundError(f"smp.load: {path} does not exist{hint}")
    return torch.load(path, map_location=map_location, weights_only=False)


def save_checkpoint(
    path: str,
    tag: str,
    partial: bool = True,
    model=None,
    optimizer=None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
) -> None:
    """Writes model, optimizer and user content under `path/tag[_partial]` and records the tag as
    newest. A collective: call it on every rank."""
    del translate_if_full  # smp's full checkpoints already use the original module's keys
    model = model if model is not None else parallel_state.state().model
    folder = os.path.join(path, _folder(tag, partial))
    if parallel_state.rank() == 0:
        os.makedirs(folder, exist_ok=True)
    comm.barrier()
    if model is not None:
        if partial:
            if parallel_state.rdp_rank() == 0:
                torch.save(model.local_state_dict(), os.path.join(folder, f"model_{_mp_suffix()}.pt"))
        else:
            full = model.state_dict()  # a collective over the model-parallel ranks
            if parallel_state.rank() == 0:
                torch.save(full, os.path.join(folder, "model.pt"))
    if optimizer is not None:
        _save_optimizer(optimizer, folder)
    if parallel_state.rank() == 0:
        torch.save(user_content, os.path.join(folder, "user_content.pt"))
    comm.barrier()
    if parallel_state.rank() == 0:
        with open(os.path.join(path, _NEWEST), "w") as out:
            out.write(tag)
        if partial and num_kept_partial_checkpoints:
            _prune(path, tag, num_kept_partial_checkpoints)
    comm.barrier()


def resume_from_checkpoint(
    path: str,
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    load_sharded_optimizer_state: bool = True,
    translate_function=None,
) -> Any:
    """Loads a checkpoint written by save_checkpoint (the newest when tag is None) into the
    DistributedModel and its DistributedOptimizer; returns the user content."""
    del translate_function  # checkpoints hold the original module's keys: nothing to translate
    model = parallel_state.state().model
    if model is None:
        raise RuntimeError(
            "smp.resume_from_checkpoint: create smp.DistributedModel and smp.DistributedOptimizer first"
        )
    if tag is None:
        newest = os.path.join(path, _NEWEST)
        if not os.path.exists(newest):
            raise FileNotFoundError(
                f"smp.resume_from_checkpoint: no checkpoint in {path} ({newest} is missing)"
            )
        with open(newest) as f:
            tag = f.read().strip()
    folder = os.path.join(path, _folder(tag, partial))
    model_file = os.path.join(folder, f"model_{_mp_suffix()}.pt" if partial else "model.pt")
    if not partial and os.path.isfile(folder):
        # SMP also resumed a full checkpoint that is one state_dict file, `path/tag`: transformers'
        # Trainer resumes its pytorch_model.bin this way (with load_optimizer=False).
        model_state = torch.load(folder, map_location="cpu", weights_only=False)
        model.register_post_partition_hook(
            lambda model, optimizer: model.load_state_dict(model_state, strict)
        )
        return None
    if not os.path.exists(model_file):
        raise FileNotFoundError(
            f"smp.resume_from_checkpoint: {model_file} does not exist; a partial checkpoint resumes only on "
            "the layout that wrote it (same pipeline and tensor parallel degrees); save with partial=False "
            "to change layouts"
        )
    model_state = torch.load(model_file, map_location="cpu", weights_only=False)
    optimizer_state = None
    if load_optimizer and model.engine.optimizer is not None:
        optimizer_state = _load_optimizer(folder, load_sharded_optimizer_state)
    user_content = torch.load(os.path.join(folder, "user_content.pt"), weights_only=False)

    def apply(model, optimizer) -> None:
        if partial:
            model.module.load_state_dict(model_state, strict=strict)
        else:
            model.load_state_dict(model_state, strict=strict)
        if optimizer is not None and optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)

    model.register_post_partition_hook(apply)
    return user_content


# --- files ------------------------------------------------------------------------------------


def _save_optimizer(optimizer, folder: str) -> None:
    sharded = optimizer.sharded
    if sharded:  # every rank owns a chunk
        torch.save(
            optimizer.local_state_dict(),
            os.path.join(folder, f"optimizer_{_mp_suffix()}_{parallel_state.rdp_rank()}.pt"),
        )
        return
    state = optimizer.rank_state_dict()  # one file per model-parallel rank: its own part
    if parallel_state.rdp_rank() == 0:
        torch.save(state, os.path.join(folder, f"optimizer_{_mp_suffix()}.pt"))


def _load_optimizer(folder: str, sharded_ok: bool):
    chunk = os.path.join(folder, f"optimizer_{_mp_suffix()}_{parallel_state.rdp_rank()}.pt")
    whole = os.path.join(folder, f"optimizer_{_mp_suffix()}.pt")
    if os.path.exists(chunk) and sharded_ok:
        return torch.load(chunk, map_location="cpu", weights_only=False)
    if os.path.exists(whole):
        return torch.load(whole, map_location="cpu", weights_only=False)
    raise FileNotFoundError(
        f"smp.resume_from_checkpoint: no optimizer state for this rank in {folder} (looked for "
        f"{os.path.basename(chunk)} and {os.path.basename(whole)}); resume on the layout that saved it, or "
        "pass load_optimizer=False"
    )


def _folder(tag: str, partial: bool) -> str:
    return f"{tag}_partial" if partial else tag


def _mp_suffix() -> str:
    return f"{parallel_state.pp_rank()}_{parallel_state.tp_rank()}"


def _partial_name(f: str) -> str:
    return f"{f}_{parallel_state.mp_rank()}"


def _prune(path: str, newest: str, keep: int) -> None:
    """Deletes the oldest partial checkpoints beyond `keep` (by the order they were written)."""
    ledger = os.path.join(path, "partial_checkpoints")
    tags = open(ledger).read().split() if os.path.exists(ledger) else []
    tags = [t for t in tags if t != newest] + [newest]
    for old in tags[:-keep]:
        shutil.rmtree(os.path.join(path, _folder(old, True)), ignore_errors=True)
    with open(ledger, "w") as out:
        out.write("\n".join(tags[-keep:]))
