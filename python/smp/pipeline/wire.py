"""One pipeline rank's point-to-point operations on the pipeline group, for both message paths.

- tagged (the default for CPU tensors): each message tagged by (kind, microbatch, value), so it
  matches whatever order the ends post in; CUDA tensors are staged through host memory and travel
  over Gloo. The backend's own send and recv are called, as dist.isend and dist.irecv call them,
  without their per-call checks and rank lookup.
- ordered (the default for CUDA tensors, `ordered_messages: true` selects it on CPU): every
  message on one tag, matched by the order both ends post in (the lowered schedule's), as NCCL
  needs; CUDA tensors go GPU to GPU. One isend or irecv each, not batched: NCCL then runs a
  pair's operations on that pair's own communicator and stream, in issue order; a batch would run
  on the group's one stream, every operation of the rank queued behind the one before.

Shapes and dtypes come from the capture; no message carries metadata.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from smp import faults
from smp.passes import Value
from smp.pipeline.bundles import KIND_NAMES, Bundles
from smp.services import timeline


class Incoming:
    """A posted receive; wait() gives the tensor on the stage's device (once; later calls reuse it)."""

    def __init__(
        self,
        buffer: torch.Tensor,
        work: dist.Work,
        device: torch.device,
        context: Callable[[], tuple],
        timed: tuple[timeline.Recorder, int, dict] | None = None,
    ):
        self._buffer, self._work, self._device = buffer, work, device
        # faults.waiting's (operation, group, peer), made only if the wait fails (named then)
        self._context = context
        self._timed = timed  # with the timeline on: (recorder, post time, the event's fields)
        self._tensor: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._tensor is None:
            waited = timeline.now() if self._timed is not None else 0
            try:
                self._work.wait()
            except RuntimeError:  # a transport failure or timeout, named as faults.waiting names it
                with faults.waiting(*self._context()):
                    raise
            self._tensor = self._buffer.to(self._device)
            if self._timed is not None:
                recorder, posted, fields = self._timed
                recorder.record("recv", posted, timeline.now(), wait_start=waited, **fields)
        return self._tensor


class Wire:
    """`group_ranks`: each pipeline rank's global rank; `stage_ranks`: each stage's pipeline rank."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        group_ranks: list[int],
        stage_ranks: tuple[int, ...],
        rank: int,
        device: torch.device,
        ordered: bool,
    ):
        self.group, self.group_ranks, self.stage_ranks = group, group_ranks, stage_ranks
        self.rank, self.device, self.ordered = rank, device, ordered
        self._sends: list[dist.Work] = []
        self._connected: set[int] = set()  # ordered: peers whose pair communicator exists
        self._group_peer: tuple[int, ...] | None = None  # stage -> its rank inside `group`
        self._timeline = timeline.recorder()
        self._sending = timeline.Pending(self._timeline) if self._timeline is not None else None

    def group_name(self) -> str:
        return _group_name(tuple(self.group_ranks))

    def send(
        self, tensor: torch.Tensor, bundles: Bundles, src: int, dst: int, letter: str, k: int, name: str
    ):
        """Posts one message of stage `src` to stage `dst`; the step's end waits for it."""
        if self.ordered:
            self._sends.append(dist.isend(tensor, self.group_ranks[self.stage_ranks[dst]], self.group, tag=0))
            return
        tag = bundles.tag(letter, k, name)
        timed = self._timeline is not None and self._timeline.recording  # off: one test
        posted = timeline.now() if timed else 0
        try:  # the backend's send, as dist.isend calls it; fails at once if the peer has gone
            work = self.group.send([_wire(tensor.cpu())], self._peer(dst), tag)
        except RuntimeError:
            what = f"pipeline stage {src} sending {KIND_NAMES[letter]} {name!r} of microbatch {k}"
            peer = self.group_ranks[self.stage_ranks[dst]]
            with faults.waiting(f"{what} to stage {dst}", self.group_name(), peer):
                raise
        self._sends.append(work)
        if timed:
            self._sending.poll()
            fields = self._fields(src, dst, letter, k, name, tag, tensor)
            self._sending.add(work, "send", posted, **fields)

    def recv(self, value: Value, bundles: Bundles, src: int, dst: int, letter: str, k: int) -> Incoming:
        """Posts the receive of `value`'s `letter` message of microbatch k from stage `src` to `dst`."""
        peer = self.group_ranks[self.stage_ranks[src]]

        def context() -> tuple:  # made only when a wait fails
            what = f"pipeline stage {dst} receiving {KIND_NAMES[letter]} {value.name!r}"
            return (f"{what} of microbatch {k} from stage {src}", self.group_name(), peer)

        if self.ordered:
            buffer = torch.empty(value.shape, dtype=value.dtype, device=self.device)
            return Incoming(buffer, dist.irecv(buffer, peer, self.group, tag=0), self.device, context)
        buffer = torch.empty(value.shape, dtype=value.dtype)
        tag = bundles.tag(letter, k, value.name)
        recording = self._timeline is not None and self._timeline.recording  # off: one test
        posted = timeline.now() if recording else 0
        try:  # the backend's recv, as dist.irecv calls it
            work = self.group.recv([_wire(buffer)], self._peer(src), tag)
        except RuntimeError:
            with faults.waiting(*context()):
                raise
        timed = None
        if recording:
            self._sending.poll()
            timed = (self._timeline, posted, self._fields(dst, src, letter, k, value.name, tag, buffer))
        return Incoming(buffer, work, self.device, context, timed)

    def connect(self, peers: list[int]) -> None:
        """Ordered path, before a program's first message: one element to or from each new peer, in
        pair order (sorted peers: pairs (peer, rank) then (rank, peer)), each waited for. NCCL's
        creation of a pair communicator blocks until both ranks arrive: this creates them one at a
        time, in an order no two ranks can disagree on, before any stage waits on a message."""
        for peer in sorted(set(peers) - self._connected):
            token = torch.zeros(1, device=self.device)
            op = dist.isend if self.rank < peer else dist.irecv
            with faults.waiting(f"pipeline rank {self.rank} connecting to rank {peer}", self.group_name()):
                op(token, self.group_ranks[peer], self.group, tag=0).wait()
            self._connected.add(peer)

    def finish(self) -> None:
        """The step's end: waits for every send posted."""
        if self._sending is not None:
            self._sending.poll()
        with faults.waiting(f"pipeline rank {self.rank} completing its sends", self.group_name()):
            for work in self._sends:
                work.wait()
        if self._sending is not None:
            self._sending.close()
        self._sends = []

    def _peer(self, stage: int) -> int:
        """`stage`'s rank inside `group`, which the backend's send and recv take (made once)."""
        if self._group_peer is None:
            self._group_peer = tuple(
                dist.get_group_rank(self.group, self.group_ranks[r]) for r in self.stage_ranks
            )
        return self._group_peer[stage]

    def _fields(self, stage: int, peer: int, letter: str, k: int, name: str, tag: int, tensor: torch.Tensor):
        """What the timeline notes of a message (the same on both ends, so they can be paired)."""
        return {
            "microbatch": k,
            "stage": stage,
            "peer_stage": peer,
            "peer_rank": self.group_ranks[self.stage_ranks[peer]],
            "what": KIND_NAMES[letter],
            "value": name,
            "tag": tag,
            "bytes": tensor.numel() * tensor.element_size(),
        }


@functools.lru_cache(maxsize=64)
def _group_name(group_ranks: tuple[int, ...]) -> str:
    """How errors name a pipeline group (every wait on a message names it: built once)."""
    return faults.describe_group("pipeline", group_ranks)


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as the backend carries it (a complex one as its real view, as dist.isend does)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor
