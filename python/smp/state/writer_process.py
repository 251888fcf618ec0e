"""A process of this rank's own that writes a background checkpoint's tensor files.

A writer *thread* stalls training on a CPU host: DCP writes each tensor with torch.save, which
holds the interpreter while it serializes and checksums (1.4-4.1 s of its own processor time per
GB here), so the training thread waits for the GIL (stall 0.41 of a synchronous save on the
2-core VM). A process has an interpreter of its own. Only the bytes move there: the planning, the
metadata and the barriers stay in the training process's save thread (they are the collectives,
over process groups the writer does not have), which waits while the writer writes.

The staged tensors are views of one `Arena`, an anonymous shared-memory file (memfd): a request
pickles each view as (dtype, offset, shape, stride) and sends the file's descriptor along, so no
tensor data crosses the pipe. An anonymous file is not in /dev/shm (whose 64 MB default in a
container would not hold a model) and is freed with the last process that maps it, so a rank
SIGKILLed under torchrun leaks nothing.

The writer is a plain `python -c` subprocess, not a multiprocessing one: spawn would run the
training script's main module again in it (a script without an `if __name__ == "__main__"` guard
would train twice), and fork copies a process with Gloo and OpenMP threads. It imports this file
alone (as `writer_process`, not through the smp package) with torch and DCP: its requests hold
DCP's own objects and tensors, nothing of smp's. It is started by the first background save,
serves every later one, dies with its parent (PR_SET_PDEATHSIG) and stops at exit. Linux only
(memfd, SCM_RIGHTS); elsewhere `supported()` is False and a thread writes.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import io
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import torch

_LENGTH = struct.Struct("<Q")
_ALIGN = 64  # every view starts on a cache line (and so on any dtype's alignment)


def supported() -> bool:
    """Whether a writer process can be used here (Linux: memfd_create and SCM_RIGHTS)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and sys.platform == "linux"


class Arena:
    """One anonymous shared-memory file mapped here; `view` carves tensors out of it."""

    def __init__(self, nbytes: int):
        self.nbytes = max(_round_up(nbytes), _ALIGN)
        self.fd = os.memfd_create("smp-checkpoint-staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)
        self.bytes = torch.frombuffer(mmap.mmap(self.fd, self.nbytes), dtype=torch.uint8)
        self._used = 0

    def view(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor of `shape` and `dtype` in the arena's next free bytes."""
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        start, self._used = self._used, _round_up(self._used + nbytes)
        if self._used > self.nbytes:
            raise RuntimeError(f"smp: staging arena of {self.nbytes} bytes overflowed")
        return self.bytes[start : start + nbytes].view(dtype).view(shape)

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() == self.bytes.data_ptr()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the mapping lives on while `bytes` (or a view) does
            self.fd = -1

    def __del__(self):
        self.close()


def arena_bytes(shapes: list[tuple[tuple, torch.dtype]]) -> int:
    """The arena size that holds tensors of these (shape, dtype)s, each aligned."""
    total = 0
    for shape, dtype in shapes:
        numel = 1
        for n in shape:
            numel *= n
        total = _round_up(total + numel * torch.empty((), dtype=dtype).element_size())
    return total


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class WriterProcess:
    """Runs `request.run()` in the writer process; `call` returns its result (or raises its
    error). One request at a time: the save thread waits for each."""

    def __init__(self):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        here = os.path.dirname(os.path.abspath(__file__))
        code = f"import sys; sys.path.insert(0, {here!r}); from writer_process import serve; serve()"
        self._process = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()  # the writer's end lives in the writer only: its death ends our recv
        self._sock = mine
        atexit.register(self.stop)

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return self._process.poll() is None

    def call(self, request, arena: Arena) -> tuple[Any, float]:
        """(what request.run() returned, the writer's processor seconds for it). Tensors in
        `request` that are views of `arena` travel as their place in it."""
        payload = io.BytesIO()
        _ArenaPickler(payload, arena).dump(request)
        try:
            socket.send_fds(self._sock, [_LENGTH.pack(payload.getbuffer().nbytes)], [arena.fd])
            self._sock.sendall(_LENGTH.pack(arena.nbytes))
            self._sock.sendall(payload.getbuffer())
            error, result, seconds = pickle.loads(_receive(self._sock))
        except (EOFError, OSError) as err:
            code = self._process.wait(timeout=10) if not self.alive() else None
            raise RuntimeError(
                f"smp: the checkpoint writer process (pid {self.pid}) died (exit code {code}); "
                "the next background save starts a new one"
            ) from err
        if error is not None:
            raise error
        return result, seconds

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._sock.close()  # the writer sees the end of its input and exits
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


@dataclasses.dataclass
class WriteFiles:
    """A request: write the tensor files of a DCP save plan, as `writer` (a plain
    torch.distributed.checkpoint.FileSystemWriter, set up for this save) would. `data`: each write
    item's tensor (a view of the arena) or bytes, by the item's index: what the save's planner
    resolved it to."""

    writer: Any
    plan: Any
    data: dict

    def run(self) -> list:
        return self.writer.write_data(self.plan, _Resolved(self.data)).wait()


class _Resolved:
    """What FileSystemWriter.write_data asks of a planner: each item's data."""

    def __init__(self, data: dict):
        self._data = data

    def resolve_data(self, item):
        return self._data[item.index]


class _ArenaPickler(pickle.Pickler):
    def __init__(self, file, arena: Arena):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._arena = arena

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor and self._arena.holds(obj):
            return (
                str(obj.dtype).removeprefix("torch."),
                obj.storage_offset(),
                tuple(obj.shape),
                obj.stride(),
            )
        return None


class _ArenaUnpickler(pickle.Unpickler):
    """Rebuilds each arena view as a tensor whose storage is exactly its own bytes of the mapping:
    DCP clones a tensor whose storage is larger than it (so torch.save does not write the whole
    storage), which views of one arena-wide storage would all be (a copy of the whole state)."""

    def __init__(self, file, mapping: mmap.mmap):
        super().__init__(file)
        self._mapping = mapping

    def persistent_load(self, pid):
        dtype, offset, shape, stride = pid
        dtype = getattr(torch, dtype)
        if any(n == 0 for n in shape):
            return torch.empty(shape, dtype=dtype)
        span = 1 + sum((n - 1) * step for n, step in zip(shape, stride, strict=True))
        size = torch.empty((), dtype=dtype).element_size()
        own = torch.frombuffer(self._mapping, dtype=dtype, count=span, offset=offset * size)
        return own.as_strided(shape, stride)

    def find_class(self, module: str, name: str):
        if module == "smp.state.writer_process":  # this file, imported here without the package
            return globals()[name]
        return super().find_class(module, name)


def _receive(sock: socket.socket) -> bytes:
    (length,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
    return _exactly(sock, length)


def _exactly(sock: socket.socket, n: int) -> bytes:
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the other end closed")
        got += k
    return bytes(buffer)


# --- the writer process --------------------------------------------------------------------


def _die_with(parent: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # the writer still ends at the end of its input, after its current request
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(1)


def serve() -> None:
    """The writer's loop: a request, its arena's descriptor; the reply. Ends with its input."""
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    _die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the training process; it stops us
    sock = socket.socket(fileno=fd)
    while True:
        try:
            header, fds, _, _ = socket.recv_fds(sock, _LENGTH.size, 1)
            if not header:
                return
            (length,) = _LENGTH.unpack(header + _exactly(sock, _LENGTH.size - len(header)))
            (size,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
            payload = _exactly(sock, length)
        except (EOFError, OSError):
            return
        # mapped for this request only: a mapping kept would hold the arena's memory after the
        # training process gave it back (release_staging)
        mapping = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        os.close(fds[0])
        start = time.process_time()
        try:
            request = _ArenaUnpickler(io.BytesIO(payload), mapping).load()
            reply = (None, request.run(), time.process_time() - start)
        except BaseException as err:  # handed to the save thread, which raises it in wait()
            reply = (err, None, time.process_time() - start)
        request = None  # (its tensors unmap `mapping` as they go)
        del mapping
        try:
            data = pickle.dumps(reply)
        except Exception:  # an error that does not pickle: its text does
            data = pickle.dumps((RuntimeError(f"{type(reply[0]).__name__}: {reply[0]}"), None, reply[2]))
        sock.sendall(_LENGTH.pack(len(data)) + data)
