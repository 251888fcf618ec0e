"""An experts module cut to this rank's experts, with a forward that exchanges the tokens.

The module keeps its class, its names and its gate (transformers' `_apply_gate`, `act_fn`); its
banks become this rank's block of experts (rows [rank * local, (rank + 1) * local) of dim 0) and
its forward becomes: smp::moe_dispatch (each (token, expert) pair to the rank holding the expert),
this rank's experts on the pairs they received, smp::moe_combine (outputs back, weighted, summed).

Under `compile` that forward runs eagerly between the compiled graphs (torch.compiler.disable):
how many pairs arrive is known only once the counts are exchanged, and AOTAutograd's trace of the
ops' backward would read the routes' host data.
"""

from __future__ import annotations

import dataclasses
import types

import torch
from torch import nn
from torch.nn import functional as F

import smp.ops  # noqa: F401  (torch.ops.smp's fake kernels)

_SLICE = "_smp_expert_slice"
_BANKS = "_smp_expert_banks"  # the names of the module's banks (and biases)


@dataclasses.dataclass(frozen=True)
class ExpertSlice:
    """Which experts a module holds: [start, start + local) of num_experts, exchanged over group."""

    num_experts: int
    start: int
    local: int
    group_name: str
    # What the banks' gradients are multiplied by on their way to the parameters: 1, or 1/ep where
    # the replicas' averaging divides by dp/ep only (FSDP2 over them: sharded_data_parallel_degree).
    grad_scale: float = 1.0
    # Tensor parallelism: the tp group whose ranks all receive the same tokens (None: no tp). Each
    # rank sends its part of them to the experts; the outputs are gathered over the group, and the
    # experts' gradients (each rank's part) are summed over it with the replicas' (EP_HOLDERS_GROUP).
    token_group: str | None = None
    token_parts: int = 1  # the tp group's size
    token_part: int = 0  # this rank's place in it


def expert_slice(module: nn.Module) -> ExpertSlice | None:
    """The experts a module holds, if smp divided it (else None)."""
    return getattr(module, _SLICE, None)


def keep_local_experts(module: nn.Module, banks: tuple[str, ...], piece: ExpertSlice) -> dict:
    """Cuts the module's banks to this rank's experts and gives it the exchanging forward; returns
    {full parameter: this rank's parameter} for those that follow the model's parameters."""
    moved = {}
    for name in banks:
        full = getattr(module, name)
        local = nn.Parameter(
            full.detach()[piece.start : piece.start + piece.local].clone(), requires_grad=full.requires_grad
        )
        setattr(module, name, local)
        moved[full] = local
    setattr(module, _SLICE, piece)
    setattr(module, _BANKS, banks)
    module.forward = types.MethodType(_exchanging_forward, module)
    return moved


@torch.compiler.disable  # (see the module's docstring: compile)
def _exchanging_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    banks = {name: getattr(self, name) for name in getattr(self, _BANKS)}
    return exchange(self, hidden_states, top_k_index, top_k_weights, banks)


def exchange(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    banks: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The experts module's output on its inputs, through this rank's experts (`banks`: its block
    of each bank, by name): each pair sent to the rank holding its expert, the outputs brought back,
    weighted and summed. Under tp (`ExpertSlice.token_group`) the ranks of a tp group, which hold
    the same tokens, each send their part of them (rows [r T/tp, (r+1) T/tp)) and gather the
    outputs: tp_split's backward gathers the inputs' gradients, tp_gather's takes the rank's part of
    the output's (the same on every rank). Tokens the group does not divide are padded with rows of
    weight 0, which add nothing to any output or gradient."""
    piece: ExpertSlice = getattr(module, _SLICE)
    if piece.token_group is None:
        return _exchange(module, piece, hidden_states, top_k_index, top_k_weights, banks)
    tokens, group = hidden_states.shape[0], piece.token_group
    pad = -tokens % piece.token_parts
    if pad:
        hidden_states, top_k_index, top_k_weights = (
            F.pad(t, (0, 0, 0, pad)) for t in (hidden_states, top_k_index, top_k_weights)
        )
    rows = hidden_states.shape[0] // piece.token_parts
    index = top_k_index[piece.token_part * rows : (piece.token_part + 1) * rows]
    hidden = smp.ops.tp_split(hidden_states, 0, group=group)
    weights = smp.ops.tp_split(top_k_weights, 0, group=group)
    out = _exchange(module, piece, hidden, index, weights, banks)
    return smp.ops.tp_gather(out, 0, group=group)[:tokens]


def _exchange(module, piece: ExpertSlice, hidden_states, top_k_index, top_k_weights, banks) -> torch.Tensor:
    routed, counts, route = torch.ops.smp.moe_dispatch(
        hidden_states, top_k_index, piece.num_experts, piece.group_name
    )
    if module.has_gate:
        up = _experts_linear(module, banks, routed, "gate_up_proj", counts)
        hidden = module._apply_gate(up)
    else:
        hidden = module.act_fn(_experts_linear(module, banks, routed, "up_proj", counts))
    out = _experts_linear(module, banks, hidden, "down_proj", counts)
    return smp.ops.moe_combine(out, top_k_weights, route, piece.group_name)


def split_tokens(module: nn.Module, group_name: str, parts: int, part: int) -> None:
    """From now on the module's tp group (`group_name`, `parts` ranks, this one `part`) sends each
    rank's part of its tokens to the experts (ExpertSlice.token_group)."""
    piece = getattr(module, _SLICE)
    setattr(
        module, _SLICE, dataclasses.replace(piece, token_group=group_name, token_parts=parts, token_part=part)
    )


def scale_gradients(module: nn.Module, factor: float) -> None:
    """From now on the module's banks' gradients are multiplied by `factor` (ExpertSlice.grad_scale)."""
    setattr(module, _SLICE, dataclasses.replace(getattr(module, _SLICE), grad_scale=factor))


def _experts_linear(
    module: nn.Module, banks: dict[str, torch.Tensor], x: torch.Tensor, name: str, counts: torch.Tensor
) -> torch.Tensor:
    """Rows of x (expert-major, `counts` per local expert) through their expert's matrix (+ bias)."""
    scale = getattr(module, _SLICE).grad_scale
    bank = _ScaledGrad.apply(banks[name], scale) if scale != 1.0 else banks[name]
    weight = bank if module.is_transposed else bank.transpose(-2, -1)  # [local, in, out]
    out = grouped_matmul(x.to(weight.dtype), weight, counts)
    if module.has_bias:
        bias = banks[f"{name}_bias"]
        bias = _ScaledGrad.apply(bias, scale) if scale != 1.0 else bias
        out = out + bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
    return out


class _ScaledGrad(torch.autograd.Function):
    """The identity, whose gradient is multiplied by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x's rows by group (`counts` rows each, in order) times their group's [in, out] matrix: one
    grouped matmul where torch has a kernel for it (bf16 on CUDA), a loop over the groups elsewhere."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return torch._grouped_mm(x, weight, offs=offsets)
    parts = torch.split(x, counts.tolist())
    return torch.cat([part @ weight[e] for e, part in enumerate(parts)])
