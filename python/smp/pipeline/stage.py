"""One rank's part of a pipeline: its stage module, and the activations and gradients it
exchanges with the other stages of its pipeline group, one microbatch at a time.

Messages are point-to-point on the pipeline group. Shapes and dtypes come from the
capture; no message carries metadata and no stage waits on a shape. Two paths:

- tagged (the default for CPU tensors): each message tagged by (kind, microbatch,
  value), so it matches whatever order the stages post them in; CUDA tensors are
  staged through host memory and travel over Gloo.
- ordered (the default for CUDA tensors, `ordered_messages: true` selects it on CPU):
  every message on one tag, posted by both ends in one order derived from the schedule
  (smp.pipeline.message_order), as NCCL needs: it matches by issue order, not by tag.
  CUDA tensors then go GPU to GPU with no host copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist

from smp import faults
from smp.passes import PipelineGraph, Value
from smp.pipeline import activation_meter, message_order, split_backward, timeline

_ACTIVATION, _OUTPUT, _GRADIENT = range(3)
_KIND_NAMES = ("activation", "output", "gradient")


class _Incoming:
    """A posted receive; wait() gives the tensor on the stage's device (once; later calls reuse it)."""

    def __init__(
        self,
        buffer: torch.Tensor,
        work: dist.Work,
        device: torch.device,
        context: tuple = (),
        timed: tuple[timeline.Recorder, int, dict] | None = None,
    ):
        self._buffer, self._work, self._device = buffer, work, device
        self._context = context  # faults.waiting's (operation, group, peer): named if the peer fails
        self._timed = timed  # with the timeline on: (recorder, post time, the event's fields)
        self._tensor: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._tensor is None:
            waited = timeline.now() if self._timed is not None else 0
            with faults.waiting(*self._context):
                got = self._work.wait()
            self._tensor = (self._buffer if self._buffer is not None else got).to(self._device)
            if self._timed is not None:
                recorder, posted, fields = self._timed
                recorder.record("recv", posted, timeline.now(), wait_start=waited, **fields)
        return self._tensor


class _OrderedWork:
    """A receive on the ordered path: wait() posts its group if need be and gives the tensor."""

    def __init__(self, channels: message_order.OrderedChannels, msg: message_order.Message):
        self._channels, self._msg = channels, msg

    def wait(self) -> torch.Tensor:
        return self._channels.wait(self._msg)


_warned_host_staging: list[bool] = []  # a CUDA pipeline on the tagged path says so once


@dataclasses.dataclass
class _InFlight:
    received: dict[str, torch.Tensor]  # leaves standing for values of earlier stages
    produced: dict[str, torch.Tensor]


class PendingOutputs:
    """The model's return value for one microbatch; outputs of other stages arrive by wait().

    Those copies do not require grad: their gradient flows on the stage that computed them,
    so a loss computed from them here needs no backward.
    """

    def __init__(self, pipe: PipelineGraph, leaves: list[Any], incoming: list[tuple[int, _Incoming]]):
        self._pipe, self._leaves, self._incoming = pipe, leaves, incoming

    def wait(self) -> Any:
        for position, message in self._incoming:
            self._leaves[position] = message.wait()
        return self._pipe.unflatten_outputs(self._leaves)


class StageRuntime:
    def __init__(
        self,
        pipe: PipelineGraph,
        stage: int,
        group: dist.ProcessGroup,
        group_ranks: list[int],
        microbatches: int,
        device: torch.device,
    ):
        self.pipe = pipe
        self.stage = pipe.stages[stage]
        self.index = stage
        self._group = group
        self._ranks = group_ranks
        self._microbatches = microbatches
        self._device = device
        self._value_id = {name: i for i, name in enumerate(sorted(pipe.values))}
        self._sends: list[dist.Work] = []
        self._in_flight: dict[int, _InFlight] = {}
        self._deferred: dict[int, split_backward.WeightGradients] = {}
        self._weights = [p for p in self.stage.module.parameters() if p.requires_grad]
        self._deferrable: set[int] | None = None  # zero_bubble: ids of the weights W computes
        self._ordered: message_order.OrderedChannels | None = None
        self._input_meta = [
            (i, n.meta["val"].shape, n.meta["val"].dtype)
            for i, n in enumerate(n for n in _placeholders(pipe))
            if isinstance(n.meta.get("val"), torch.Tensor)
        ]
        self.meter: activation_meter.SavedActivationMeter | None = None
        self._timeline = timeline.recorder()
        self._sending = timeline.Pending(self._timeline) if self._timeline is not None else None

    def order_messages(self, ordered: bool | None, slots) -> None:
        """Chooses the message path (None: ordered for CUDA tensors, tagged for CPU ones); `slots`
        is the schedule's unit_time_slots, from which the ordered path derives its order."""
        if ordered is None:
            ordered = self._device.type == "cuda"
        if ordered:
            self._ordered = message_order.OrderedChannels(
                self.pipe, self.index, self._ranks, self._group, self._device, slots
            )
        elif self._device.type == "cuda" and not _warned_host_staging:
            _warned_host_staging.append(True)
            warnings.warn(
                "smp: pipeline activations on CUDA are staged through host memory and sent over Gloo "
                "(ordered_messages is false); set it to true (or leave it unset) to send them GPU to "
                "GPU over NCCL",
                stacklevel=2,
            )

    def defer_weight_gradients(self) -> None:
        """For zero_bubble: rewrites the stage graph so that its backward can leave the linear
        layers' weight gradients to W (smp.pipeline.split_backward). Not rewritten: a stage whose
        inputs need no gradient (the first), which has nothing to send at B and runs its whole
        backward at W; a compiled stage, whose backward runs whole at B."""
        if self._deferrable is None:
            module = self.stage.module
            sends_gradients = any(self.pipe.values[name].requires_grad for name in self.stage.received)
            rewrite = isinstance(module, torch.fx.GraphModule) and sends_gradients
            self._deferrable = split_backward.defer_weight_gradients(module) if rewrite else set()

    # --- forward ------------------------------------------------------------

    def forward(self, k: int, args: tuple, kwargs: dict) -> PendingOutputs:
        flat = self.pipe.captured.flatten_inputs(args, kwargs)
        self._check_inputs(flat)
        if self._ordered is not None and not self._ordered.started:
            self._ordered.start(with_gradients=torch.is_grad_enabled())
        values = self.pipe.values
        incoming = {
            name: self._recv(values[name], values[name].src, _ACTIVATION, k) for name in self.stage.received
        }
        received = {
            name: message.wait().requires_grad_(values[name].requires_grad)
            for name, message in incoming.items()
        }
        stage_inputs = [self._to_device(flat[i]) for i in self.stage.inputs]
        stage_inputs += [received[name] for name in self.stage.received]
        with contextlib.ExitStack() as scope:
            grad_mode = torch.autograd.set_grad_enabled(torch.is_grad_enabled())  # graphs may switch it
            scope.enter_context(grad_mode)
            if self.meter is not None:
                scope.enter_context(self.meter.track())
            if self._deferrable:
                self._deferred[k] = split_backward.WeightGradients(self.meter)
                scope.enter_context(split_backward.collecting(self._deferred[k]))
            results = self.stage.module(*stage_inputs)
        produced = dict(zip(self.stage.produced, results, strict=True))
        for name, tensor in produced.items():
            value = values[name]
            _check_sendable(name, tensor, self.index)
            data = tensor.detach().contiguous()
            for dst in value.consumers:
                self._send(data, dst, _ACTIVATION, k, name)
            if value.is_output:
                for dst in range(len(self._ranks)):
                    if dst != self.index:
                        self._send(data, dst, _OUTPUT, k, name)
        leaves, outputs, incoming = [], [], {}
        for position, leaf in enumerate(self.pipe.outputs):
            if leaf.kind == "const":
                leaves.append(leaf.ref)
            elif leaf.kind == "input":
                leaves.append(flat[leaf.ref])
            elif values[leaf.ref].src == self.index:
                leaves.append(produced[leaf.ref])
            else:
                value = values[leaf.ref]
                leaves.append(None)
                if leaf.ref not in incoming:  # a value returned twice arrives once
                    incoming[leaf.ref] = self._recv(value, value.src, _OUTPUT, k)
                outputs.append((position, incoming[leaf.ref]))
        if self._ordered is not None:
            self._flush_ordered(k)
        self._in_flight[k] = _InFlight(received, produced)
        return PendingOutputs(self.pipe, leaves, outputs)

    # --- backward -----------------------------------------------------------

    def backward(
        self,
        k: int,
        tensors: list[torch.Tensor],
        grads: list[torch.Tensor | None],
        defer_weights: bool = False,
    ) -> None:
        """Backward of microbatch k from the user's loss(es) and the gradients later stages send;
        with defer_weights, only the input gradients (backward_weights(k) does the rest)."""
        state = self._in_flight.pop(k)
        values = self.pipe.values
        roots, root_grads = [], []
        for t, g in zip(tensors, grads, strict=True):
            if t.requires_grad:
                roots.append(t)
                root_grads.append(g)
        incoming = [
            (name, self._recv(values[name], src, _GRADIENT, k))
            for name in self.stage.produced
            if values[name].requires_grad
            for src in values[name].consumers
        ]
        summed: dict[str, torch.Tensor] = {}
        for name, message in incoming:
            grad = message.wait()
            summed[name] = grad if name not in summed else summed[name] + grad
        for name, grad in summed.items():
            tensor = state.produced[name]
            if tensor.requires_grad:
                roots.append(tensor)
                root_grads.append(grad)
        leaves = [state.received[name] for name in self.stage.received]
        if defer_weights:  # zero_bubble's B: input gradients now, weight gradients at W
            store = self._deferred.setdefault(k, split_backward.WeightGradients(self.meter))
            now = [w for w in self._weights if id(w) not in (self._deferrable or ())]
            input_grads = split_backward.backward_inputs(roots, root_grads, leaves, now, store)
        else:
            if roots:
                torch.autograd.backward(roots, root_grads)
            input_grads = [leaf.grad for leaf in leaves]
        for name, leaf, grad in zip(self.stage.received, leaves, input_grads, strict=True):
            value = values[name]
            if value.requires_grad:
                grad = grad if grad is not None else torch.zeros_like(leaf)
                self._send(grad.contiguous(), value.src, _GRADIENT, k, name)
        if self._ordered is not None:
            self._flush_ordered(k)

    def _flush_ordered(self, k: int) -> None:
        """Posts the ordered path's groups that this action's sends complete."""
        with faults.waiting(
            f"pipeline stage {self.index} posting the messages of microbatch {k}", self._group_name()
        ):
            self._ordered.flush()

    def backward_weights(self, k: int) -> None:
        """zero_bubble's W: the weight gradients microbatch k's backward deferred (if any)."""
        deferred = self._deferred.pop(k, None)
        if deferred is not None:
            deferred.run()

    def produced(self, k: int) -> dict[str, torch.Tensor]:
        """The values this stage computed in microbatch k's forward (until its backward)."""
        return self._in_flight[k].produced

    def finish_step(self) -> None:
        if self._sending is not None:
            self._sending.poll()
        if self._ordered is not None:
            self._sends += self._ordered.finish_step()
        with faults.waiting(f"pipeline stage {self.index} completing its sends", self._group_name()):
            for work in self._sends:
                work.wait()
        if self._sending is not None:
            self._sending.close()
        self._sends = []
        self._in_flight.clear()
        self._deferred.clear()

    # --- messages -----------------------------------------------------------

    def _tag(self, kind: int, k: int, name: str) -> int:
        return (kind * self._microbatches + k) * len(self._value_id) + self._value_id[name]

    def _send(self, tensor: torch.Tensor, dst_stage: int, kind: int, k: int, name: str) -> None:
        if self._ordered is not None:  # posted with its group at the action's end (flush)
            self._ordered.send(message_order.Message(self.index, dst_stage, kind, k, name), tensor)
            return
        tag = self._tag(kind, k, name)
        timed = self._timeline is not None and self._timeline.recording  # off: one test
        posted = timeline.now() if timed else 0
        # Posting fails at once if the peer has already gone (its connection closed): named too.
        what = f"pipeline stage {self.index} sending {_KIND_NAMES[kind]} {name!r} of microbatch {k}"
        with faults.waiting(f"{what} to stage {dst_stage}", self._group_name(), self._ranks[dst_stage]):
            work = dist.isend(tensor.cpu(), dst=self._ranks[dst_stage], group=self._group, tag=tag)
        self._sends.append(work)
        if timed:
            self._sending.poll()
            fields = self._message_fields(dst_stage, kind, k, name, tag, tensor)
            self._sending.add(work, "send", posted, **fields)

    def _recv(self, value: Value, src_stage: int, kind: int, k: int) -> _Incoming:
        what = f"pipeline stage {self.index} receiving {_KIND_NAMES[kind]} {value.name!r} of microbatch {k}"
        context = (f"{what} from stage {src_stage}", self._group_name(), self._ranks[src_stage])
        if self._ordered is not None:  # posted when its group's turn comes (at the latest on wait)
            msg = message_order.Message(src_stage, self.index, kind, k, value.name)
            return _Incoming(None, _OrderedWork(self._ordered, msg), self._device, context)
        buffer = torch.empty(value.shape, dtype=value.dtype)
        tag = self._tag(kind, k, value.name)
        recording = self._timeline is not None and self._timeline.recording  # off: one test
        posted = timeline.now() if recording else 0
        with faults.waiting(*context):
            work = dist.irecv(buffer, src=self._ranks[src_stage], group=self._group, tag=tag)
        timed = None
        if recording:
            self._sending.poll()
            fields = self._message_fields(src_stage, kind, k, value.name, tag, buffer)
            timed = (self._timeline, posted, fields)
        return _Incoming(buffer, work, self._device, context, timed)

    def _message_fields(self, peer: int, kind: int, k: int, name: str, tag: int, tensor: torch.Tensor):
        """What the timeline notes of a message (the same on both ends, so they can be paired)."""
        return {
            "microbatch": k,
            "stage": self.index,
            "peer_stage": peer,
            "peer_rank": self._ranks[peer],
            "what": _KIND_NAMES[kind],
            "value": name,
            "tag": tag,
            "bytes": tensor.numel() * tensor.element_size(),
        }

    def _group_name(self) -> str:
        return faults.describe_group("pipeline", self._ranks)

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device != self._device:
            return value.to(self._device)
        return value

    def _check_inputs(self, flat: list[Any]) -> None:
        for i, shape, dtype in self._input_meta:
            t = flat[i]
            if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"smp: model input {i} is {got}, but the stage graph chosen for these inputs was "
                    f"captured for {tuple(shape)} {dtype}: smp's signature cache picked the wrong graph "
                    "(a bug in smp; please report it with the inputs' shapes and dtypes)"
                )


def _check_sendable(name: str, tensor: torch.Tensor, stage: int) -> None:
    """Messages carry dense (strided) tensors; a non-contiguous one is made contiguous on the way."""
    if tensor.layout != torch.strided:
        raise ValueError(
            f"smp: the model's value {name!r}, computed on pipeline stage {stage}, is a {tensor.layout} "
            "tensor, which the pipeline cannot send between stages; return it dense (tensor.to_dense()) "
            "and convert it after the model's call"
        )


def _placeholders(pipe: PipelineGraph):
    return [n for n in pipe.captured.graph_module.graph.nodes if n.op == "placeholder"]
