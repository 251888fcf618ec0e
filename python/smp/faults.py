"""What happens when a rank dies or fails: every other rank raises within the group timeout, with
an error that says what it was waiting for, and exits.

- Waits on peers (pipeline messages, gradient buckets, the optimizer's publish, barriers) run
  inside `waiting(...)`, which turns a transport error or timeout into a CommunicationError
  naming the operation, the group, the peer when there is one, and what the rank that failed
  reported, if it did.
- A rank whose step fails for a reason of its own (a user's bug, a bad input) reports it in the
  default group's store before raising: the others, whose waits then fail, say "rank N failed:
  <its error>" rather than only "connection closed".
- An uncaught exception in a process with smp groups ends the process at once, after Python has
  printed the traceback (sys.excepthook): interpreter teardown would otherwise destroy process
  groups whose peers are gone, and may block there. The exit status is 1, as for any uncaught
  exception.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch.distributed as dist

from smp import attempt

_FAILED_KEY = f"smp/{attempt.prefix()}failed"  # (an earlier attempt's report is not this one's)
_installed = False
_rank: int | None = None
_timeout_seconds: float | None = None
_reported = threading.Event()


class CommunicationError(RuntimeError):
    """A wait on a peer failed: the peer died, failed, or did not answer within the group timeout."""


def install(rank: int, timeout_seconds: float) -> None:
    """Called by smp.init: remembers the rank and timeout, and makes uncaught exceptions end the process."""
    global _installed, _rank, _timeout_seconds
    _rank, _timeout_seconds = rank, timeout_seconds
    if _installed or hasattr(sys, "ps1") or sys.flags.interactive:
        return  # an interactive session survives its errors
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        if isinstance(value, Exception):
            report_failure(value)
        previous(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if isinstance(value, KeyboardInterrupt) else 1)  # a shell's status for Ctrl-C

    sys.excepthook = excepthook
    _installed = True


def report_failure(error: BaseException) -> None:
    """Tells the other ranks (through the store) that this rank failed, and why."""
    if _reported.is_set():
        return
    _reported.set()
    # The notes say when (smp.step adds the step), so a report a script survived reads as old.
    notes = "".join(f" ({note})" for note in getattr(error, "__notes__", ()))
    text = f"rank {_rank} failed: {type(error).__name__}: {str(error)[:500]}{notes[:300]}"
    with contextlib.suppress(Exception):  # the store may be gone (its host died): report nothing
        store = dist.distributed_c10d._get_default_store()
        # Only the first report stays: the root cause, not the failures it caused in other ranks.
        store.compare_set(_FAILED_KEY, "", text)


def _reported_failure() -> str | None:
    with contextlib.suppress(Exception):
        store = dist.distributed_c10d._get_default_store()
        if store.check([_FAILED_KEY]):
            return store.get(_FAILED_KEY).decode(errors="replace")
    return None


def describe_group(kind: str, ranks) -> str:
    return f"the {kind} group (global ranks {list(ranks)})"


def group_of(kind: str, group) -> str:
    """describe_group for a torch process group (None: the default group)."""
    with contextlib.suppress(Exception):
        return describe_group(kind, dist.get_process_group_ranks(group or dist.group.WORLD))
    return f"the {kind} group"


def _message(operation: str, group: str, peer: int | None, error: BaseException) -> str:
    culprit = _reported_failure()
    who = f"rank {peer}" if peer is not None else "a rank of that group"
    # Gloo says "Timed out waiting ..." on the rank whose wait expired, and "Application timeout
    # caused pair closure" on a rank whose pending operation shared that pair: both are timeouts.
    if culprit is None and any(word in str(error).lower() for word in ("timed out", "timeout")):
        culprit = (
            f"{who} did not answer within the group timeout ({_timeout_seconds:g} s): it hangs, died "
            "without closing its connections (a lost node), or is slower than the timeout allows"
        )
    elif culprit is None:
        culprit = f"{who} probably died (killed, out of memory or crashed): see its log"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    peer_part = f" with rank {peer}" if peer is not None else ""
    return (
        f"smp: rank {_rank}: {operation}{peer_part} in {group} failed: {culprit}. "
        f"(transport: {first_line[:300]}) The job cannot continue: restart it (from a checkpoint); "
        "if the peers are only slow, raise the group timeout ('timeout' in the config)"
    )


def is_transport_error(error: BaseException) -> bool:
    """Whether an error came from a collective or message of the smp backend (Gloo/NCCL inside)."""
    if isinstance(error, CommunicationError):
        return False
    return isinstance(error, dist.DistError) or (
        type(error) is RuntimeError and str(error).startswith("smp: ") and " on process group " in str(error)
    )


def communication_error(operation: str, group: str, error: BaseException) -> CommunicationError:
    return CommunicationError(_message(operation, group, None, error))


@contextlib.contextmanager
def waiting(operation: str, group: str, peer: int | None = None):
    """Runs a wait on peers; a failure of the transport becomes a CommunicationError with context."""
    try:
        yield
    except CommunicationError:
        raise
    except RuntimeError as error:  # DistBackendError, DistNetworkError and Gloo's timeouts
        raise CommunicationError(_message(operation, group, peer, error)) from error
