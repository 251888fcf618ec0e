"""This rank's part of a pipeline: its stages (one, or two under "zero_bubble_v"), the model's
outputs of each microbatch. Its messages to and from other ranks go through the rank's Messages,
shared by its programs (smp.pipeline.messages).

A microbatch's forward runs the rank's stages in pipeline order and its backward in the reverse
order, each stage as its own schedule action: between two of them the microbatch hands control
back to the schedule (`between`). The user's loss is computed once, from the model's outputs;
when an earlier stage of this rank computed one of them, the user gets a leaf standing for it, so
that the loss's backward (run with the later stage's B) stops there and the earlier stage's B
continues from that leaf's gradient: each stage's backward runs as its own action, once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from smp.passes import PipelineGraph
from smp.pipeline.bundles import Bundles
from smp.pipeline.messages import Messages
from smp.pipeline.stage import StageRuntime
from smp.pipeline.wire import Wire
from smp.services import activation_meter


class PendingOutputs:
    """The model's return value for one microbatch; outputs of other ranks arrive by wait().

    Those copies do not require grad: their gradient flows on the rank that computed them,
    so a loss computed from them here needs no backward.
    """

    def __init__(self, pipe: PipelineGraph, leaves: list[Any], incoming: list[tuple[int, Any]], receive):
        """`incoming`: (position, value) of each output another rank computes; `receive()` gives
        their receives, (sending stage, value name) -> receive."""
        self._pipe, self._leaves, self._incoming, self._receive = pipe, leaves, incoming, receive

    def wait(self) -> Any:
        if self._incoming:
            received = self._receive()
            for position, value in self._incoming:
                self._leaves[position] = received[(value.src, value.name)].wait()
        return self._pipe.unflatten_outputs(self._leaves)


class RankRuntime:
    """`stage_ranks`: each stage's pipeline rank (smp.schedules.stage_ranks); `group_ranks`:
    each pipeline rank's global rank; `rank`: this rank's pipeline rank."""

    def __init__(
        self,
        pipe: PipelineGraph,
        stage_ranks: tuple[int, ...],
        rank: int,
        group: dist.ProcessGroup,
        group_ranks: list[int],
        microbatches: int,
        device: torch.device,
        messages: Messages | None = None,
    ):
        """`messages`: the rank's, shared by its programs (a fresh one, on the tagged path, if None)."""
        if len(stage_ranks) != len(pipe.stages):
            raise ValueError(f"smp: {len(stage_ranks)} stage placements for {len(pipe.stages)} stages")
        self.pipe = pipe
        self.rank = rank
        stage_ranks = tuple(stage_ranks)
        if messages is None:
            messages = Messages(Wire(group, group_ranks, stage_ranks, rank, device, ordered=False))
        self._messages = messages
        self.bundles = Bundles(pipe, stage_ranks, rank, microbatches)
        self.stages = [StageRuntime(pipe, s, self, messages) for s, r in enumerate(stage_ranks) if r == rank]
        self._input_meta = [
            (i, n.meta["val"].shape, n.meta["val"].dtype)
            for i, n in enumerate(n for n in pipe.captured.graph_module.graph.nodes if n.op == "placeholder")
            if isinstance(n.meta.get("val"), torch.Tensor)
        ]
        # Microbatch -> (output value -> the leaf the user got for an output of an earlier stage).
        self._output_leaves: dict[int, dict[str, torch.Tensor]] = {}
        self._meter: activation_meter.SavedActivationMeter | None = None

    @property
    def meter(self) -> activation_meter.SavedActivationMeter | None:
        return self._meter

    @meter.setter
    def meter(self, meter: activation_meter.SavedActivationMeter | None) -> None:
        self._meter = meter
        for stage in self.stages:
            stage.meter = meter

    def defer_weight_gradients(self) -> None:
        """For the split-backward schedules: see StageRuntime.defer_weight_gradients."""
        for stage in self.stages:
            stage.defer_weight_gradients()

    # --- forward ------------------------------------------------------------

    def forward(
        self,
        k: int,
        args: tuple,
        kwargs: dict,
        between: Callable[[], None] = lambda: None,
        around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> PendingOutputs:
        """Microbatch k's forward on this rank's stages, `between` called between two of them and
        each run inside `around()`."""
        flat = self.pipe.captured.flatten_inputs(args, kwargs)
        self._check_inputs(flat)
        self._messages.begin(self)
        produced: dict[int, dict[str, torch.Tensor]] = {}
        for i, stage in enumerate(self.stages):
            if i:
                between()
            with around():
                produced[stage.index] = stage.forward(k, flat)
        return self._outputs(k, flat, produced)

    def _outputs(self, k: int, flat: list[Any], produced: dict[int, dict[str, torch.Tensor]]):
        values, last = self.pipe.values, self.stages[-1].index
        leaves, outputs, kept = [], [], {}
        for position, leaf in enumerate(self.pipe.outputs):
            if leaf.kind == "const":
                leaves.append(leaf.ref)
            elif leaf.kind == "input":
                leaves.append(flat[leaf.ref])
            elif self.bundles.stage_ranks[values[leaf.ref].src] == self.rank:
                tensor = produced[values[leaf.ref].src][leaf.ref]
                if values[leaf.ref].src != last and tensor.requires_grad:
                    tensor = kept.setdefault(leaf.ref, tensor.detach().requires_grad_())
                leaves.append(tensor)
            else:  # (a value returned twice arrives once: both wait for its one receive)
                leaves.append(None)
                outputs.append((position, values[leaf.ref]))
        if kept:
            self._output_leaves[k] = kept
        # Every rank's outputs are addressed to its stage of its own index (stage r is on rank r).
        receive = lambda: self._messages.incoming(self, "O", k, self.rank)  # noqa: E731
        return PendingOutputs(self.pipe, leaves, outputs, receive)

    # --- backward -----------------------------------------------------------

    def backward(
        self,
        k: int,
        tensors: list[torch.Tensor],
        grads: list[torch.Tensor],
        defer_weights: bool = False,
        between: Callable[[], None] = lambda: None,
    ) -> None:
        """Microbatch k's backward from the user's loss(es): this rank's stages from the last,
        `between` called between two of them (each is its own action of the schedule)."""
        kept = self._output_leaves.pop(k, {})
        for i, stage in enumerate(reversed(self.stages)):
            if i == 0:
                roots = list(zip(tensors, grads, strict=True))
                stage.backward(k, roots, defer_weights, also=list(kept.values()))
                continue
            between()
            produced = stage.produced(k)
            roots = [
                (produced[n], leaf.grad)
                for n, leaf in kept.items()
                if n in produced and leaf.grad is not None
            ]
            stage.backward(k, roots, defer_weights)

    def backward_weights(self, k: int, stage: int) -> None:
        """A split-backward schedule's W of microbatch k on `stage`."""
        for s in self.stages:
            if s.index == stage:
                s.backward_weights(k)

    def produced_by_stage(self, k: int) -> dict[int, dict[str, torch.Tensor]]:
        """Per stage of this rank, the values it computed in microbatch k's forward (until its backward)."""
        return {stage.index: stage.produced(k) for stage in self.stages}

    def finish_step(self) -> None:
        self._messages.finish()  # (once for the rank's programs: the first one's finish does it)
        for stage in self.stages:
            stage.finish_step()
        self._output_leaves.clear()

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
