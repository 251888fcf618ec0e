"""The router's auxiliary (load-balancing) loss over the global batch, as one process computes it.

transformers' MoE models add `coef * load_balancing_loss_func(router_logits, ...)` to the loss:
`num_experts * sum_e f_e * P_e`, f the share of top-k picks per expert and P the mean router
probability per expert, over every token of the batch. That is not linear in the batch: the mean of
each replica's loss on its own slice differs from the loss on the global batch. Here, while a model
smp divided runs, the function sums the picks, the probabilities and the rows over the
data-parallel group first. The sum of the probabilities is all-reduced with an all-reduce in its
backward too: every replica's loss holds the same global term, and the data-parallel average of
their gradients is then the global loss's gradient (each replica's router sees d loss / d P summed
over the replicas, which the average divides back).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn

from smp import ops

_NAME = "load_balancing_loss_func"
_active = threading.local()  # .group: the data-parallel group while a divided model runs


def global_router_losses(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Makes the auxiliary loss of `model`'s modeling code global while `model` runs."""
    modeling = sys.modules.get(type(model).__module__)
    original = getattr(modeling, _NAME, None)
    if original is None:
        return  # no auxiliary loss in this model's code
    if not getattr(original, "_smp_global", False):
        setattr(modeling, _NAME, _globalized(original))
    forward = model.forward

    @functools.wraps(forward)
    def running(*args, **kwargs):
        with _over(group):
            return forward(*args, **kwargs)

    model.forward = running


@contextlib.contextmanager
def _over(group: dist.ProcessGroup):
    before = getattr(_active, "group", None)
    _active.group = group
    try:
        yield
    finally:
        _active.group = before


def _globalized(original):
    @functools.wraps(original)
    def loss(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        group = getattr(_active, "group", None)
        if group is None or not isinstance(gate_logits, tuple) or dist.get_world_size(group) == 1:
            return original(gate_logits, num_experts, top_k, attention_mask)
        return _global_loss(gate_logits, num_experts, top_k, attention_mask, group)

    loss._smp_global = True
    return loss


def _global_loss(gate_logits, num_experts, top_k, attention_mask, group) -> torch.Tensor:
    device = gate_logits[0].device
    picks = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for layer_logits in gate_logits:
        weights = torch.softmax(layer_logits.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        keep = torch.ones(weights.shape[0], device=device) if mask is None else mask
        picks = picks.scatter_add(0, chosen.reshape(-1), keep.repeat_interleave(top_k))
        probs = probs + (weights.float() * keep.unsqueeze(-1)).sum(dim=0)
        rows = rows + keep.sum()
    with torch.no_grad():
        dist.all_reduce(picks, group=group)
        dist.all_reduce(rows, group=group)
    # Summed forward (tp_reduce) and backward (tp_copy): every replica's loss holds the global term.
    probs = ops.tp_reduce(ops.tp_copy(probs, group), group)
    return torch.sum((picks / rows) * (probs / rows).unsqueeze(0)) * num_experts
