"""A rank's parameters flattened per param group, with the optimizer state cut across the
reduced-data-parallel group (ZeRO-1), for smp.DistributedOptimizer.

Each param group's local parameters (this rank's stage, its tensor-parallel shards) are
laid end to end in one flat buffer, padded to a multiple of the group size R, and become
views of it (the Parameter objects stay: graph modules hold them). Rank r of the group
owns elements [r*c, (r+1)*c) with c = padded/R, and the wrapped torch optimizer, whose
param group now holds just that chunk, keeps its state (Adam's moments, momentum) for it
alone. Each param group also has one fp32 gradient buffer laid out like its parameters, which
GradSync averages in place: in fp32 the parameters' grads are views of it, and bf16/fp16
gradients are added into it as they are produced (and then freed). The chunk's gradient is a
view of that buffer: no copy. In fp32 the chunk it steps is a view of the flat parameter
buffer; in bf16/fp16 it is an fp32 master copy, the only fp32 copy of the weights, of this
rank's chunk alone. After the step each rank broadcasts its chunk into the others' flat
buffers, in place. Without sharding (R = 1) the same code holds fp32 master weights for
bf16/fp16 training.
Element-wise optimizers (SGD, Adam, AdamW, ...) update a flat chunk exactly as they
update the separate parameters.

Expert parallelism: a rank's experts are not the other data-parallel ranks' experts, so a param
group's expert parameters are flattened apart (a second flat buffer, a second chunk in the same
torch param group) and cut across the replicas holding the same experts (the ep replica group),
not across all of data parallelism; the rest as above.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import optimizer as torch_optimizer

from smp import faults
from smp.data_parallel.buffers import attach_grad
from smp.optim import grad_norm


@dataclasses.dataclass(frozen=True)
class Comm:
    """The ranks a flat buffer is cut across: `ranks` (global, in order: the broadcasts' sources)
    over `group`; one rank keeps it whole."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]

    @classmethod
    def of(cls, group: dist.ProcessGroup | None, ranks) -> Comm:
        ranks = tuple(ranks)
        return cls(group if len(ranks) > 1 else None, ranks)

    @property
    def size(self) -> int:
        return max(1, len(self.ranks))

    @property
    def rank(self) -> int:
        return self.ranks.index(dist.get_rank()) if len(self.ranks) > 1 else 0


@dataclasses.dataclass
class _FlatGroup:
    comm: Comm
    param_group: int  # the torch param group it belongs to
    params: list[nn.Parameter]
    offsets: list[int]  # start of each parameter in the flat buffers
    numel: int  # without padding
    chunk: int  # elements per rank
    lo: int  # where this rank's chunk starts
    values: torch.Tensor  # the parameters end to end, in their dtype (padded): each is a view of it
    master: nn.Parameter  # this rank's chunk in fp32: a view of `values` if they are fp32, else a copy
    # The parameters' fp32 gradients end to end (padded), as `values`; None when only this rank's
    # chunk of them is kept (sharded gradients: `master.grad`, filled by GradSync).
    grads: torch.Tensor | None

    @property
    def master_is_copy(self) -> bool:
        """Whether the master chunk is an fp32 copy of low-precision values (else a view of them)."""
        return self.values.dtype != self.master.dtype

    def overlaps(self):
        """(param, start in param, start in chunk, length) for each parameter overlapping the chunk."""
        lo, hi = self.lo, self.lo + self.chunk
        for p, off in zip(self.params, self.offsets, strict=True):
            start, end = max(off, lo), min(off + p.numel(), hi)
            if start < end:
                yield p, start - off, start - lo, end - start

    def views(self, flat: torch.Tensor):
        """(param, its view of `flat`) for each parameter."""
        for p, off in zip(self.params, self.offsets, strict=True):
            yield p, flat[off : off + p.numel()].view_as(p)

    def attach_grads(self) -> None:
        """Makes the chunk's gradient a view of `grads` and, in fp32, the parameters' grads too (a
        no-op once they are). bf16/fp16 gradients are added into `grads` by GradSync."""
        if self.grads is None:
            return  # sharded gradients: master.grad is the chunk's, kept
        if not self.master_is_copy:
            for p, view in self.views(self.grads):
                attach_grad(p, view)
        self.master.grad = self.grads[self.lo : self.lo + self.chunk]  # the chunk's, whatever it held

    def applied_grads(self) -> torch.Tensor:
        """The gradients the step applies: the whole buffer (so that in fp32 the parameters' own
        read unscaled and clipped), or the chunk's alone where only it is kept."""
        return self.grads if self.grads is not None else self.master.grad


class FlatState:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        comm: Comm,
        shard_grads: bool = False,
        experts: Comm | None = None,
        is_expert: Callable[[nn.Parameter], bool] = lambda p: False,
    ):
        """`comm`: the ranks each flat buffer is cut across; `experts`: those of the expert
        parameters (`is_expert`), flattened apart (None: no experts)."""
        if any(optimizer.state.values()):
            raise RuntimeError(
                "smp: the optimizer already holds state (it stepped before the model's first step); "
                "with shard_optimizer_state, bf16 or fp16 build it from model.parameters() and step it "
                "only through smp.DistributedOptimizer"
            )
        self._order: list[list[nn.Parameter]] = []  # each param group's parameters, as given
        self.groups: list[_FlatGroup] = []
        for g, param_group in enumerate(optimizer.param_groups):
            params = list(param_group["params"])
            self._order.append(params)
            parts = [(comm, [p for p in params if not is_expert(p)])]
            if experts is not None:
                parts.append((experts, [p for p in params if is_expert(p)]))
            masters = []
            for part_comm, part in parts:
                if part or len(parts) == 1:  # (a group without experts keeps its one buffer)
                    flat = _flat_group(part_comm, g, part, shard_grads)
                    masters.append(flat.master)
                    self.groups.append(flat)
            param_group["params"] = masters
        optimizer.state.clear()

    # --- gradients --------------------------------------------------------------------

    def load_grads(self, scale: float, check: bool) -> bool:
        """Gives each chunk its gradient, a view of the averaged gradients (divided by `scale`);
        with `check`, returns whether this rank's chunk holds an inf or nan (a sum tells)."""
        overflow = False
        for flat in self.groups:
            flat.attach_grads()  # a no-op unless a grad was replaced (set to None, say)
            if scale != 1.0:
                flat.applied_grads().div_(scale)
            if check:
                overflow = overflow or not bool(torch.isfinite(flat.master.grad.sum()))
        return overflow

    def zero_grad(self) -> None:
        """Zeroes the kept flat gradients in fp32 (torch's semantics: they accumulate until zeroed)."""
        for flat in self.groups:
            if flat.grads is None:
                flat.master.grad.zero_()  # sharded gradients: every window's are its own anyway
            elif not flat.master_is_copy:
                flat.grads.zero_()
            # bf16/fp16: their fp32 accumulators start every accumulation window at zero (GradSync)

    def squared_norm(self, counts: Callable[[nn.Parameter], bool]) -> torch.Tensor:
        """Sum of squared chunk gradients over the parameters this rank counts (one host sync)."""
        counted = [
            flat.master.grad[c_start : c_start + n]
            for flat in self.groups
            if flat.master.grad is not None
            for p, _, c_start, n in flat.overlaps()
            if counts(p)
        ]
        return grad_norm.squares_of(counted)

    def scale_grads(self, factor: float) -> None:
        for flat in self.groups:
            if flat.master.grad is not None:
                flat.applied_grads().mul_(factor)

    # --- parameters -------------------------------------------------------------------

    def publish(self) -> None:
        """Puts the updated chunks into the parameters: each rank's chunk is broadcast from it into
        the others' flat buffers, in place (Gloo's all-gather would gather into a buffer of its own
        and copy that out: twice the time, and page faults)."""
        operation = "optimizer publish (broadcast of each rank's updated chunk of the parameters)"
        with torch.no_grad():
            for flat in self.groups:
                if flat.params and flat.master_is_copy:
                    flat.values[flat.lo : flat.lo + flat.chunk].copy_(flat.master)
            for comm in dict.fromkeys(f.comm for f in self.groups if f.params and f.comm.group is not None):
                works = []
                with faults.waiting(operation, faults.group_of("reduced-data-parallel", comm.group)):
                    for flat in self.groups:
                        if flat.comm != comm or not flat.params:
                            continue
                        for r, src in enumerate(comm.ranks):
                            part = flat.values[r * flat.chunk : (r + 1) * flat.chunk]
                            works.append(dist.broadcast(part, src=src, group=comm.group, async_op=True))
                    for work in works:
                        work.wait()

    # --- state dicts --------------------------------------------------------------------

    def full_state(self, sharded: dict) -> dict:
        """The wrapped optimizer's state_dict as if it had stepped the parameters themselves
        (one entry per local parameter, full tensors), gathered from every rank's chunk."""
        per_param: dict[int, dict] = {}  # id(param) -> its state
        for j, flat in enumerate(self.groups):  # state index j: the j-th chunk of the param groups
            gathered = {k: self._gather(v, flat) for k, v in sharded["state"].get(j, {}).items()}
            for p, off in zip(flat.params, flat.offsets, strict=True):
                per_param[id(p)] = {
                    k: (
                        v[off : off + p.numel()].view_as(p).clone()
                        if _is_chunk(v, flat, flat.comm.size)
                        else v
                    )
                    for k, v in gathered.items()
                }
        state, groups, index = {}, [], 0
        for g, params in enumerate(self._order):
            ids = []
            for p in params:
                state[index] = per_param[id(p)]
                ids.append(index)
                index += 1
            groups.append({**sharded["param_groups"][g], "params": ids})
        return {"state": state, "param_groups": groups}

    def chunk_state(self, full: dict) -> dict:
        """The inverse of full_state: this rank's chunk of a per-parameter state_dict."""
        index_of, index = {}, 0
        for params in self._order:
            for p in params:
                index_of[id(p)] = index
                index += 1
        state, masters = {}, [[] for _ in self._order]
        for j, flat in enumerate(self.groups):
            masters[flat.param_group].append(j)
            per_param = [full["state"].get(index_of[id(p)], {}) for p in flat.params]
            keys = {k for s in per_param for k in s}
            chunk_state = {}
            for k in keys:
                values = [s.get(k) for s in per_param]
                pairs = zip(values, flat.params, strict=True)
                if all(isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in pairs):
                    whole = torch.zeros(flat.chunk * flat.comm.size, dtype=values[0].dtype)
                    for v, off in zip(values, flat.offsets, strict=True):
                        whole[off : off + v.numel()] = v.reshape(-1).cpu()
                    chunk_state[k] = whole[flat.lo : flat.lo + flat.chunk].to(flat.master.device).clone()
                else:
                    chunk_state[k] = next(v for v in values if v is not None)
            if chunk_state:
                state[j] = chunk_state
        groups = [{**full["param_groups"][g], "params": ids} for g, ids in enumerate(masters)]
        return {"state": state, "param_groups": groups}

    def _gather(self, value, flat: _FlatGroup):
        if not _is_chunk(value, flat, 1):
            return value
        if flat.comm.group is None:
            return value.detach().cpu()
        full = torch.empty(flat.chunk * flat.comm.size, dtype=value.dtype, device=value.device)
        dist.all_gather_into_tensor(full, value.detach().contiguous(), group=flat.comm.group)
        return full.cpu()


def _flat_group(comm: Comm, param_group: int, params: list[nn.Parameter], shard_grads: bool) -> _FlatGroup:
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    chunk = max(1, math.ceil(total / comm.size))
    lo = comm.rank * chunk
    values = _flatten(params, offsets, chunk * comm.size)
    master = values[lo : lo + chunk]
    master = nn.Parameter(master if values.dtype == torch.float32 else master.float())
    grads = None if shard_grads else torch.zeros_like(values, dtype=torch.float32)
    flat = _FlatGroup(comm, param_group, params, offsets, total, chunk, lo, values, master, grads)
    if shard_grads:
        master.grad = torch.zeros_like(master)  # the chunk's gradient, filled by GradSync
    flat.attach_grads()  # in fp32, takes in the gradients of the step that built the state
    return flat


# torch's optimizers whose fused kernels update a flat chunk in place with no temporaries.
_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def fuse_where_unset(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Steps the flat chunks with the optimizer's fused kernel where its user left the choice of
    implementation to torch (fused and foreach None, not differentiable). On one flat chunk,
    torch's default for-loop Adam allocates two temporaries the size of the chunk (for
    sqrt(v) / bias correction), 4 bytes per parameter at R = 2 on top of a floor of 12 in bf16;
    its foreach version one. Element-wise, the fused step is the same update, in one pass (and
    faster). Returns whether it did."""
    supported = getattr(torch_optimizer, "_get_fused_kernels_supported_devices", lambda: ["cuda"])
    if type(optimizer) not in _FUSED or device.type not in supported():
        return False
    groups = optimizer.param_groups
    if any(
        g.get("fused") is not None or g.get("foreach") is not None or g.get("differentiable") for g in groups
    ):
        return False
    for g in groups:
        g["fused"] = True
    return True


def _is_chunk(value, flat: _FlatGroup, factor: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == flat.chunk * factor


def _flatten(params: list[nn.Parameter], offsets: list[int], size: int) -> torch.Tensor:
    """One buffer of `size` elements holding the parameters end to end; each becomes a view of it."""
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ValueError(
            "smp: flat optimizer state (shard_optimizer_state, bf16, fp16) needs the parameters of a param "
            f"group in one dtype on one device, got {sorted(map(str, kinds))}"
        )
    dtype, device = kinds.pop() if kinds else (torch.float32, torch.device("cpu"))
    values = torch.zeros(size, dtype=dtype, device=device)
    with torch.no_grad():
        for p, off in zip(params, offsets, strict=True):
            view = values[off : off + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
    return values
