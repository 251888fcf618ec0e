"""@smp.step: splits a step's arguments into microbatches, runs them through the pipeline schedule
(smp.engine.executor), and gathers what the step function returned (StepOutput)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from smp import parallel_state
from smp.engine import executor
from smp.services.microbatch import Microbatch


class StepOutput:
    """One tensor returned by a step function, per microbatch (SMP v1's StepOutput).

    `outputs` is the list; indexing, iteration and len() go through it, as in SMP.
    """

    def __init__(self, outputs: list[Any]):
        self.outputs = list(outputs)

    def __getitem__(self, index):
        return self.outputs[index]

    def __iter__(self):
        return iter(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)

    def detach(self) -> StepOutput:
        """The same outputs detached (transformers' Trainer calls `.detach().concat()` on them)."""
        return StepOutput([o.detach() if isinstance(o, torch.Tensor) else o for o in self.outputs])

    def reduce_mean(self):
        if len(self.outputs) == 1:  # one microbatch: its value (no stack, sum and divide per step)
            return self.outputs[0]
        return self.reduce_sum() / len(self.outputs)

    def reduce_sum(self):
        if len(self.outputs) == 1:
            return self.outputs[0]
        if all(isinstance(o, torch.Tensor) for o in self.outputs):
            return torch.stack(self.outputs).sum(dim=0)
        return sum(self.outputs)

    def concat(self, dim: int = 0) -> torch.Tensor:
        return torch.cat(self.outputs, dim=dim)

    def stack(self, dim: int = 0) -> torch.Tensor:
        return torch.stack(self.outputs, dim=dim)

    def __repr__(self) -> str:
        return f"StepOutput({self.outputs!r})"


class StepValues(list):
    """A non-tensor value returned by a step function: a plain list, one entry per microbatch
    (SMP v1 returned a list: `sum(losses)`), that also answers StepOutput's `.outputs`."""

    @property
    def outputs(self) -> list[Any]:
        return list(self)


def step(
    fn: Callable | None = None,
    *,
    non_split_inputs: Iterable[str] | None = None,
    input_split_axes: Mapping[str, int] | None = None,
    detach_outputs: bool = True,
):
    """Decorates a function that runs the model forward (and model.backward) on one microbatch.

    Usable as `@smp.step` or `@smp.step(non_split_inputs=[...], input_split_axes={...})`.
    Tensor arguments (also inside lists, tuples and dicts) are split along axis 0, or the
    axis named in input_split_axes, into `microbatches` pieces; names in non_split_inputs
    pass whole. Each returned tensor comes back as a StepOutput (containers are kept, with
    a StepOutput per tensor in them); a value that is no tensor on any microbatch comes back
    as a plain list, one entry per microbatch, as in SMP v1.
    """
    if fn is None:
        return functools.partial(
            step,
            non_split_inputs=non_split_inputs,
            input_split_axes=input_split_axes,
            detach_outputs=detach_outputs,
        )
    signature = inspect.signature(fn)
    whole = set(non_split_inputs or ())
    axes = dict(input_split_axes or {})
    for name in whole | set(axes):
        if name not in signature.parameters:
            raise ValueError(
                f"smp.step: {name!r} in non_split_inputs/input_split_axes is not a parameter of "
                f"{fn.__name__}{signature}"
            )

    named = not whole and not axes  # every argument is split along axis 0: names only for errors
    bindable: set[tuple] = set()  # call shapes (positional count, keyword names) that bind
    # Until the function has run a backward through model.backward, its model outputs refuse a
    # loss.backward() (smp.engine.inputs.guarded): a step function calls one or the other, and the
    # hooks that check cost more host time per step than all the rest of smp's at pp = 1.
    guarded = [True]

    @functools.wraps(fn)
    def run(*args, **kwargs):
        st = parallel_state.state()
        if st.model is not None and st.model.engine.groups.pp_size > 1:
            args, kwargs = st.model.engine.step_arguments(args, kwargs)
        m = st.config.microbatches
        shape = (len(args), tuple(kwargs))
        batch_size = _whole_batch(args, kwargs) if m == 1 and named and shape in bindable else _SPLIT
        if batch_size is _SPLIT:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as e:
                raise ValueError(
                    f"smp.step: {fn.__name__}{signature} cannot take these arguments ({e}); call it as "
                    "its signature says"
                ) from e
            bindable.add(shape)  # binding depends on the call's shape only
            pieces, batch_size = _split_arguments(bound, m, whole, axes)
        else:
            pieces = [(args, kwargs)]
        guard = guarded[0]
        microbatches = [Microbatch(k, fn, a, kw, batch_size, guard) for k, (a, kw) in enumerate(pieces)]
        if st.model is not None:
            engine = st.model.engine
            executor.run(engine.schedule, engine.groups.pp_rank, microbatches, engine, fn.__name__)
        else:
            executor.run(st.config.schedule(), parallel_state.pp_rank(), microbatches, None, fn.__name__)
        if guard and any(mb.backward_calls for mb in microbatches):
            guarded[0] = False
        results = [mb.result for mb in microbatches]
        return _per_microbatch(results, detach_outputs)

    return run


_SPLIT = object()  # _whole_batch's answer where the arguments need the full split and its checks


def _whole_batch(args: tuple, kwargs: dict) -> int | None | object:
    """One microbatch of arguments that are tensors or plain scalars: the batch size, which the
    split and its checks would give too (they pass such arguments through unchanged), without
    binding or walking them per step. `_SPLIT` for anything else, or anything the split's checks
    would refuse: the full split then raises its error, with the argument's name."""
    size = None
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or not value.is_cpu and not _on_this_device(value):
                return _SPLIT
            rows = value.shape[0]
            if rows == 0 or size is not None and rows != size:
                return _SPLIT
            size = rows
        elif not isinstance(value, (int, float, bool, str, type(None))):
            return _SPLIT
    return size


def _split_arguments(bound: inspect.BoundArguments, m: int, whole: set[str], axes: dict[str, int]):
    split: dict[str, list[Any]] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if name in whole:
            split[name] = [value] * m
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            split[name] = _transpose(
                [_split(v, m, axes.get(name, 0), f"{name}[{i}]") for i, v in enumerate(value)], tuple, m
            )
        elif kind is inspect.Parameter.VAR_KEYWORD:
            parts = {k: _split(v, m, axes.get(k, 0), k) for k, v in value.items()}
            split[name] = [{k: parts[k][i] for k in parts} for i in range(m)]
        else:
            split[name] = _split(value, m, axes.get(name, 0), name)
    if m == 1 and all(parts[0] is bound.arguments[name] for name, parts in split.items()):
        # One microbatch whose arguments came through unchanged: no second binding per step.
        pieces = [(bound.args, bound.kwargs)]
    else:
        pieces = []
        for i in range(m):
            arguments = {name: parts[i] for name, parts in split.items()}
            b = inspect.BoundArguments(bound.signature, arguments)
            pieces.append((b.args, b.kwargs))
    return pieces, _batch_size({k: v for k, v in split.items() if k not in whole}, axes)


def _batch_size(split: dict[str, list[Any]], axes: dict[str, int]) -> int | None:
    """Rows of the split tensors in a microbatch (what tensor parallelism combines): the same for
    all of them, or the microbatches would pair rows that do not belong together."""
    sizes = {}
    for name, parts in split.items():
        for leaf in torch.utils._pytree.tree_leaves(parts[0]):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > axes.get(name, 0):
                sizes.setdefault(leaf.shape[axes.get(name, 0)], name)
    if len(sizes) > 1:
        rows = ", ".join(f"'{name}' {size}" for size, name in sizes.items())
        raise ValueError(
            f"smp.step: the split arguments have different batch sizes per microbatch ({rows}); give "
            "them the same batch size, or list the one that is not per-sample in non_split_inputs"
        )
    return next(iter(sizes), None)


def _on_this_device(value: torch.Tensor) -> bool:
    device = value.device
    return device.type == "cuda" and torch.cuda.is_available() and device.index == torch.cuda.current_device()


def _check_device(value: torch.Tensor, name: str) -> None:
    """CPU tensors are moved to the rank's device by smp; others must already be on it."""
    if value.device.type == "cpu" or _on_this_device(value):
        return
    expected = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    raise ValueError(
        f"smp.step: argument '{name}' is on device {value.device}, but this rank runs on {expected}; "
        f"move it there (tensor.to('{expected}')) or leave it on the CPU"
    )


def _split(value: Any, m: int, axis: int, name: str) -> list[Any]:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(
                f"smp.step: argument '{name}' is a 0-dim tensor, which has no batch axis to split into "
                f"{m} microbatches; list its name in smp.step(non_split_inputs=[...])"
            )
        _check_device(value, name)
        size = value.shape[axis]
        if size == 0:
            raise ValueError(
                f"smp.step: argument '{name}' is an empty batch (size 0 along axis {axis}); skip empty "
                "batches before calling the step function (DataLoader(..., drop_last=True))"
            )
        if size % m:
            raise ValueError(
                f"smp.step: argument '{name}' has batch size {size} along axis {axis}, which does not "
                f"divide into {m} microbatches; use a batch size divisible by {m} (DataLoader(..., "
                "drop_last=True) drops a smaller last batch) or list it in non_split_inputs"
            )
        return [value] if m == 1 else list(value.chunk(m, dim=axis))
    if type(value).__module__ == "numpy" and hasattr(value, "shape"):
        raise ValueError(
            f"smp.step: argument '{name}' is a numpy {type(value).__name__}, which smp would pass whole to "
            "every microbatch; convert it with torch.from_numpy(...) (or list it in non_split_inputs)"
        )
    if hasattr(value, "smp_slice"):
        return [value.smp_slice(m, i, axis) for i in range(m)]
    if isinstance(value, dict):
        parts = {k: _split(v, m, axis, f"{name}[{k!r}]") for k, v in value.items()}
        return [type(value)({k: parts[k][i] for k in value}) for i in range(m)]
    if isinstance(value, (list, tuple, set)):
        items = [_split(v, m, axis, f"{name}[{i}]") for i, v in enumerate(value)]
        return _transpose(items, type(value), m)
    return [value] * m


def _transpose(items: list[list[Any]], kind: type, m: int) -> list[Any]:
    rows = [[parts[i] for parts in items] for i in range(m)]
    if kind in (list, tuple, set):
        return [kind(row) for row in rows]
    return [kind(*row) for row in rows]  # namedtuple


def _per_microbatch(results: list[Any], detach: bool) -> Any:
    first = results[0]
    if len(results) == 1 and isinstance(first, torch.Tensor):  # (the common case, without the walk)
        return StepOutput([first.detach() if detach and first.requires_grad else first])
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields"):
        return type(first)(_per_microbatch([r[i] for r in results], detach) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _per_microbatch([r[k] for r in results], detach) for k in first}
    if not any(isinstance(r, torch.Tensor) for r in results):
        return StepValues(results)  # SMP v1: non-tensor values (a loss's .item()) come back as a list
    if detach:  # (a tensor that requires no grad is detached already)
        results = [r.detach() if isinstance(r, torch.Tensor) and r.requires_grad else r for r in results]
    return StepOutput(results)
