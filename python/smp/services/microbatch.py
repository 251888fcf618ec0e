"""Microbatches as threads that take turns: the step function runs once per microbatch,
and a pipeline schedule decides when each one's forward and backward happen.

Only one microbatch thread (or the scheduler) runs at any time; control passes
explicitly, so execution is as deterministic as a single thread. A microbatch
pauses at the end of its model forward; the scheduler resumes it for its backward.

The threads are pooled across steps: a fresh thread per microbatch gets a fresh
malloc arena, and first-touching its pages every step costs more than the step's
communication on CPU.
"""

from __future__ import annotations

import _thread
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

_local = threading.local()


class Aborted(BaseException):
    """Raised inside paused microbatches when the step fails elsewhere, to unwind their threads."""


def current() -> Microbatch | None:
    return getattr(_local, "microbatch", None)


def _held_lock() -> _thread.LockType:
    """A lock that starts held: release() lets one acquire() through (a binary semaphore). The
    hand-overs between the scheduler and a microbatch use these plain locks: threading.Semaphore
    and Event are Python-level conditions that allocate a waiter lock on every wait (measured, a
    resume + pause round trip: 16-46 us of CPU with Semaphores, 12-15 us with plain locks)."""
    lock = _thread.allocate_lock()
    lock.acquire()
    return lock


class _Worker:
    """A daemon thread that runs one job at a time and then offers itself for the next."""

    _idle: list[_Worker] = []
    _lock = threading.Lock()
    _generation = 0

    def __init__(self):
        self._job: Callable[[], None] | None = None
        self._ready = _held_lock()
        threading.Thread(target=self._loop, name="smp-microbatch", daemon=True).start()

    @classmethod
    def run(cls, job: Callable[[], None]) -> None:
        with cls._lock:
            worker = cls._idle.pop() if cls._idle else None
        worker = worker or cls()
        worker._job = job
        worker._ready.release()

    @classmethod
    def retire_all(cls) -> None:
        """Idle workers end; busy ones end after their job. A thread keeps thread-local state
        (torch's DTensor layout caches, which name process groups): after smp is reset, its
        next jobs run on new threads."""
        with cls._lock:
            idle, cls._idle = cls._idle, []
            cls._generation += 1
        for worker in idle:
            worker._ready.release()  # with no job: the thread ends

    def _loop(self) -> None:
        generation = self._generation
        while True:
            self._ready.acquire()
            job, self._job = self._job, None
            if job is None:
                return
            job()
            with self._lock:
                if generation != _Worker._generation:
                    return
                self._idle.append(self)


def retire_threads() -> None:
    """Later microbatches run on new threads (smp.parallel_state.reset calls it)."""
    _Worker.retire_all()


class Microbatch:
    def __init__(
        self,
        index: int,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        batch_size: int | None = None,
        guard_backward: bool = True,
    ):
        self.index = index
        self.batch_size = batch_size  # rows of the split tensor arguments (None if none is split)
        # Whether its model outputs refuse a backward that skips model.backward (smp.engine.inputs).
        self.guard_backward = guard_backward
        self.forward_calls = 0
        self.backward_calls = 0
        self.result: Any = None
        self.runtime: Any = None  # the pipeline stage runtime its forward used (train or eval graph)
        self.done = False
        self._fn, self._args, self._kwargs = fn, args, kwargs
        self._error: BaseException | None = None
        self._aborted = False
        self._paused = False
        self._started = False
        self._inline = False  # run on the caller's thread (run_here)

    def _start_thread(self) -> None:
        """The hand-over state, made when the microbatch first runs on a worker thread. The thread
        starts with the caller's grad mode, autocast, CUDA device and stream, which are per thread
        (W and the step's end run on the caller's thread: one stream for all)."""
        # Binary semaphores: at most one release is outstanding on each (control alternates).
        self._turn = _held_lock()
        self._back = _held_lock()
        self._finished = _held_lock()  # released once the step function has returned
        self._grad_enabled = torch.is_grad_enabled()
        self._autocast = [
            (device, torch.get_autocast_dtype(device))
            for device in ("cpu", "cuda")
            if torch.is_autocast_enabled(device)
        ]
        self._device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._stream = torch.cuda.current_stream() if self._device is not None else None
        _Worker.run(self._main)

    def resume(self) -> None:
        """Runs this microbatch until it pauses or finishes (called by the scheduler)."""
        if self.done:
            return
        if not self._started:
            self._started = True
            self._start_thread()
        self._turn.release()
        self._back.acquire()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def run_here(self) -> None:
        """Runs the step function to its end on the calling thread, for a model that never pauses
        (one that runs whole). The step then keeps the caller's thread: no hand-off to a worker,
        and no second OpenMP team whose idle threads spin against the caller's on a CPU (measured:
        a step of a small model 3-14 % slower on a worker thread). Errors propagate as they are."""
        if self.done:
            return
        self._started = self._inline = True
        outer = getattr(_local, "microbatch", None)
        _local.microbatch = self
        try:
            self.result = self._fn(*self._args, **self._kwargs)
        finally:
            self.done = True
            _local.microbatch = outer

    def pause(self) -> None:
        """Hands control back to the scheduler until resume() (called on this microbatch's thread)."""
        if self._inline:
            raise RuntimeError("smp: a microbatch run on the caller's thread cannot pause (a bug in smp)")
        self._paused = True
        self._back.release()
        self._turn.acquire()
        self._paused = False
        if self._aborted:
            raise Aborted()

    def abort(self) -> None:
        """Unwinds a paused microbatch. One still running (the step was interrupted while it waited
        on a message) is left to its daemon thread: waiting for it could hang."""
        self._aborted = True
        if self._paused:
            self._turn.release()
            self._back.acquire()
            self._error = None
            if self._finished.acquire(timeout=5):
                self._finished.release()  # (stays released: the microbatch is finished)

    def _main(self) -> None:
        self._turn.acquire()
        _local.microbatch = self
        try:
            if self._aborted:
                raise Aborted()
            if self._device is not None:
                torch.cuda.set_device(self._device)
            with contextlib.ExitStack() as modes:
                modes.enter_context(torch.set_grad_enabled(self._grad_enabled))
                for device, dtype in self._autocast:
                    modes.enter_context(torch.autocast(device, dtype=dtype))
                if self._stream is not None:
                    modes.enter_context(torch.cuda.stream(self._stream))
                self.result = self._fn(*self._args, **self._kwargs)
        except Aborted:
            pass
        except BaseException as error:  # handed to the scheduler thread, which raises it
            self._error = error
        finally:
            self.done = True
            _local.microbatch = None
            self._finished.release()
            self._back.release()
