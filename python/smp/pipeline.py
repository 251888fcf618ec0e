"""One rank's part of a pipeline: its stage module, and the activations and gradients it
exchanges with the other stages of its pipeline group, one microbatch at a time.

Messages are point-to-point on the pipeline group, tagged by (kind, microbatch,
value), so they match whatever order the stages post them in. Shapes and dtypes
come from the capture; no message carries metadata and no stage waits on a shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from smp import activation_meter
from smp.passes import PipelineGraph

_ACTIVATION, _OUTPUT, _GRADIENT = range(3)


@dataclasses.dataclass
class _InFlight:
    received: dict[str, torch.Tensor]  # leaves standing for values of earlier stages
    produced: dict[str, torch.Tensor]
    output_recvs: list[tuple[int, torch.Tensor, dist.Work]]  # (output position, buffer, work)


class PendingOutputs:
    """The model's return value for one microbatch; outputs of other stages arrive by wait()."""

    def __init__(self, pipe: PipelineGraph, leaves: list[Any], recvs, requires_grad: list[bool]):
        self._pipe, self._leaves, self._recvs, self._requires_grad = pipe, leaves, recvs, requires_grad

    def wait(self) -> Any:
        for position, buffer, work in self._recvs:
            work.wait()
            self._leaves[position] = buffer.requires_grad_(self._requires_grad[position])
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
        self._input_meta = [
            (i, n.meta["val"].shape, n.meta["val"].dtype)
            for i, n in enumerate(n for n in _placeholders(pipe))
            if isinstance(n.meta.get("val"), torch.Tensor)
        ]
        self.meter: activation_meter.SavedActivationMeter | None = None

    # --- forward ------------------------------------------------------------

    def forward(self, k: int, args: tuple, kwargs: dict) -> PendingOutputs:
        flat = self.pipe.captured.flatten_inputs(args, kwargs)
        self._check_inputs(flat)
        values = self.pipe.values
        recvs = [
            (
                name,
                *self._recv(values[name].shape, values[name].dtype, values[name].src, _ACTIVATION, k, name),
            )
            for name in self.stage.received
        ]
        received = {}
        for name, buffer, work in recvs:
            work.wait()
            received[name] = buffer.requires_grad_(values[name].requires_grad)
        stage_inputs = [self._to_device(flat[i]) for i in self.stage.inputs]
        stage_inputs += [received[name] for name in self.stage.received]
        with torch.autograd.set_grad_enabled(torch.is_grad_enabled()):  # the graph may switch grad mode
            if self.meter is not None:
                with self.meter.track():
                    results = self.stage.module(*stage_inputs)
            else:
                results = self.stage.module(*stage_inputs)
        produced = dict(zip(self.stage.produced, results, strict=True))
        for name, tensor in produced.items():
            value = values[name]
            data = tensor.detach().contiguous()
            for dst in value.consumers:
                self._send(data, dst, _ACTIVATION, k, name)
            if value.is_output:
                for dst in range(len(self._ranks)):
                    if dst != self.index:
                        self._send(data, dst, _OUTPUT, k, name)
        leaves, output_recvs, requires_grad = [], [], []
        for position, leaf in enumerate(self.pipe.outputs):
            requires_grad.append(False)
            if leaf.kind == "const":
                leaves.append(leaf.ref)
            elif leaf.kind == "input":
                leaves.append(flat[leaf.ref])
            elif values[leaf.ref].src == self.index:
                leaves.append(produced[leaf.ref])
            else:
                value = values[leaf.ref]
                buffer, work = self._recv(value.shape, value.dtype, value.src, _OUTPUT, k, leaf.ref)
                leaves.append(None)
                output_recvs.append((position, buffer, work))
                requires_grad[position] = value.requires_grad
        self._in_flight[k] = _InFlight(received, produced, output_recvs)
        return PendingOutputs(self.pipe, leaves, output_recvs, requires_grad)

    # --- backward -----------------------------------------------------------

    def backward(self, k: int, tensors: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        """Backward of microbatch k from the user's loss(es) and the gradients later stages send."""
        state = self._in_flight.pop(k)
        values = self.pipe.values
        roots, root_grads = [], []
        for t, g in zip(tensors, grads, strict=True):
            if t.requires_grad:
                roots.append(t)
                root_grads.append(g)
        recvs = []
        for name in self.stage.produced:
            value = values[name]
            if value.requires_grad:
                for src in value.consumers:
                    recvs.append((name, *self._recv(value.shape, value.dtype, src, _GRADIENT, k, name)))
        summed: dict[str, torch.Tensor] = {}
        for name, buffer, work in recvs:
            work.wait()
            summed[name] = buffer if name not in summed else summed[name] + buffer
        for name, grad in summed.items():
            tensor = state.produced[name]
            if tensor.requires_grad:
                roots.append(tensor)
                root_grads.append(grad)
        if roots:
            torch.autograd.backward(roots, root_grads)
        for name in self.stage.received:
            value = values[name]
            if value.requires_grad:
                leaf = state.received[name]
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self._send(grad.contiguous(), value.src, _GRADIENT, k, name)

    def forget(self, k: int) -> None:
        """Drops a microbatch that will not run backward (a forward-only step)."""
        self._in_flight.pop(k, None)

    def finish_step(self) -> None:
        for work in self._sends:
            work.wait()
        self._sends = []
        self._in_flight.clear()

    # --- messages -----------------------------------------------------------

    def _tag(self, kind: int, k: int, name: str) -> int:
        return (kind * self._microbatches + k) * len(self._value_id) + self._value_id[name]

    def _send(self, tensor: torch.Tensor, dst_stage: int, kind: int, k: int, name: str) -> None:
        self._sends.append(
            dist.isend(tensor, dst=self._ranks[dst_stage], group=self._group, tag=self._tag(kind, k, name))
        )

    def _recv(self, shape, dtype, src_stage: int, kind: int, k: int, name: str):
        buffer = torch.empty(shape, dtype=dtype, device=self._device)
        work = dist.irecv(buffer, src=self._ranks[src_stage], group=self._group, tag=self._tag(kind, k, name))
        return buffer, work

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
                    f"smp: model input {i} is {got}, but the pipeline was captured for "
                    f"{tuple(shape)} {dtype}; "
                    "every step must give the model inputs of the same shapes (pad to a fixed length and "
                    "keep the batch size fixed with DataLoader(drop_last=True))"
                )


def _placeholders(pipe: PipelineGraph):
    return [n for n in pipe.captured.graph_module.graph.nodes if n.op == "placeholder"]
