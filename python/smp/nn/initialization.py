"""How the smp.nn modules initialize their shards, as SMP v1 documents it.

- `use_normal_initialization=True`: weights drawn from N(0, initializer_range), biases zero.
  Otherwise torch's default for the dense layer (nn.Linear's uniform(-1/sqrt(fan_in), ...)),
  with the whole layer's fan-in.
- `initialize_with_same_seed=True` (and always at tp=1): every rank draws the whole weight from
  torch's global generator, the same on every rank after `smp.set_seed`, and keeps its slice, so
  the distributed module starts exactly as the dense one built with the same seed.
- Otherwise (SMP's default) each rank draws only its shard from a generator of its own seeded
  with `tensor_parallel_seed + tp_rank` (SMP's `smp.tensor_parallel_seed()`): shards differ,
  and the global generator, which replicated modules draw from, is left alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from smp import parallel_state
from smp.nn import tp_group

# One generator per process for shards drawn on their own, created at the first such draw:
# consecutive layers continue its stream, so no two layers get the same shard.
_shard_generator: dict[tuple[int, int], torch.Generator] = {}

Fill = Callable[[torch.Tensor, torch.Generator | None], None]


def shard_generator() -> torch.Generator:
    seed = parallel_state.state().config.tensor_parallel_seed
    key = (seed, tp_group.tp_rank())
    if key not in _shard_generator:
        _shard_generator.clear()
        _shard_generator[key] = torch.Generator().manual_seed(seed + tp_group.tp_rank())
    return _shard_generator[key]


def fill_shard(shard: torch.Tensor, dim: int | None, fill: Fill, same_seed: bool) -> None:
    """Initializes `shard`, this rank's slice along `dim` (None: not sharded) of a tensor whose
    whole shape is the shard's with `dim` times the degree."""
    size = tp_group.tp_size()
    with torch.no_grad():
        if dim is None or size == 1 or same_seed:
            shape = list(shard.shape)
            if dim is not None:
                shape[dim] *= size
            whole = torch.empty(shape, dtype=shard.dtype, device=shard.device)
            fill(whole, None)
            part = whole if dim is None else whole.chunk(size, dim)[tp_group.tp_rank()]
            shard.copy_(part)
            return
        generator = shard_generator()
        drawn = torch.empty(shard.shape, dtype=shard.dtype, device="cpu")
        fill(drawn, generator)
        shard.copy_(drawn)


def normal(std: float) -> Fill:
    return lambda t, g: t.normal_(0.0, std, generator=g)


def zeros() -> Fill:
    return lambda t, g: t.zero_()


def ones() -> Fill:
    return lambda t, g: t.fill_(1.0)


def kaiming_uniform(fan_in: int) -> Fill:
    """nn.Linear's default weight init (kaiming_uniform_ with a=sqrt(5)) for the whole layer's fan-in."""

    def fill(t: torch.Tensor, g: torch.Generator | None) -> None:
        if g is None and t.dim() == 2 and t.shape[1] == fan_in:
            torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5))  # the very call nn.Linear makes
        else:
            bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            t.uniform_(-bound, bound, generator=g)

    return fill


def linear_bias(fan_in: int) -> Fill:
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return lambda t, g: t.uniform_(-bound, bound, generator=g)
