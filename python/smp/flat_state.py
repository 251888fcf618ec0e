"""fp32 master copies of a rank's parameters, flattened per param group and cut across the
reduced-data-parallel group (ZeRO-1), for smp.DistributedOptimizer.

Each param group's local parameters (this rank's stage, its tensor-parallel shards) are
laid end to end in one flat vector, padded to a multiple of the group size R. Rank r of
the group owns elements [r*c, (r+1)*c) with c = padded/R: it holds the fp32 master copy
of that chunk, and the wrapped torch optimizer, whose param group now holds just that
chunk, keeps its state (Adam's moments, momentum) for it alone. A step takes the chunk of
the (already data-parallel-averaged) gradients, updates the chunk, and all-gathers the
chunks back into the parameters. Without sharding (R = 1) the same code holds fp32
master weights for bf16/fp16 training. Element-wise optimizers (SGD, Adam, AdamW, ...)
update a flat chunk exactly as they update the separate parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


@dataclasses.dataclass
class _FlatGroup:
    params: list[nn.Parameter]
    offsets: list[int]  # start of each parameter in the flat vector
    numel: int  # without padding
    chunk: int  # elements per rank
    lo: int  # where this rank's chunk starts
    master: nn.Parameter  # this rank's chunk, fp32
    gathered: torch.Tensor | None = None  # the all-gather's buffer, kept across steps

    def overlaps(self):
        """(param, start in param, start in chunk, length) for each parameter overlapping the chunk."""
        lo, hi = self.lo, self.lo + self.chunk
        for p, off in zip(self.params, self.offsets, strict=True):
            start, end = max(off, lo), min(off + p.numel(), hi)
            if start < end:
                yield p, start - off, start - lo, end - start


class FlatState:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group: dist.ProcessGroup | None,
        ranks: list[int],
    ):
        if any(optimizer.state.values()):
            raise RuntimeError(
                "smp: the optimizer already holds state (it stepped before the model's first step); "
                "with shard_optimizer_state, bf16 or fp16 build it from model.parameters() and step it "
                "only through smp.DistributedOptimizer"
            )
        self._group = group if len(ranks) > 1 else None
        self._size = len(ranks)
        self._rank = ranks.index(dist.get_rank()) if len(ranks) > 1 else 0
        self.groups: list[_FlatGroup] = []
        for param_group in optimizer.param_groups:
            params = list(param_group["params"])
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += p.numel()
            chunk = max(1, math.ceil(total / self._size))
            lo = self._rank * chunk
            device = params[0].device if params else torch.device("cpu")
            master = torch.zeros(chunk, dtype=torch.float32, device=device)
            flat = _FlatGroup(params, offsets, total, chunk, lo, nn.Parameter(master))
            with torch.no_grad():
                for p, p_start, c_start, n in flat.overlaps():
                    master[c_start : c_start + n] = p.detach().reshape(-1)[p_start : p_start + n].float()
            param_group["params"] = [flat.master]
            self.groups.append(flat)
        optimizer.state.clear()

    # --- gradients --------------------------------------------------------------------

    def load_grads(
        self, grad_of: Callable[[nn.Parameter], torch.Tensor | None], scale: float, check: bool
    ) -> bool:
        """Sets each master chunk's grad from the parameters' gradients (divided by `scale`);
        with `check`, returns whether this rank saw an inf or nan (a sum is enough to tell)."""
        overflow = False
        for flat in self.groups:
            grad = flat.master.grad if flat.master.grad is not None else torch.empty_like(flat.master)
            grad.zero_()  # reused across steps, like the gather buffer
            for p, p_start, c_start, n in flat.overlaps():
                g = grad_of(p)
                if g is not None:
                    grad[c_start : c_start + n] = g.reshape(-1)[p_start : p_start + n]
            if scale != 1.0:
                grad.div_(scale)
            if check:
                overflow = overflow or not bool(torch.isfinite(grad.sum()))
            flat.master.grad = grad
        return overflow

    def zero_grad(self) -> None:
        for flat in self.groups:
            flat.master.grad = None

    def squared_norm(self, counts: Callable[[nn.Parameter], bool]) -> torch.Tensor:
        """Sum of squared master gradients over the parameters this rank counts."""
        total = torch.zeros((), dtype=torch.float64)
        for flat in self.groups:
            if flat.master.grad is None:
                continue
            for p, _, c_start, n in flat.overlaps():
                if counts(p):
                    total += flat.master.grad[c_start : c_start + n].double().pow(2).sum().cpu()
        return total

    def scale_grads(self, factor: float) -> None:
        for flat in self.groups:
            if flat.master.grad is not None:
                flat.master.grad.mul_(factor)

    # --- parameters -------------------------------------------------------------------

    def publish(self) -> None:
        """Copies the updated master chunks into the parameters (all-gathered across the group)."""
        with torch.no_grad():
            for flat in self.groups:
                if not flat.params:
                    continue
                dtype = flat.params[0].dtype
                local = flat.master.detach().to(dtype)
                if self._group is None:
                    full = local
                else:
                    # One buffer per group for the whole run: a fresh one costs page faults every step.
                    if flat.gathered is None:
                        flat.gathered = torch.empty(flat.chunk * self._size, dtype=dtype, device=local.device)
                    full = flat.gathered
                    dist.all_gather_into_tensor(full, local, group=self._group)
                for p, off in zip(flat.params, flat.offsets, strict=True):
                    p.copy_(full[off : off + p.numel()].view_as(p))

    # --- state dicts --------------------------------------------------------------------

    def full_state(self, sharded: dict) -> dict:
        """The wrapped optimizer's state_dict as if it had stepped the parameters themselves
        (one entry per local parameter, full tensors), gathered from every rank's chunk."""
        state, index = {}, 0
        groups = []
        for i, flat in enumerate(self.groups):
            chunk_state = sharded["state"].get(i, {})
            gathered = {k: self._gather(v, flat) for k, v in chunk_state.items()}
            ids = []
            for p, off in zip(flat.params, flat.offsets, strict=True):
                state[index] = {
                    k: (v[off : off + p.numel()].view_as(p).clone() if _is_chunk(v, flat, self._size) else v)
                    for k, v in gathered.items()
                }
                ids.append(index)
                index += 1
            groups.append({**sharded["param_groups"][i], "params": ids})
        return {"state": state, "param_groups": groups}

    def chunk_state(self, full: dict) -> dict:
        """The inverse of full_state: this rank's chunk of a per-parameter state_dict."""
        state, groups, index = {}, [], 0
        for i, flat in enumerate(self.groups):
            per_param = [full["state"].get(index + j, {}) for j in range(len(flat.params))]
            keys = {k for s in per_param for k in s}
            chunk_state = {}
            for k in keys:
                values = [s.get(k) for s in per_param]
                pairs = zip(values, flat.params, strict=True)
                if all(isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in pairs):
                    whole = torch.zeros(flat.chunk * self._size, dtype=values[0].dtype)
                    for v, off in zip(values, flat.offsets, strict=True):
                        whole[off : off + v.numel()] = v.reshape(-1).cpu()
                    chunk_state[k] = whole[flat.lo : flat.lo + flat.chunk].to(flat.master.device).clone()
                else:
                    chunk_state[k] = next(v for v in values if v is not None)
            if chunk_state:
                state[i] = chunk_state
            index += len(flat.params)
            groups.append({**full["param_groups"][i], "params": [i]})
        return {"state": state, "param_groups": groups}

    def _gather(self, value, flat: _FlatGroup):
        if not _is_chunk(value, flat, 1):
            return value
        if self._group is None:
            return value.detach().cpu()
        full = torch.empty(flat.chunk * self._size, dtype=value.dtype, device=value.device)
        dist.all_gather_into_tensor(full, value.detach().contiguous(), group=self._group)
        return full.cpu()


def _is_chunk(value, flat: _FlatGroup, factor: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == flat.chunk * factor
