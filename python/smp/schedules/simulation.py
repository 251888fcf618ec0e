"""The unit-time simulation of every rank's lowered list: where each action runs, and the proof
that the lists cannot deadlock.

Every F, B and W takes one slot; transfers take none: a rank posts the transfers that follow an
action at the end of that action's slot (and those before its first action at the start). An
action runs in the first slot after its rank's previous action in which every message it waits
for is complete: F(k) on stage s waits for the activations of the stages it reads, B(k) for the
gradients of the stages that read it and, on its rank's last stage, for the model outputs computed
on other ranks (read when the microbatch resumes after its forward); W for nothing (its own
stage's B is earlier in its list). What a stage reads from a stage of its own rank is handed over
in memory: its sender must be earlier in the list.

A message is complete once its send and its receive are both posted (tagged: matched by tag) or,
`serial`, once both are also at the head of their rank's single stream of operations, run in the
order posted (a backend that serializes everything: the strictest reading of NCCL, whose pairs'
communicators each keep their own order). Checked on the way: every message is sent and received
exactly once, each by the rank holding its stage; nothing is sent before its action computed it;
nothing is waited for before its receive is posted; serially, both ends of every pair post their
messages in the same order; and every message completes by the end.

Why this proves the real run cannot deadlock. Posting never blocks; a rank blocks only in an
action, waiting for a message, or at the step's end, waiting for its sends. If the simulation
completes, each action waits only for messages posted by its peers in strictly earlier slots (and
completed there). Run with any real durations, a stuck pipeline would have every stuck rank
waiting at an action whose message is posted by a stuck rank only after an action of a slot no
later than the waiter's own, so strictly earlier: slots would fall forever along that chain of
ranks, which a finite list cannot do.
"""

from __future__ import annotations

from collections import Counter, deque

from smp.schedules.actions import Action
from smp.schedules.transfers import SENDS, Layout, Transfer

Message = tuple[str, int, int, int]  # (letter, microbatch, sending stage, receiving stage)


def simulate(
    programs: list[tuple[Action | Transfer, ...]],
    stage_ranks: tuple[int, ...],
    layout: Layout,
    with_gradients: bool,
    serial: bool,
    name: str,
) -> list[list[Action | None]]:
    """Each rank's F, B and W in unit-time slots (None: idle); raises RuntimeError naming what is
    wrong if the lists break a rule or deadlock. `name` names the schedule in errors."""
    _check_matching(programs, stage_ranks, serial, name)
    run = _Run(programs, stage_ranks, layout, with_gradients, serial, name)
    return run.slots()


def _check_matching(programs, stage_ranks: tuple[int, ...], serial: bool, name: str) -> None:
    sent: Counter = Counter()
    received: Counter = Counter()
    pairs: dict[tuple[int, int], list[Message]] = {}  # (rank, peer rank) -> its messages, in order
    for rank, program in enumerate(programs):
        for x in program:
            if not isinstance(x, Transfer):
                continue
            if stage_ranks[x.stage] != rank or stage_ranks[x.peer] == rank:
                raise RuntimeError(f"smp: schedule {name!r}: rank {rank} holds {x}, not its own to post")
            (sent if x.kind in SENDS else received)[x.message] += 1
            pairs.setdefault((rank, stage_ranks[x.peer]), []).append(x.message)
    for what, counts in (("sent", sent), ("received", received)):
        twice = [m for m, n in counts.items() if n > 1]
        if twice:
            raise RuntimeError(f"smp: schedule {name!r}: messages {twice[:4]} are {what} more than once")
    if sent.keys() != received.keys():
        lonely = sorted(sent.keys() ^ received.keys())[:4]
        raise RuntimeError(f"smp: schedule {name!r}: messages {lonely} are sent or received, not both")
    if serial:
        for (a, b), messages in pairs.items():
            if messages != pairs.get((b, a)):
                raise RuntimeError(
                    f"smp: schedule {name!r}: ranks {a} and {b} post their messages in different orders "
                    "(an ordered path needs one)"
                )


class _Run:
    def __init__(self, programs, stage_ranks, layout: Layout, with_gradients: bool, serial: bool, name: str):
        self.programs, self.stage_ranks, self.layout = programs, stage_ranks, layout
        self.with_gradients, self.serial, self.name = with_gradients, serial, name
        ranks = range(len(programs))
        self.last_stage = [max(s for s, r in enumerate(stage_ranks) if r == rank) for rank in ranks]
        self.at = [0] * len(programs)  # each rank's next entry
        self.computed: set[tuple[str, int, int]] = set()
        self.sent: set[Message] = set()
        self.receiving: list[set[Message]] = [set() for _ in ranks]  # receives posted, per rank
        self.streams: list[deque] = [deque() for _ in ranks]  # serial: posted, not yet complete
        self.complete: set[Message] = set()

    def slots(self) -> list[list[Action | None]]:
        rows: list[list[Action | None]] = [[] for _ in self.programs]
        for rank in range(len(self.programs)):
            self._post(rank)  # what comes before its first action
        self._resolve()
        t = 0
        while any(at < len(p) for at, p in zip(self.at, self.programs, strict=True)):
            ran = []
            for rank, row in enumerate(rows):
                action = self._next_action(rank)
                ready = action is not None and self._ready(rank, action)
                row.append(action if ready else None)
                if ready:
                    ran.append(rank)
            for rank in ran:
                action = self.programs[rank][self.at[rank]]
                self.computed.add(tuple(action))
                self.at[rank] += 1
            for rank in ran:
                self._post(rank)  # at the end of the action's slot
            if not self._resolve() and not ran:
                raise RuntimeError(f"smp: schedule {self.name!r} deadlocks at slot {t}: {self._stuck()}")
            t += 1
        left = {m for m in self.sent if m not in self.complete}
        if left:
            raise RuntimeError(f"smp: schedule {self.name!r} leaves messages {sorted(left)[:4]} incomplete")
        for row in rows:  # a rank that is done is not idle
            while row and row[-1] is None:
                row.pop()
        return rows

    def _next_action(self, rank: int) -> Action | None:
        program = self.programs[rank]
        return program[self.at[rank]] if self.at[rank] < len(program) else None

    def _post(self, rank: int) -> None:
        program = self.programs[rank]
        while self.at[rank] < len(program) and isinstance(program[self.at[rank]], Transfer):
            x = program[self.at[rank]]
            message = x.message
            if x.kind in SENDS:
                letter, k, src, _ = message
                if ("B" if letter == "B" else "F", k, src) not in self.computed:
                    raise RuntimeError(f"smp: schedule {self.name!r}: rank {rank} sends {x} before computing")
                self.sent.add(message)
            else:
                self.receiving[rank].add(message)
            if self.serial:
                self.streams[rank].append(message)
            self.at[rank] += 1

    def _resolve(self) -> bool:
        """Completes what can complete now; whether anything did."""
        moved = False
        if not self.serial:
            for posted in self.receiving:
                for m in posted & self.sent:
                    if m not in self.complete:
                        self.complete.add(m)
                        moved = True
            return moved
        changed = True
        while changed:
            changed = False
            for rank, stream in enumerate(self.streams):
                if not stream:
                    continue
                m = stream[0]
                src_rank, dst_rank = self.stage_ranks[m[2]], self.stage_ranks[m[3]]
                peer = self.streams[dst_rank if src_rank == rank else src_rank]
                if peer and peer[0] == m:  # at the head of both ends' streams
                    stream.popleft()
                    peer.popleft()
                    self.complete.add(m)
                    changed = moved = True
        return moved

    def _waits(self, rank: int, action: Action) -> tuple[list[tuple[str, int, int]], list[Message]]:
        """What `action` waits for: actions of its own rank (handed over in memory), and messages."""
        kind, k, stage = action
        local, messages = [], []
        letters = ("F",) if kind == "F" else ("B",) if kind == "B" and self.with_gradients else ()
        for letter in letters:
            for src in self.layout.senders(letter, stage):
                if self.stage_ranks[src] == rank:
                    local.append((letter, k, src))
                else:
                    messages.append((letter, k, src, stage))
        if kind == "B" and stage == self.last_stage[rank]:
            outputs = [src for src in sorted(self.layout.outputs) if self.stage_ranks[src] != rank]
            messages += [("O", k, src, rank) for src in outputs]
        return local, messages

    def _ready(self, rank: int, action: Action) -> bool:
        local, messages = self._waits(rank, action)
        for needed in local:
            if needed not in self.computed:
                raise RuntimeError(
                    f"smp: schedule {self.name!r}: rank {rank} runs {action} before {needed}, which it reads "
                    "from a stage of its own rank"
                )
        for m in messages:
            if m not in self.receiving[rank]:
                raise RuntimeError(
                    f"smp: schedule {self.name!r}: rank {rank} waits for message {m} at {action} before "
                    "posting its receive"
                )
        return all(m in self.complete for m in messages)

    def _stuck(self) -> str:
        waiting = []
        for rank in range(len(self.programs)):
            action = self._next_action(rank)
            if action is not None:
                missing = [m for m in self._waits(rank, action)[1] if m not in self.complete]
                waiting.append(f"rank {rank} at {tuple(action)} waits for {missing}")
        return "; ".join(waiting)
