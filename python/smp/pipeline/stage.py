"""One pipeline stage of this rank: its stage module, and the activations and gradients it
exchanges with the other stages, one microbatch at a time. A rank runs one stage, or two under
"zero_bubble_v" (smp.pipeline.rank_runtime joins them).

Messages are point-to-point on the pipeline group. Shapes and dtypes come from the
capture; no message carries metadata and no stage waits on a shape. Between two stages of one
rank a message is handed over in memory. Between ranks, two paths:

- tagged (the default for CPU tensors): each message tagged by (kind, microbatch,
  value), so it matches whatever order the stages post them in; CUDA tensors are
  staged through host memory and travel over Gloo. A stage posts its next
  microbatch's receives at the end of an action (smp.pipeline.lookahead).
- ordered (the default for CUDA tensors, `ordered_messages: true` selects it on CPU):
  every message on one tag, posted by both ends in one order derived from the schedule
  (smp.pipeline.message_order), as NCCL needs: it matches by issue order, not by tag.
  CUDA tensors then go GPU to GPU with no host copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from smp import faults
from smp.passes import PipelineGraph, Value, bindings
from smp.pipeline import message_order, split_backward
from smp.pipeline.lookahead import Lookahead
from smp.services import activation_meter, timeline

_ACTIVATION, _OUTPUT, _GRADIENT = message_order.ACTIVATION, message_order.OUTPUT, message_order.GRADIENT
_KIND_NAMES = ("activation", "output", "gradient")


@dataclasses.dataclass
class Links:
    """How one rank's stages reach every stage: the pipeline group, each pipeline rank's global
    rank, each stage's pipeline rank, the messages in flight between this rank's own stages,
    and the ordered path once chosen (shared by the rank's stages: the order is per pair of ranks)."""

    group: dist.ProcessGroup
    group_ranks: list[int]  # pipeline rank -> global rank
    stage_ranks: tuple[int, ...]  # stage -> pipeline rank
    rank: int  # this rank's pipeline rank
    microbatches: int
    device: torch.device
    # Receives posted a microbatch ahead (the tagged path), shared by the rank's programs.
    lookahead: Lookahead
    local: dict[message_order.Message, torch.Tensor] = dataclasses.field(default_factory=dict)
    ordered: message_order.OrderedChannels | None = None
    # stage -> its rank inside `group`, which the backend's send and recv take (what dist.isend
    # computes from the global rank at every call), made once.
    _group_peer: tuple[int, ...] | None = dataclasses.field(default=None, repr=False)

    def is_local(self, stage: int) -> bool:
        return self.stage_ranks[stage] == self.rank

    def global_rank(self, stage: int) -> int:
        return self.group_ranks[self.stage_ranks[stage]]

    def group_peer(self, stage: int) -> int:
        if self._group_peer is None:
            self._group_peer = tuple(
                dist.get_group_rank(self.group, self.group_ranks[r]) for r in self.stage_ranks
            )
        return self._group_peer[stage]

    def group_name(self) -> str:
        return _group_name(tuple(self.group_ranks))


@functools.lru_cache(maxsize=64)
def _group_name(group_ranks: tuple[int, ...]) -> str:
    """How errors name a pipeline group (every wait on a message names it: built once)."""
    return faults.describe_group("pipeline", group_ranks)


class _Incoming:
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
                got = self._work.wait()
            except RuntimeError:  # a transport failure or timeout, named as faults.waiting names it
                with faults.waiting(*self._context()):
                    raise
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


class _Handed:
    """A message from another stage of this rank: already computed (the schedule runs its sender
    first), taken from memory on wait()."""

    def __init__(self, links: Links, msg: message_order.Message):
        self._links, self._msg = links, msg

    def wait(self) -> torch.Tensor:
        if self._msg not in self._links.local:
            raise RuntimeError(
                f"smp: pipeline stage {self._msg.dst} needs {self._msg} from stage {self._msg.src} of the "
                "same rank before that stage computed it: the schedule's order is broken (a bug in smp)"
            )
        return self._links.local.pop(self._msg).detach()  # a leaf of its own for the receiver


@dataclasses.dataclass
class _InFlight:
    received: dict[str, torch.Tensor]  # leaves standing for values of earlier stages
    produced: dict[str, torch.Tensor]


class StageRuntime:
    def __init__(self, pipe: PipelineGraph, stage: int, links: Links):
        self.pipe = pipe
        self.stage = pipe.stages[stage]
        self.index = stage
        self._links = links
        self._value_id = {name: i for i, name in enumerate(sorted(pipe.values))}
        self._sends: list[dist.Work] = []
        self._in_flight: dict[int, _InFlight] = {}
        self._deferred: dict[int, split_backward.WeightGradients] = {}
        self._early: dict[tuple[str, int], list] = {}  # ("F"/"B", k) -> receives posted ahead
        self._weights = [p for p in self.stage.module.parameters() if p.requires_grad]
        self._deferrable: set[int] | None = None  # zero_bubble: ids of the weights W computes
        self._weights_at_b: list[torch.Tensor] | None = None  # zero_bubble: the weights B computes
        # The stage graph's code its forward through Python bindings was made from (smp.passes.bindings;
        # zero_bubble rewrites the graph after the runtime is made): a new code, a new forward.
        self._bound_code: str | None = None
        # What every microbatch's messages follow, looked up once: the values received, produced,
        # the gradients coming back (value, sending stage), the ranks a model output goes to.
        values = pipe.values
        self._received_values = [values[name] for name in self.stage.received]
        self._produced_values = [values[name] for name in self.stage.produced]
        self._gradient_sources = [
            (name, values[name], src)
            for name in self.stage.produced
            if values[name].requires_grad
            for src in values[name].consumers
        ]
        self._output_ranks = [r for r in range(len(links.group_ranks)) if r != links.rank]
        self.meter: activation_meter.SavedActivationMeter | None = None
        self._timeline = timeline.recorder()
        self._sending = timeline.Pending(self._timeline) if self._timeline is not None else None

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

    def forward(self, k: int, flat: list[Any]) -> dict[str, torch.Tensor]:
        """Microbatch k's forward of this stage on the flat model inputs `flat`: receives what
        earlier stages computed, sends what later stages (and, for model outputs, every other
        rank) read; returns the values it computed."""
        tagged = self._links.ordered is None
        if tagged and self._links.lookahead.begin(self, "F", k):
            incoming = self._early.pop(("F", k))
        else:
            incoming = self._post_forward(k)
        received = {
            value.name: message.wait().requires_grad_(value.requires_grad) for value, message in incoming
        }
        stage_inputs = [self._to_device(flat[i]) for i in self.stage.inputs]
        stage_inputs += received.values()  # (in self.stage.received's order)
        grad_mode = torch.is_grad_enabled()
        module = self.stage.module
        if isinstance(module, torch.fx.GraphModule) and self._bound_code is not module.code:
            bindings.use_python_bindings(module)  # (first, or the graph was rewritten since)
            self._bound_code = module.code
        try:
            if self.meter is None and not self._deferrable:
                results = module(*stage_inputs)
            else:
                with contextlib.ExitStack() as scope:
                    if self.meter is not None:
                        scope.enter_context(self.meter.track())
                    if self._deferrable:
                        self._deferred[k] = split_backward.WeightGradients(self.meter)
                        scope.enter_context(split_backward.collecting(self._deferred[k]))
                    results = module(*stage_inputs)
        finally:
            torch.set_grad_enabled(grad_mode)  # graphs may switch it
        produced = dict(zip(self.stage.produced, results, strict=True))
        links = self._links
        check_device = links.device if links.ordered is not None else None
        for value, tensor in zip(self._produced_values, results, strict=True):
            _check_sendable(value, tensor, self.index, check_device)
            data = tensor.detach().contiguous()
            for dst in value.consumers:
                self._send(data, dst, _ACTIVATION, k, value.name)
            if value.is_output:
                for r in self._output_ranks:
                    self._send(data, r, _OUTPUT, k, value.name)  # to rank r's stage r
        self._flush_ordered(k)
        self._in_flight[k] = _InFlight(received, produced)
        if tagged and (ahead := links.lookahead.ahead(self, "F", k)) is not None:
            self._early[("F", ahead)] = self._post_forward(ahead)
        return produced

    def _post_forward(self, k: int) -> list:
        return [(value, self._recv(value, value.src, _ACTIVATION, k)) for value in self._received_values]

    def receive_output(self, value: Value, k: int):
        """A model output of microbatch k that another rank computes (this must be the rank's stage
        of the rank's own index, which every rank's outputs are addressed to); wait() gives it."""
        return self._recv(value, value.src, _OUTPUT, k)

    # --- backward -----------------------------------------------------------

    def backward(
        self,
        k: int,
        roots: list[tuple[torch.Tensor, torch.Tensor]],
        defer_weights: bool = False,
        also: list[torch.Tensor] = (),
    ) -> None:
        """Backward of microbatch k from `roots` (tensors and their gradients: the user's loss, or
        outputs of this stage a later stage of this rank saw the loss's gradient of) and the
        gradients later stages send; with defer_weights, only the input gradients
        (backward_weights(k) does the rest). `also`: leaves whose gradients this pass must
        accumulate too (outputs of an earlier stage of this rank that the loss read)."""
        state = self._in_flight.pop(k)
        roots = [(t, g) for t, g in roots if t.requires_grad]
        tagged = self._links.ordered is None
        if tagged and self._links.lookahead.begin(self, "B", k):
            incoming = self._early.pop(("B", k))
        else:
            incoming = self._post_backward(k)
        summed: dict[str, torch.Tensor] = {}
        for name, message in incoming:
            grad = message.wait()
            summed[name] = grad if name not in summed else summed[name] + grad
        for name, grad in summed.items():
            tensor = state.produced[name]
            if tensor.requires_grad:
                roots.append((tensor, grad))
        leaves = list(state.received.values())  # (in self.stage.received's order)
        tensors, grads = [t for t, _ in roots], [g for _, g in roots]
        if defer_weights:  # zero_bubble's B: input gradients now, weight gradients at W
            store = self._deferred.setdefault(k, split_backward.WeightGradients(self.meter))
            if self._weights_at_b is None:  # those not deferred (all, if the stage is not rewritten)
                self._weights_at_b = [w for w in self._weights if id(w) not in (self._deferrable or ())]
            input_grads = split_backward.backward_inputs(
                tensors, grads, leaves + list(also), self._weights_at_b, store
            )
        else:
            if tensors:
                torch.autograd.backward(tensors, grads)
            input_grads = [leaf.grad for leaf in leaves]
        for value, leaf, grad in zip(self._received_values, leaves, input_grads[: len(leaves)], strict=True):
            if value.requires_grad:
                grad = grad if grad is not None else torch.zeros_like(leaf)
                self._send(grad.contiguous(), value.src, _GRADIENT, k, value.name)
        self._flush_ordered(k)
        if tagged and (ahead := self._links.lookahead.ahead(self, "B", k)) is not None:
            self._early[("B", ahead)] = self._post_backward(ahead)

    def _post_backward(self, k: int) -> list:
        return [(name, self._recv(value, src, _GRADIENT, k)) for name, value, src in self._gradient_sources]

    # --- a change of program between microbatches (smp.pipeline.lookahead) --------------------

    def fill(self, kind: str, k: int) -> None:
        """Sends zeros for what this stage's peers on other ranks posted for `kind` of microbatch k
        in this runtime's layout, which another program now runs."""
        links = self._links
        if kind == "F":
            for value in self._produced_values:
                for dst in value.consumers:
                    if not links.is_local(dst):
                        self._send(_zeros(value), dst, _ACTIVATION, k, value.name)
        else:
            for value in self._received_values:
                if value.requires_grad and not links.is_local(value.src):
                    self._send(_zeros(value), value.src, _GRADIENT, k, value.name)

    def drain(self, kind: str, k: int) -> None:
        """Waits for and drops the receives this runtime posted ahead for `kind` of microbatch k
        (the peers' `fill` answers them)."""
        for _, message in self._early.pop((kind, k), ()):
            if isinstance(message, _Incoming):
                message.wait()

    def _flush_ordered(self, k: int) -> None:
        """Posts the ordered path's groups that this action's sends complete."""
        if self._links.ordered is None:
            return
        with faults.waiting(
            f"pipeline stage {self.index} posting the messages of microbatch {k}", self._links.group_name()
        ):
            self._links.ordered.flush()

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
        with faults.waiting(f"pipeline stage {self.index} completing its sends", self._links.group_name()):
            for work in self._sends:
                work.wait()
        if self._sending is not None:
            self._sending.close()
        self._sends = []
        self._in_flight.clear()
        self._deferred.clear()
        self._early.clear()

    # --- messages -----------------------------------------------------------

    def _tag(self, kind: int, k: int, name: str) -> int:
        return (kind * self._links.microbatches + k) * len(self._value_id) + self._value_id[name]

    def _send(self, tensor: torch.Tensor, dst_stage: int, kind: int, k: int, name: str) -> None:
        links = self._links
        if links.is_local(dst_stage):  # another stage of this rank: handed over in memory
            links.local[message_order.Message(self.index, dst_stage, kind, k, name)] = tensor
            return
        if links.ordered is not None:  # posted with its group at the action's end (flush)
            links.ordered.send(message_order.Message(self.index, dst_stage, kind, k, name), tensor)
            return
        tag = self._tag(kind, k, name)
        timed = self._timeline is not None and self._timeline.recording  # off: one test
        posted = timeline.now() if timed else 0
        # The backend's send, as dist.isend calls it (without its per-call checks and rank lookup).
        # Posting fails at once if the peer has already gone (its connection closed): named too.
        try:
            work = links.group.send([_wire(tensor.cpu())], links.group_peer(dst_stage), tag)
        except RuntimeError:
            what = f"pipeline stage {self.index} sending {_KIND_NAMES[kind]} {name!r} of microbatch {k}"
            peer = links.global_rank(dst_stage)
            with faults.waiting(f"{what} to stage {dst_stage}", links.group_name(), peer):
                raise
        self._sends.append(work)
        if timed:
            self._sending.poll()
            fields = self._message_fields(dst_stage, kind, k, name, tag, tensor)
            self._sending.add(work, "send", posted, **fields)

    def _recv(self, value: Value, src_stage: int, kind: int, k: int):
        links = self._links
        if links.is_local(src_stage):
            return _Handed(links, message_order.Message(src_stage, self.index, kind, k, value.name))

        def context() -> tuple:  # made only when a wait fails
            what = f"pipeline stage {self.index} receiving {_KIND_NAMES[kind]} {value.name!r}"
            peer = links.global_rank(src_stage)
            return (f"{what} of microbatch {k} from stage {src_stage}", links.group_name(), peer)

        if links.ordered is not None:  # posted when its group's turn comes (at the latest on wait)
            msg = message_order.Message(src_stage, self.index, kind, k, value.name)
            return _Incoming(None, _OrderedWork(links.ordered, msg), links.device, context)
        buffer = torch.empty(value.shape, dtype=value.dtype)
        tag = self._tag(kind, k, value.name)
        recording = self._timeline is not None and self._timeline.recording  # off: one test
        posted = timeline.now() if recording else 0
        try:  # the backend's recv, as dist.irecv calls it
            work = links.group.recv([_wire(buffer)], links.group_peer(src_stage), tag)
        except RuntimeError:
            with faults.waiting(*context()):
                raise
        timed = None
        if recording:
            self._sending.poll()
            fields = self._message_fields(src_stage, kind, k, value.name, tag, buffer)
            timed = (self._timeline, posted, fields)
        return _Incoming(buffer, work, links.device, context, timed)

    def _message_fields(self, peer: int, kind: int, k: int, name: str, tag: int, tensor: torch.Tensor):
        """What the timeline notes of a message (the same on both ends, so they can be paired)."""
        return {
            "microbatch": k,
            "stage": self.index,
            "peer_stage": peer,
            "peer_rank": self._links.global_rank(peer),
            "what": _KIND_NAMES[kind],
            "value": name,
            "tag": tag,
            "bytes": tensor.numel() * tensor.element_size(),
        }

    def _to_device(self, value: Any) -> Any:
        device = self._links.device
        if isinstance(value, torch.Tensor) and value.device != device:
            return value.to(device)
        return value


def _zeros(value: Value) -> torch.Tensor:
    return torch.zeros(value.shape, dtype=value.dtype)


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as the backend carries it (a complex one as its real view, as dist.isend does)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _check_sendable(value: Value, tensor: torch.Tensor, stage: int, device: torch.device | None) -> None:
    """Messages carry dense (strided) tensors of the shape and dtype the capture saw (receivers size
    their buffers from it: NCCL would hang or mix up data, not fail, on a mismatch) and, on the
    ordered path, on the pipeline's device (`device`). A non-contiguous one is made contiguous."""
    name = value.name
    if tensor.layout != torch.strided:
        raise ValueError(
            f"smp: the model's value {name!r}, computed on pipeline stage {stage}, is a {tensor.layout} "
            "tensor, which the pipeline cannot send between stages; return it dense (tensor.to_dense()) "
            "and convert it after the model's call"
        )
    if tuple(tensor.shape) != tuple(value.shape) or tensor.dtype != value.dtype:
        raise ValueError(
            f"smp: the model's value {name!r}, computed on pipeline stage {stage}, is "
            f"{tuple(tensor.shape)} {tensor.dtype}, but the stage graph was captured with "
            f"{tuple(value.shape)} {value.dtype}, which the receiving stage expects; run every step "
            "under the autocast setting of the step that captured the graph (the first)"
        )
    if device is not None and tensor.device != device:
        raise ValueError(
            f"smp: the model's value {name!r}, computed on pipeline stage {stage}, is on {tensor.device}, "
            f"but the pipeline sends on {device}; create tensors inside the model on the input's device "
            "(e.g. torch.arange(n, device=x.device))"
        )
