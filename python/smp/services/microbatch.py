"""Microbatches as threads that take turns: the step function runs once per microbatch,
and a pipeline schedule decides when each one's forward and backward happen.

Only one microbatch thread (or the scheduler) runs at any time; control passes
explicitly, so execution is as deterministic as a single thread. A microbatch
pauses at the end of its model forward; its backward action resumes it. A pausing
microbatch hands the turn straight to the next action's microbatch (Turns).

The threads are pooled across steps: a fresh thread per microbatch gets a fresh
malloc arena, and first-touching its pages every step costs more than the step's
communication on CPU.
"""

from __future__ import annotations

import _thread
import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

_local = threading.local()
_COMPUTE = frozenset("FBW")  # the actions that are no transfer of a lowered schedule


class Aborted(BaseException):
    """Raised inside paused microbatches when the step fails elsewhere, to unwind their threads."""


def current() -> Microbatch | None:
    return getattr(_local, "microbatch", None)


def _held_lock() -> _thread.LockType:
    """A lock that starts held: release() lets one acquire() through (a binary semaphore). The
    hand-overs between the scheduler and a microbatch use these plain locks: threading.Semaphore
    and Event are Python-level conditions that allocate a waiter lock on every wait (their round
    trips cost more CPU: docs/benchmarks.md, "Host overhead")."""
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


class Turns:
    """One step's microbatches taking turns through this rank's actions (smp.engine.executor).

    The scheduler's thread runs an F or B action by waking its microbatch's thread; when that
    microbatch pauses (or finishes its backward), its thread runs the transfers that follow (a
    lowered schedule's sends and receives, through `transfer`) and, if the next action is another
    F or B, hands the turn straight to that action's microbatch (chaining), or just goes on if it
    is its own: one thread wake per action instead of two (the scheduler's, then the
    microbatch's), and none between a microbatch's F and B on the last stage. Control comes back to
    the scheduler at a W (run on its thread), at the end of the actions, after a microbatch that
    finished during its F (the scheduler checks it called the model), after an error, and after
    every action when `chain` is off (the timeline times each action there).

    The threads start with the scheduler thread's grad mode, autocast, CUDA device and stream,
    which are per thread, taken here (W and the step's end run on that thread: one stream for all).
    """

    def __init__(
        self,
        actions: Sequence[Any],
        microbatches: list[Microbatch],
        chain: bool,
        transfer: Callable[[Any], None] | None = None,
    ):
        self.actions = actions
        self.position = -1  # the action running, or that ran last
        self._microbatches = microbatches
        self._chain = chain
        self.transfer = transfer
        self._back = _held_lock()  # released when control comes back to the scheduler
        self._error: BaseException | None = None
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = [
            (device, torch.get_autocast_dtype(device))
            for device in ("cpu", "cuda")
            if torch.is_autocast_enabled(device)
        ]
        self.device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self.stream = torch.cuda.current_stream() if self.device is not None else None
        for mb in microbatches:
            mb._turns = self

    def run(self, position: int) -> None:
        """Runs action `position` (an F or B) on its microbatch's thread and, chained, the F and B
        actions after it, until control comes back; self.position is then the last one run. The
        error of a microbatch that failed is raised here."""
        self.position = position
        mb = self._microbatches[self.actions[position].microbatch]
        if mb.done:
            return
        mb._wake()
        self._back.acquire()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def abort(self) -> None:
        """Unwinds every paused microbatch (each hands control back here at its end). One still
        running (the step was interrupted while it waited on a message) is left to its daemon
        thread: waiting for it could hang."""
        self._chain = False
        for mb in self._microbatches:
            if mb._unwind():
                self._back.acquire()
                self._error = None
                mb._wait_finished()

    def run_transfers(self) -> None:
        """Runs the transfers that follow the current action, on this thread; self.position is then
        the last one run."""
        actions, position = self.actions, self.position + 1
        while position < len(actions) and actions[position].kind not in _COMPUTE:
            self.position = position
            self.transfer(actions[position])
            position += 1

    def _hand_on(self, finished: bool) -> Microbatch | None:
        """The microbatch to run next when the running one pauses or (`finished`) ends, after the
        transfers that follow its action: the next action's, if it may run there; None to hand
        control back to the scheduler (also if a transfer failed: the scheduler raises it)."""
        if finished and self.actions[self.position].kind == "F":
            return None
        try:
            self.run_transfers()
        except BaseException as error:
            self._failed(error)
            return None
        position = self.position + 1
        if not self._chain or position >= len(self.actions):
            return None
        action = self.actions[position]
        if action.kind == "W":
            return None
        mb = self._microbatches[action.microbatch]
        if mb.done:
            return None
        self.position = position
        return mb

    def _hand_back(self) -> None:
        self._back.release()

    def _failed(self, error: BaseException) -> None:
        self._error = error


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
        self._turns: Turns | None = None  # set by the step's Turns
        self._aborted = False
        self._paused = False
        self._started = False
        self._inline = False  # run on the caller's thread (run_here)

    def _wake(self) -> None:
        """Lets this microbatch's thread run (made on its first turn) until it pauses or ends."""
        if not self._started:
            self._started = True
            # Binary semaphores: at most one release is outstanding on each (control alternates).
            self._turn = _held_lock()
            self._finished = _held_lock()  # released once the step function has returned
            _Worker.run(self._main)
        self._turn.release()

    def run_here(self) -> None:
        """Runs the step function to its end on the calling thread, for a model that never pauses
        (one that runs whole). The step then keeps the caller's thread: no hand-off to a worker,
        and no second OpenMP team whose idle threads spin against the caller's on a CPU (which
        slowed the step: docs/benchmarks.md, "Host overhead"). Errors propagate as they are."""
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

    def action_done(self) -> None:
        """The running action has computed what it sends (called on its thread): the transfers the
        schedule places after it run now, not when the step function pauses or returns."""
        if self._turns is not None and not self._inline:
            self._turns.run_transfers()

    def pause(self) -> None:
        """Ends this microbatch's action (called on its thread): the turn goes to the next action's
        microbatch, or back to the scheduler, until its own next action."""
        if self._inline:
            raise RuntimeError("smp: a microbatch run on the caller's thread cannot pause (a bug in smp)")
        turns = self._turns
        following = turns._hand_on(finished=False)
        if following is self:
            return  # its own next action: no hand-off
        self._paused = True
        if following is None:
            turns._hand_back()
        else:
            following._wake()
        self._turn.acquire()
        self._paused = False
        if self._aborted:
            raise Aborted()

    def _unwind(self) -> bool:
        """Marks the microbatch aborted and, if paused, wakes it to raise Aborted (True then)."""
        self._aborted = True
        if self._paused:
            self._turn.release()
        return self._paused

    def _wait_finished(self) -> None:
        if self._finished.acquire(timeout=5):
            self._finished.release()  # (stays released: the microbatch is finished)

    def _main(self) -> None:
        self._turn.acquire()
        _local.microbatch = self
        turns = self._turns
        returned = False
        try:
            if self._aborted:
                raise Aborted()
            if turns.device is not None:
                torch.cuda.set_device(turns.device)
            with contextlib.ExitStack() as modes:
                modes.enter_context(torch.set_grad_enabled(turns.grad_enabled))
                for device, dtype in turns.autocast:
                    modes.enter_context(torch.autocast(device, dtype=dtype))
                if turns.stream is not None:
                    modes.enter_context(torch.cuda.stream(turns.stream))
                self.result = self._fn(*self._args, **self._kwargs)
            returned = True
        except Aborted:
            pass
        except BaseException as error:  # handed to the scheduler thread, which raises it
            turns._failed(error)
        finally:
            self.done = True  # (before the hand-on: its own later actions have nothing left to run)
            _local.microbatch = None
            self._finished.release()
            following = turns._hand_on(finished=True) if returned else None
            if following is None:
                turns._hand_back()
            else:
                following._wake()  # (this thread then only returns to the pool)
