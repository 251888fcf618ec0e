"""Where checkpoint tensors go: torch.distributed.checkpoint (DCP) folders for partial
checkpoints, one torch.save file of whole tensors for full ones. Both read back into `Slices`
on any layout.

DCP is the ecosystem's format for sharded state: each rank writes its own file, a `.metadata`
file records every chunk's global coordinates, and a reader on another layout reads just the
chunks its slices overlap; users' tools (`torch.distributed.checkpoint.format_utils`) work on
it. Two parts of DCP's reading would unpickle arbitrary objects, and smp reads neither that way:
the `.metadata` file is unpickled with only DCP's own metadata classes allowed, and values
stored as pickled bytes (smp writes none) are refused.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from smp.state.sliced import Slices, assemble
from smp.state.writer_process import Arena, WriteFiles, WriterProcess, arena_bytes

_MODEL_FILE = "model.pt"  # a full checkpoint's model: a plain state_dict, loadable without smp
_OPTIMIZER_FILE = "optimizer.pt"
MODEL_PREFIX = "model/"  # a model tensor's key: MODEL_PREFIX + its state_dict key
_MODEL = MODEL_PREFIX


def save(
    tensors: dict[str, Any],
    folder: str,
    group: dist.ProcessGroup | None = None,
    process: WriterProcess | None = None,
    arena: Arena | None = None,
) -> float:
    """Writes this rank's tensors into the DCP folder (a collective over `group`, the world's).
    With `process`, that process writes the tensor files (`tensors`: views of `arena`, Staging's)
    while this one plans and writes the metadata. Returns the processor seconds `process` spent."""
    if process is None:
        writer = dcp.FileSystemWriter(folder, sync_files=True)
    else:
        writer = _WriterElsewhere(folder, process, arena)
    dcp.save(tensors, storage_writer=writer, planner=_SavePlanner(), process_group=group)
    return getattr(writer, "seconds_elsewhere", 0.0)


class _WriterElsewhere(dcp.FileSystemWriter):
    """DCP's file writer whose write_data (the tensor bytes) runs in a WriterProcess."""

    def __init__(self, folder: str, process: WriterProcess, arena: Arena):
        super().__init__(folder, sync_files=True)
        self._process, self._arena = process, arena
        self.seconds_elsewhere = 0.0

    def write_data(self, plan, planner):
        # this writer as set up for the save, as DCP's own class: the writer process imports no smp
        plain = dcp.FileSystemWriter.__new__(dcp.FileSystemWriter)
        mine = ("_process", "_arena", "seconds_elsewhere")
        plain.__dict__ = {k: v for k, v in vars(self).items() if k not in mine}
        data = {item.index: planner.resolve_data(item) for item in plan.items}
        results, self.seconds_elsewhere = self._process.call(WriteFiles(plain, plan, data), self._arena)
        done = torch.futures.Future()
        done.set_result(results)
        return done


def save_whole(tensors: dict[str, Any], folder: str, group: dist.ProcessGroup | None = None) -> None:
    """Gathers every rank's slices to global rank 0, which writes whole tensors (a collective
    over `group`, the world's)."""
    rank0 = dist.get_rank() == 0  # the world's first rank, where gather_object's dst=0 sends
    mine = []
    for key, value in tensors.items():
        if isinstance(value, Slices):
            # other ranks send clones: a view pickles its whole storage (a flat buffer, say)
            pieces = [
                (off, view.detach().cpu() if rank0 else view.detach().cpu().clone())
                for off, view in value.pieces
            ]
            mine.append((key, tuple(value.global_shape), value.dtype, pieces))
        else:
            mine.append((key, tuple(value.shape), value.dtype, [((0,) * value.dim(), value.detach().cpu())]))
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank0 else None
    dist.gather_object(None if rank0 else mine, gathered, dst=0, group=group)  # rank 0 keeps its own
    if not rank0:
        return
    gathered[0] = mine
    by_key: dict[str, tuple] = {}
    for part in gathered:
        for key, shape, dtype, pieces in part:
            by_key.setdefault(key, (shape, dtype, []))[2].extend(pieces)
    whole = {key: assemble(pieces, shape, dtype) for key, (shape, dtype, pieces) in by_key.items()}
    model = {k[len(_MODEL) :]: v for k, v in whole.items() if k.startswith(_MODEL)}
    others = {k: v for k, v in whole.items() if not k.startswith(_MODEL)}
    write(model, os.path.join(folder, _MODEL_FILE))
    write(others, os.path.join(folder, _OPTIMIZER_FILE))


def nbytes(tensors: dict[str, Any]) -> int:
    """The bytes `tensors` (Slices or tensors) hold: what staging them copies."""
    return sum(t.numel() * t.element_size() for _, t in _named_tensors(tensors))


class Staging:
    """Host copies of a save's tensors (Slices or tensors), for a background writer to write while
    training changes the originals. The copies' buffers are kept for the next background save:
    copying into memory already mapped costs a fifth of copying into fresh pages (whose first
    touch faults and zeroes them: 0.59 s against 0.12 s of processor time per GB here); the peak
    is the same, it is only not given back between saves (`release`). With `shared`, the buffers
    are views of one writer_process.Arena (`arena`), which a WriterProcess maps too."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.arena: Arena | None = None  # where the buffers are, when they are shared

    def copy(
        self, tensors: dict[str, Any], shared: bool = False, now: Callable[[str], bool] = lambda key: True
    ) -> tuple[dict[str, Any], Callable[[], None]]:
        """(copies of `tensors`, a function that fills the rest of them): the entries whose key
        `now` accepts are copied at once, the others when the function runs (before anything
        changes them). The previous copies' buffers must no longer be in use."""
        kept, self._buffers = self._buffers, {}
        sources = list(_named_tensors(tensors))
        if (self.arena is not None) != shared:
            kept, self.arena = {}, None
        if shared:
            plain = [(name, tuple(t.shape), t.dtype) for name, t in sources if type(t) is torch.Tensor]
            if self.arena is None or any(_unlike(kept.get(n), shape, dtype) for n, shape, dtype in plain):
                self.arena = Arena(arena_bytes([(shape, dtype) for _, shape, dtype in plain]))
                kept = {name: self.arena.view(shape, dtype) for name, shape, dtype in plain}
        copied, later = {}, []
        for name, source in sources:
            source = source.detach()
            if type(source) is not torch.Tensor:  # (a tensor subclass: copied as it asks, now)
                copied[name] = source.to("cpu", copy=True)
                continue
            buffer = kept.get(name)
            if _unlike(buffer, source.shape, source.dtype):
                buffer = torch.empty(source.shape, dtype=source.dtype)
            self._buffers[name] = copied[name] = buffer
            if now(name[0]):
                buffer.copy_(source)
            else:
                later.append((buffer, source))
        copies: dict[str, Any] = {}
        for key, value in tensors.items():
            if isinstance(value, Slices):
                copies[key] = Slices(value.global_shape, value.dtype)
                pieces = enumerate(value.pieces)
                copies[key].pieces = [(offsets, copied[(key, i)]) for i, (offsets, _) in pieces]
            else:
                copies[key] = copied[(key,)]

        def rest() -> None:
            for buffer, source in later:
                buffer.copy_(source)  # (releases the interpreter while it copies)

        return copies, rest

    def release(self) -> None:
        """Gives the kept buffers back (the next background save copies into fresh memory)."""
        self._buffers, self.arena = {}, None


def _named_tensors(tensors: dict[str, Any]):
    """(name, tensor) for every tensor a save holds: (key,) for a tensor, (key, i) for the i-th
    piece of Slices."""
    for key, value in tensors.items():
        if isinstance(value, Slices):
            yield from (((key, i), view) for i, (_, view) in enumerate(value.pieces))
        else:
            yield (key,), value


def _unlike(buffer: torch.Tensor | None, shape, dtype: torch.dtype) -> bool:
    return buffer is None or tuple(buffer.shape) != tuple(shape) or buffer.dtype != dtype


class Reader:
    """A checkpoint's tensors: which there are (`stored`) and reading slices of them (`load`)."""

    def __init__(self, folder: str, whole: bool):
        self.folder = folder
        self.whole = whole
        if whole:
            self._tensors = {_MODEL + k: v for k, v in _read_whole(os.path.join(folder, _MODEL_FILE)).items()}
            optimizer_file = os.path.join(folder, _OPTIMIZER_FILE)
            if os.path.exists(optimizer_file):
                self._tensors |= _read_whole(optimizer_file)
            self._shapes = {k: (v.shape, v.dtype) for k, v in self._tensors.items()}
        else:
            self._reader = _SafeReader(folder)
            metadata = self._reader.read_metadata()
            self._shapes = {
                k: (md.size, md.properties.dtype)
                for k, md in metadata.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata)
            }

    def stored(self, prefix: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return {k: v for k, v in self._shapes.items() if k.startswith(prefix)}

    def load(self, items: dict[str, Any]) -> None:
        """Fills `items` (Slices, or whole tensors) in place. A partial checkpoint's load is a
        collective over the world; a full one's reads the file every rank memory-maps."""
        if not self.whole:
            dcp.load(items, storage_reader=_SafeReader(self.folder), planner=_NoPickleLoadPlanner())
            return
        with torch.no_grad():
            for key, dest in items.items():
                source = self._tensors[key]
                if isinstance(dest, Slices):
                    dest.fill_from(source)
                else:
                    dest.copy_(source)


def write(obj: Any, filename: str, **kwargs) -> None:
    """torch.save, then fsync: the bytes are on disk before anything names them complete."""
    with open(filename, "wb") as f:
        torch.save(obj, f, **kwargs)
        f.flush()
        os.fsync(f.fileno())


def _read_whole(filename: str) -> dict[str, torch.Tensor]:
    # mmap: a rank touches only the pages of the slices it takes
    return torch.load(filename, map_location="cpu", weights_only=True, mmap=True)


# --- reading DCP without unpickling arbitrary objects ---------------------------------------

_METADATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
)
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("pathlib", "PosixPath"),
    ("torch.serialization", "_get_layout"),  # a torch.layout by its name
}


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's metadata classes, torch dtypes and sizes; refuses every other global."""

    def find_class(self, module: str, name: str):
        allowed = (
            module in _METADATA_MODULES
            or (module, name) in _METADATA_GLOBALS
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout))
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.memory_format))
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"smp: the checkpoint's .metadata names {module}.{name}, which is not part of "
                "torch.distributed.checkpoint's metadata; it was refused (unpickling it could run code)"
            )
        return super().find_class(module, name)


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(str(self.path), ".metadata")
        with open(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"smp: {path} does not hold checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SavePlanner(dcp.DefaultSavePlanner):
    def lookup_object(self, index):
        # DCP finds a chunk by offset only in tensors; Slices answer for theirs
        obj = self.state_dict.get(index.fqn)
        return obj.__get_tensor_shard__(index) if isinstance(obj, Slices) else super().lookup_object(index)


class _NoPickleLoadPlanner(dcp.DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner first rebuilds the dict's meta tensors (smp passes none) and, doing
        # so, replaces values of types it does not know, such as Slices, with None.
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index):
        obj = self.state_dict.get(index.fqn)
        return obj.__get_tensor_shard__(index) if isinstance(obj, Slices) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise pickle.UnpicklingError(
            f"smp: the checkpoint stores {read_item.dest_index.fqn} as a pickled object, which smp "
            "never writes; it was refused (unpickling it could run code)"
        )
