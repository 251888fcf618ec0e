"""The executor: runs one step, this rank's actions of the lowered schedule in order.

Each microbatch is a thread that runs the user's step function (smp.services.microbatch); an F
or B action resumes it until it pauses (at the end of one stage's forward or backward), a W runs
the stage's deferred weight gradients, a transfer (at pp > 1: a send or a receive of the rank's
pipeline messages, smp.schedules.lowering) is run by the engine on whichever thread reaches it.
Which program a microbatch runs is decided inside the step function, when it calls the model (the
input signature is known only then), so the executor needs only the schedule and the engine's
step lifecycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from smp import faults
from smp.schedules import Action, Schedule
from smp.services import timeline
from smp.services.microbatch import Microbatch, Turns

if TYPE_CHECKING:  # the engine module imports nothing of this one
    from smp.engine.engine import Engine

_calls = [0]  # steps run in this process, to name the step that failed
_COMPUTE = frozenset("FBW")
_PHASES = {
    "F": "forward",
    "B": "backward",
    "W": "weight gradients",
    "SEND_F": "sending activations to stage",
    "SEND_O": "sending model outputs to stage",
    "SEND_B": "sending gradients to stage",
    "RECV_F": "receiving activations from stage",
    "RECV_O": "receiving model outputs from stage",
    "RECV_B": "receiving gradients from stage",
}


def run(
    schedule: Schedule, pp_rank: int, microbatches: list[Microbatch], engine: Engine | None, name: str
) -> None:
    """Runs the step: the engine's start, the actions, the engine's finish. `name` is the step
    function's, for errors. On an error every microbatch thread is unwound and the error names
    the step, stage and microbatch in flight."""
    _calls[0] += 1
    action = None
    recorder = timeline.recorder()
    if recorder is not None and not recorder.begin_step():
        recorder = None  # a step the timeline skips costs what an untimed one does
    # A model that runs whole never pauses a microbatch: each runs to its end at its F, here.
    inline = engine is None or not engine.captures
    if inline and recorder is None and schedule.num_ranks == 1:
        return _run_inline(microbatches, engine, pp_rank)
    actions = _actions(schedule, pp_rank, engine)
    pipelined = engine is not None and schedule.num_ranks > 1  # (only then are there transfers)
    transfer = engine.transfers(microbatches) if pipelined else None
    # With the timeline on, control comes back here after every action, to time it.
    turns = Turns(actions, microbatches, chain=recorder is None, transfer=transfer)
    position = 0
    try:
        if engine is not None:
            engine.start_step()
        while position < len(actions):
            action = actions[position]
            if action.kind not in _COMPUTE:
                turns.position = position
                transfer(action)
                position += 1
                continue
            mb = microbatches[action.microbatch]
            began = timeline.now() if recorder is not None else 0.0
            timed = action  # (with the timeline on nothing chains on: one F or B, then transfers)
            if action.kind == "W":
                if engine is not None:
                    engine.backward_weights(mb, action.stage)
            elif inline:
                mb.run_here()
            else:
                turns.run(position)  # and the transfers, F and B actions after it that chain on
                position = turns.position
                action = actions[position]
            if recorder is not None:
                recorder.record(
                    timed.kind, began, timeline.now(), microbatch=timed.microbatch, stage=timed.stage
                )
            if (
                action.kind == "F"
                and schedule.num_ranks > 1
                and microbatches[action.microbatch].forward_calls == 0
            ):
                raise RuntimeError(
                    f"smp.step: {name} returned without calling the DistributedModel on microbatch "
                    f"{action.microbatch}; with pipeline parallelism every rank must call model(...) once "
                    "per step"
                )
            position += 1
        if engine is not None:
            engine.finish_step()
        if recorder is not None and recorder.end_step():
            timeline.write()
    except BaseException as error:
        if action is not None and position < len(actions):  # the action whose microbatch failed:
            action = actions[max(position, turns.position)]  # (one that chained on, if it did)
        turns.abort()
        if engine is not None:
            engine.abandon_step(error)
        converted = _name_what_failed(error, action, pp_rank)
        if converted is not None:
            raise converted from error
        raise


def _actions(schedule: Schedule, pp_rank: int, engine: Engine | None) -> tuple:
    """This rank's actions for the step: with the transfers of its messages among them at pp > 1
    (the ordered or the tagged path; gradients only if the step starts with grad mode on)."""
    if schedule.num_ranks == 1 or engine is None:
        return tuple(schedule.actions(pp_rank))
    return schedule.program(pp_rank, engine.ordered_messages, torch.is_grad_enabled())


def _run_inline(microbatches: list[Microbatch], engine: Engine | None, pp_rank: int) -> None:
    """A step of a model that runs whole on one pipeline rank, untimed: its microbatches one after
    another, as any schedule orders a single stage's forwards (its B and W actions have nothing
    left to do there), with nothing per action on the host."""
    running = None  # the microbatch whose forward (its whole step function) is running
    try:
        if engine is not None:
            engine.start_step()
        for running in microbatches:
            running.run_here()
        running = None
        if engine is not None:
            engine.finish_step()
    except BaseException as error:
        if engine is not None:
            engine.abandon_step(error)
        action = Action("F", running.index, pp_rank) if running is not None else None
        converted = _name_what_failed(error, action, pp_rank)
        if converted is not None:
            raise converted from error
        raise


def _name_what_failed(error: BaseException, action: Action | None, pp_rank: int) -> BaseException | None:
    """Adds the step, stage and microbatch in flight to the error, and tells the other ranks (through
    the store) that this rank failed: their waits then say "rank N failed". A transport error from
    a collective inside the model (tensor parallelism's) becomes a CommunicationError to raise."""
    if not isinstance(error, Exception):  # KeyboardInterrupt, a microbatch's Aborted
        return None
    converted = None
    if faults.is_transport_error(error):
        converted = error = faults.communication_error(
            "a collective inside the model (tensor parallelism) or the pipeline",
            "one of this rank's groups",
            error,
        )
    stage = action.stage if action is not None else pp_rank
    where = f"step {_calls[0]} (this process's smp.step calls), pipeline stage {stage}"
    if action is not None:
        phase = _PHASES[action.kind]
        peer = f" {action.peer}" if action.kind not in _COMPUTE else ""
        where += f", microbatch {action.microbatch} ({phase}{peer})"
    error.add_note(f"smp: while running {where}")
    faults.report_failure(error)
    return converted
