"""Running a checkpointed region: its forward keeps only its inputs, and backward recomputes
it (torch.utils.checkpoint, non-reentrant).

Two forms: `RecomputeRegion`, the submodule an outlined graph region becomes (models run as
captured graphs), and `checkpoint_forward`, which wraps an eager module's forward (models run
whole, data parallelism only).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from smp.recompute.offload import ActivationOffloader

_ORIGINAL_FORWARD = "_smp_original_forward"


def _run(fn, args, kwargs, preserve_rng_state: bool, offloader: ActivationOffloader | None):
    """fn(*args, **kwargs), recomputed in backward when grad is on (eval and no_grad run it plain)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    saving = offloader.saving() if offloader is not None else contextlib.nullcontext()
    with saving:  # the inputs checkpoint keeps are saved under the offloader's hooks
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)


class RecomputeRegion(nn.Module):
    """An outlined region of a stage graph; `body` holds its ops, which run again in backward."""

    def __init__(
        self,
        body: fx.GraphModule,
        label: str,
        preserve_rng_state: bool,
        offloader: ActivationOffloader | None,
    ):
        super().__init__()
        self.body = body
        self.label = label
        self.preserve_rng_state = preserve_rng_state
        self._offloader = offloader

    def forward(self, *args):
        return _run(self.body, args, {}, self.preserve_rng_state, self._offloader)

    def extra_repr(self) -> str:
        return f"{self.label}, preserve_rng_state={self.preserve_rng_state}"


def checkpoint_forward(
    module: nn.Module, preserve_rng_state: bool, offloader: ActivationOffloader | None
) -> None:
    """Makes `module`'s own forward recompute in backward (again: replaces the earlier wrap)."""
    original = module.__dict__.get(_ORIGINAL_FORWARD, module.forward)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        return _run(original, args, kwargs, preserve_rng_state, offloader)

    object.__setattr__(module, _ORIGINAL_FORWARD, original)
    object.__setattr__(module, "forward", forward)


def checkpoint_chain(
    sequential: nn.Sequential, groups: list[list[int]], preserve_rng_state: bool, offloader
) -> None:
    """Makes an nn.Sequential run its layers in the given groups, each recomputed as one region."""
    layers = list(sequential)

    def run_group(group, x):
        for i in group:
            x = layers[i](x)
        return x

    def forward(x):
        for group in groups:
            x = _run(functools.partial(run_group, group), (x,), {}, preserve_rng_state, offloader)
        return x

    object.__setattr__(sequential, "forward", forward)
