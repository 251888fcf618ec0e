"""One pipeline stage of this rank: its stage module, and what it receives and computes for the
other stages, one microbatch at a time. A rank runs one stage, or two under "zero_bubble_v"
(smp.pipeline.rank_runtime joins them).

A stage's F and B take their inputs from other ranks as the rank's messages posted them (the
lowered schedule's receives, smp.pipeline.messages) and leave what they computed for the
schedule's sends that follow them. Between two stages of one rank a message is handed over in
memory, the schedule running the sender first.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from smp.passes import PipelineGraph, Value, bindings
from smp.pipeline import split_backward
from smp.pipeline.bundles import Message
from smp.pipeline.messages import Messages
from smp.services import activation_meter


def _handed(local: dict[Message, torch.Tensor], msg: Message) -> torch.Tensor:
    """A message from another stage of this rank: already computed (the schedule runs its sender
    first), taken from memory."""
    if msg not in local:
        raise RuntimeError(
            f"smp: pipeline stage {msg.dst} needs {msg} from stage {msg.src} of the same rank before that "
            "stage computed it: the schedule's order is broken (a bug in smp)"
        )
    return local.pop(msg).detach()  # a leaf of its own for the receiver


@dataclasses.dataclass
class _InFlight:
    received: dict[str, torch.Tensor]  # leaves standing for values of earlier stages
    produced: dict[str, torch.Tensor]


class StageRuntime:
    """`program`: the RankRuntime this stage belongs to (its messages are posted in its layout)."""

    def __init__(self, pipe: PipelineGraph, stage: int, program, messages: Messages):
        self.pipe = pipe
        self.stage = pipe.stages[stage]
        self.index = stage
        self._program = program
        self._messages = messages
        self._in_flight: dict[int, _InFlight] = {}
        self._deferred: dict[int, split_backward.WeightGradients] = {}
        self._weights = [p for p in self.stage.module.parameters() if p.requires_grad]
        self._deferrable: set[int] | None = None  # zero_bubble: ids of the weights W computes
        self._weights_at_b: list[torch.Tensor] | None = None  # zero_bubble: the weights B computes
        # The stage graph's code its forward through Python bindings was made from (smp.passes.bindings;
        # zero_bubble rewrites the graph after the runtime is made): a new code, a new forward.
        self._bound_code: str | None = None
        # What every microbatch's messages follow, looked up once: the values received, produced,
        # the gradients coming back (value, reading stage); which stages are on this rank.
        values = pipe.values
        self._received_values = [values[name] for name in self.stage.received]
        self._produced_values = [values[name] for name in self.stage.produced]
        self._gradient_sources = [
            (values[name], dst)
            for name in self.stage.produced
            if values[name].requires_grad
            for dst in values[name].consumers
        ]
        ranks = program.bundles.stage_ranks
        self._local = [r == ranks[stage] for r in ranks]
        self.meter: activation_meter.SavedActivationMeter | None = None

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
        """Microbatch k's forward of this stage on the flat model inputs `flat`: takes what earlier
        stages computed, leaves what later stages (and, for model outputs, every other rank) read
        for the schedule's sends; returns the values it computed."""
        messages = self._messages
        incoming = messages.incoming(self._program, "F", k, self.index)
        received = {}
        for value in self._received_values:
            if self._local[value.src]:
                tensor = _handed(messages.local, Message(value.src, self.index, "F", k, value.name))
            else:
                tensor = incoming[(value.src, value.name)].wait()
            received[value.name] = tensor.requires_grad_(value.requires_grad)
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
        check_device = messages.device if messages.ordered else None
        sent = {}
        for value, tensor in zip(self._produced_values, results, strict=True):
            _check_sendable(value, tensor, self.index, check_device)
            data = tensor.detach().contiguous()
            for dst in value.consumers:
                if self._local[dst]:
                    messages.local[Message(self.index, dst, "F", k, value.name)] = data
            sent[value.name] = data
        messages.computed("F", k, self.index, self._program, sent)
        self._in_flight[k] = _InFlight(received, produced)
        return produced

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
        messages = self._messages
        incoming = messages.incoming(self._program, "B", k, self.index)
        summed: dict[str, torch.Tensor] = {}
        for value, dst in self._gradient_sources:
            if self._local[dst]:
                grad = _handed(messages.local, Message(dst, self.index, "B", k, value.name))
            else:
                grad = incoming[(dst, value.name)].wait()
            name = value.name
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
        sent = {}
        for value, leaf, grad in zip(self._received_values, leaves, input_grads[: len(leaves)], strict=True):
            if value.requires_grad:
                grad = (grad if grad is not None else torch.zeros_like(leaf)).contiguous()
                if self._local[value.src]:
                    messages.local[Message(self.index, value.src, "B", k, value.name)] = grad
                else:
                    sent[value.name] = grad
        messages.computed("B", k, self.index, self._program, sent)

    def backward_weights(self, k: int) -> None:
        """zero_bubble's W: the weight gradients microbatch k's backward deferred (if any)."""
        deferred = self._deferred.pop(k, None)
        if deferred is not None:
            deferred.run()

    def produced(self, k: int) -> dict[str, torch.Tensor]:
        """The values this stage computed in microbatch k's forward (until its backward)."""
        return self._in_flight[k].produced

    def finish_step(self) -> None:
        self._in_flight.clear()
        self._deferred.clear()

    def _to_device(self, value: Any) -> Any:
        device = self._messages.device
        if isinstance(value, torch.Tensor) and value.device != device:
            return value.to(device)
        return value


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
