"""A pipeline's program built and run in one process, without smp.init, against the unsplit model.

Every other pipeline test launches several processes through smp.init. These run the same pieces in
this one process, with no process group at all: a model is captured (smp.passes.capture), cut into
two stages (smp.passes.manual_partition) and split (smp.passes.split), and both stages run on
pipeline rank 0 through smp.pipeline.rank_runtime.RankRuntime with stage_ranks=(0, 0). Every message
between the stages (activations forward, gradients backward) is then handed over in memory
(Messages.local) and never touches torch.distributed (the first test makes its isend and irecv fail).
Each test compares the model's outputs and every parameter's gradient, summed over several
microbatches, with a deep copy of the model run eagerly on the same microbatches.

- test_two_stages_in_one_process_match_the_unsplit_model: GPipe's order (every forward, then every
  backward) and 1F1B's, on a tiny GPT whose embedding is tied to its head (one parameter read on both
  stages) and on a model with a skip connection that also returns outputs of the first stage (the
  user's loss reads them through leaves standing for them, whose gradients the first stage's backward
  picks up). The messages handed over in memory are exactly those the split pipeline's values call for.
- test_split_backward_defers_weight_gradients_to_w: the split-backward variant (zero_bubble's B and
  W): after every B the first stage (whose inputs need no gradient) has computed no gradient yet and
  the second stage's linear weights none either, while its layer norms have theirs; after the W
  actions every gradient equals the unsplit model's.
- test_executor_runs_two_ranks_schedule_in_one_process: the executor (smp.engine.executor.run) with
  microbatch threads that pause between the stages, as the engine's forward and backward do, running
  a two-rank Schedule's actions merged into one list in the order of its unit-time slots (each action
  waits only for actions of strictly earlier slots, so that order is one a single process can run),
  for every one-stage-per-rank schedule kind.
- test_build_makes_a_program_that_runs_like_the_model: smp.engine.build.build with a hand-made Plan
  and a ParallelGroups holding no process group, for one pipeline rank. A Schedule of one rank has one
  stage, so this Program runs one stage (the two-stage tests above stay at the RankRuntime level);
  under "zero_bubble" build defers the weight gradients, and the Program's W actions compute them.
"""

from __future__ import annotations

import copy
import functools

import models
import pytest
import torch
import torch.distributed as dist
from smp import config as smp_config
from smp import passes
from smp.engine import executor
from smp.engine.build import build
from smp.engine.plan import Plan
from smp.groups import ParallelGroups
from smp.pipeline.bundles import Message
from smp.pipeline.rank_runtime import RankRuntime
from smp.schedules import KINDS, Schedule
from smp.services import microbatch
from smp.topology import Topology

CPU = torch.device("cpu")
M = 3  # microbatches per step
RTOL, ATOL = 1e-5, 1e-6


# --- the models, captured once per module; each test splits them afresh ---------------------


def _gpt_inputs(k: int) -> tuple:
    return (torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(k)),)


def _gpt_loss(out, args):
    return models.lm_loss(out, args[0])


def _skip_inputs(k: int) -> tuple:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 + k))
    return (x.requires_grad_(),)


def _skip_loss(out, args):
    final, middle, first = out
    return final.pow(2).sum() + 0.5 * middle.sum() + first.pow(2).mean()


# name -> (make the model, stage of each module, microbatch k's inputs, loss(outputs, inputs))
CASES = {
    # The embedding is tied to the head: one parameter, read on both stages.
    "gpt": (
        lambda: models.GPT(layers=2),
        {"tok": 0, "pos": 0, "blocks.0": 0, "blocks.1": 1, "ln_f": 1, "head": 1},
        _gpt_inputs,
        _gpt_loss,
    ),
    # The first layer's output skips to the last stage and is returned too, as is a middle layer's
    # (both computed on stage 0); the input requires grad.
    "skip": (
        lambda: models.LongSkip(layers=4, middle_outputs=True),
        {"inp": 0, "layers.0": 0, "layers.1": 0, "layers.2": 0, "layers.3": 1, "out": 1},
        _skip_inputs,
        _skip_loss,
    ),
}


@functools.cache
def _captured(name: str):
    """(model, its capture, the two-stage partition). The capture holds the model's own parameters;
    no test updates them, so a deep copy of the model (gradients cleared) is the reference."""
    make, module_stage, inputs, _ = CASES[name]
    torch.manual_seed(0)
    model = make()
    captured = passes.capture(model, inputs(0))
    partition = passes.manual_partition(captured.graph_module, 2, module_stage)
    return model, captured, partition


def _fresh(name: str, stages: int = 2):
    """(model with no gradients, its reference copy, a freshly split pipeline of `stages` stages)."""
    model, captured, partition = _captured(name)
    if stages != 2:
        partition = passes.manual_partition(captured.graph_module, stages, {})
    model.zero_grad(set_to_none=True)
    pipe = passes.split(captured, partition)
    assert len(pipe.stages) == stages
    return model, copy.deepcopy(model), pipe


def _copies(args: tuple) -> tuple:
    """The same inputs with gradients of their own (the reference must not share the runtime's)."""
    return tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)


def _reference(reference: torch.nn.Module, name: str) -> tuple[list, list]:
    """The unsplit model on every microbatch: its outputs and inputs, gradients summed over them."""
    _, _, inputs, loss_fn = CASES[name]
    outputs, args_used = [], []
    for k in range(M):
        args = _copies(inputs(k))
        out = reference(*args)
        loss_fn(out, args).backward()
        outputs.append(out)
        args_used.append(args)
    return outputs, args_used


def _assert_matches(model, reference, name, outputs, args_used) -> None:
    ref_outputs, ref_args = _reference(reference, name)
    for got, want in zip(outputs, ref_outputs, strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for got, want in zip(args_used, ref_args, strict=True):  # input gradients (the skip model's)
        for a, b in zip(got, want, strict=True):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=ATOL)
    params = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    assert params.keys() == ref_params.keys()
    for n, p in params.items():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, ref_params[n].grad, rtol=RTOL, atol=ATOL, msg=n)


class _RecordingMessages(dict):
    """Messages.local that remembers every message handed over in memory."""

    def __init__(self):
        super().__init__()
        self.sent: list[Message] = []

    def __setitem__(self, msg, tensor):
        self.sent.append(msg)
        super().__setitem__(msg, tensor)


def _refused(*args, **kwargs):
    raise AssertionError("a message between two stages of one rank went to torch.distributed")


def _runtime(pipe) -> RankRuntime:
    """Both stages on pipeline rank 0: no process group (group None), one global rank."""
    return RankRuntime(pipe, (0,) * len(pipe.stages), 0, None, [0], M, CPU)


def _expected_messages(pipe, k: int) -> set[Message]:
    """What the split's values say crosses between the stages in microbatch k: each value forward to
    every consumer, and its gradient back from each consumer when it requires grad."""
    expected = set()
    for value in pipe.values.values():
        for dst in value.consumers:
            expected.add(Message(value.src, dst, "F", k, value.name))
            if value.requires_grad:
                expected.add(Message(dst, value.src, "B", k, value.name))
    return expected


# --- two stages on one rank, RankRuntime directly ------------------------------------------


@pytest.mark.parametrize("order", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", list(CASES))
def test_two_stages_in_one_process_match_the_unsplit_model(name, order, monkeypatch):
    for point_to_point in ("isend", "irecv"):  # every message must stay in memory
        monkeypatch.setattr(dist, point_to_point, _refused)
    _, _, inputs, loss_fn = CASES[name]
    model, reference, pipe = _fresh(name)
    assert any(v.consumers for v in pipe.values.values())  # something crosses between the stages
    runtime = _runtime(pipe)
    assert [s.index for s in runtime.stages] == [0, 1]
    recorded = _RecordingMessages()
    runtime._messages.local = recorded
    steps = [("F", k) for k in range(M)] + [("B", k) for k in range(M)]
    if order == "1f1b":  # one microbatch ahead: F0 F1 B0 F2 B1 B2
        steps = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    pending, outputs, args_used = {}, [None] * M, [inputs(k) for k in range(M)]
    for kind, k in steps:
        if kind == "F":
            pending[k] = runtime.forward(k, args_used[k], {})
        else:
            outputs[k] = pending.pop(k).wait()
            loss = loss_fn(outputs[k], args_used[k])
            runtime.backward(k, [loss], [torch.ones_like(loss)])
    runtime.finish_step()
    assert not recorded  # every message handed over was taken
    assert len(recorded.sent) == len(set(recorded.sent))  # ... once
    assert set(recorded.sent) == set().union(*(_expected_messages(pipe, k) for k in range(M)))
    _assert_matches(model, reference, name, outputs, args_used)


def test_split_backward_defers_weight_gradients_to_w():
    name = "gpt"
    _, _, inputs, loss_fn = CASES[name]
    model, reference, pipe = _fresh(name)
    runtime = _runtime(pipe)
    runtime.defer_weight_gradients()
    args_used = [inputs(k) for k in range(M)]
    pending = [runtime.forward(k, args_used[k], {}) for k in range(M)]
    outputs = [p.wait() for p in pending]
    for k in range(M):
        loss = loss_fn(outputs[k], args_used[k])
        runtime.backward(k, [loss], [torch.ones_like(loss)], defer_weights=True)
    grads = {n: p.grad for n, p in model.named_parameters()}
    # Stage 0 receives nothing that needs a gradient: its whole backward waits for W.
    for n in ("pos.weight", "blocks.0.ln1.weight", "blocks.0.mlp.0.weight", "blocks.0.attn.qkv.weight"):
        assert grads[n] is None, n
    # Stage 1's linear weights wait for W; its layer norms' gradients come with B.
    for n in ("blocks.1.attn.qkv.weight", "blocks.1.mlp.0.weight", "blocks.1.mlp.2.bias"):
        assert grads[n] is None, n
    for n in ("blocks.1.ln1.weight", "blocks.1.ln2.bias", "ln_f.weight"):
        assert grads[n] is not None, n
    for k in range(M):
        runtime.backward_weights(k, 1)
        runtime.backward_weights(k, 0)
    runtime.finish_step()
    _assert_matches(model, reference, name, outputs, args_used)


# --- the executor and microbatch threads, two stages on one rank ----------------------------


class _MergedRanks:
    """A two-rank Schedule's actions as one rank's list, in the order of its unit-time slots."""

    num_ranks = 1

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        slots = schedule.slots()
        self._actions = [
            row[t]
            for t in range(max(map(len, slots)))
            for row in slots
            if t < len(row) and row[t] is not None
        ]

    def actions(self, rank: int):
        assert rank == 0
        return list(self._actions)


class _Engine:
    """What the executor asks of the engine, for one runtime; notes each gradient at its first W."""

    captures = True  # a pipeline: its microbatches pause between stages, on threads of their own

    def __init__(self, runtime: RankRuntime, model: torch.nn.Module):
        self.runtime, self.model = runtime, model
        self.before_first_w: dict[str, torch.Tensor | None] | None = None

    def start_step(self) -> None:
        pass

    def backward_weights(self, mb: microbatch.Microbatch, stage: int) -> None:
        if self.before_first_w is None:
            self.before_first_w = {n: p.grad for n, p in self.model.named_parameters()}
        self.runtime.backward_weights(mb.index, stage)

    def finish_step(self) -> None:
        self.runtime.finish_step()

    def abandon_step(self, error: BaseException) -> None:
        pass


def _step_function(runtime: RankRuntime, loss_fn, defer: bool):
    """The user's step as the engine runs it: the microbatch pauses between the rank's stages and at
    the end of its forward; the loss's backward resumes it."""

    def step(*args):
        mb = microbatch.current()
        pending = runtime.forward(mb.index, args, {}, between=mb.pause)
        mb.pause()
        out = pending.wait()
        loss = loss_fn(out, args)
        runtime.backward(mb.index, [loss], [torch.ones_like(loss)], defer, between=mb.pause)
        return out

    return step


def _run_step(schedule, runtime, model, name, defer: bool):
    _, _, inputs, loss_fn = CASES[name]
    engine = _Engine(runtime, model)
    step = _step_function(runtime, loss_fn, defer)
    args_used = [inputs(k) for k in range(M)]
    mbs = [microbatch.Microbatch(k, step, args_used[k], {}) for k in range(M)]
    executor.run(schedule, 0, mbs, engine, "step")
    assert all(mb.done for mb in mbs)
    return engine, [mb.result for mb in mbs], args_used


@pytest.mark.parametrize("kind", [k for k, v in KINDS.items() if v.stages_per_rank == 1])
def test_executor_runs_two_ranks_schedule_in_one_process(kind):
    name = "skip"
    model, reference, pipe = _fresh(name)
    two_ranks = Schedule(kind, 2, M, 2)
    merged = _MergedRanks(two_ranks)
    assert sorted(merged.actions(0)) == sorted(two_ranks.actions(0) + two_ranks.actions(1))
    runtime = _runtime(pipe)
    if two_ranks.splits_backward:
        runtime.defer_weight_gradients()
    engine, outputs, args_used = _run_step(merged, runtime, model, name, two_ranks.splits_backward)
    assert (engine.before_first_w is not None) == two_ranks.splits_backward
    _assert_matches(model, reference, name, outputs, args_used)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_executor_names_the_failed_action_and_unwinds_the_paused_microbatches(phase):
    """The turn passes from microbatch to microbatch without the scheduler in between: an error is
    still named by the action that raised it (microbatch 1's forward on stage 0, or its backward on
    stage 1, the first action it runs after its forward), every paused microbatch is unwound, and
    a fresh step runs on the pooled threads and matches the model."""
    name = "skip"
    model, _, pipe = _fresh(name)
    _, _, inputs, loss_fn = CASES[name]
    merged = _MergedRanks(Schedule("interleaved", 2, M, 2))
    runtime = _runtime(pipe)

    def step(*args):
        mb = microbatch.current()
        if mb.index == 1 and phase == "forward":
            raise ValueError("failed on purpose")
        pending = runtime.forward(mb.index, args, {}, between=mb.pause)
        mb.pause()
        if mb.index == 1:
            raise ValueError("failed on purpose")
        out = pending.wait()
        runtime.backward(mb.index, [loss_fn(out, args)], [torch.ones(())], False, between=mb.pause)
        return out

    mbs = [microbatch.Microbatch(k, step, inputs(k), {}) for k in range(M)]
    with pytest.raises(ValueError, match="failed on purpose") as caught:
        executor.run(merged, 0, mbs, _Engine(runtime, model), "step")
    where = (
        "pipeline stage 0, microbatch 1 (forward)"
        if phase == "forward"
        else "stage 1, microbatch 1 (backward)"
    )
    assert any(where in note for note in caught.value.__notes__), caught.value.__notes__
    assert all(mb.done for mb in mbs if mb.index <= 1)  # (the rest had not started, or were unwound)
    model, reference, pipe = _fresh(name)
    engine, outputs, args_used = _run_step(merged, _runtime(pipe), model, name, False)
    _assert_matches(model, reference, name, outputs, args_used)


# --- build(): a Program from a hand-made Plan -----------------------------------------------


def _groups() -> ParallelGroups:
    """One rank in every dimension; no process group (build never reaches one at pp = 1)."""
    return ParallelGroups(
        rank=0,
        topology=Topology(world_size=1, pp=1, tp=1),
        pp_rank=0,
        tp_rank=0,
        rdp_rank=0,
        pp=None,
        tp=None,
        dp=None,
        rdp=None,
        pp_ranks=(0,),
        tp_ranks=(0,),
        dp_ranks=(0,),
        rdp_ranks=(0,),
    )


@pytest.mark.parametrize("kind", ["interleaved", "zero_bubble"])
def test_build_makes_a_program_that_runs_like_the_model(kind, monkeypatch):
    for var in smp_config.ENV_VARS:  # the config is this test's alone
        monkeypatch.delenv(var, raising=False)
    name = "skip"
    model, reference, pipe = _fresh(name, stages=1)
    config = smp_config.parse({"microbatches": M, "pipeline": kind})
    schedule = config.schedule()
    assert schedule == Schedule(kind, 1, M, M)
    plan = Plan(schedule, 0, CPU, shard_specs={}, shared=(), stage_reads={}, grad_group=None)
    _, _, inputs, _ = CASES[name]
    program = build(plan, (), inputs(0), {}, None, config, _groups(), pipe=pipe)
    assert program.schedule is schedule
    assert [s.index for s in program.runtime.stages] == [0]
    assert program.checkpointed == {0: ()}
    engine, outputs, args_used = _run_step(
        program.schedule, program.runtime, model, name, program.schedule.splits_backward
    )
    if schedule.splits_backward:  # the one stage's backward waited for W (its input needs no
        # gradient sent anywhere): no gradient before the first W
        assert engine.before_first_w is not None
        assert all(g is None for g in engine.before_first_w.values()), engine.before_first_w
    else:
        assert engine.before_first_w is None
    _assert_matches(model, reference, name, outputs, args_used)
