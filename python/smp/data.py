"""Data helpers that apply SMP's data advice by construction.

- Shard by the right ranks: every rank of one model replica (all pipeline stages,
  and the TP group when prescaled_batch is on) must read the same samples in the
  same order. Without prescaled_batch each TP rank reads its own samples, so data
  is sharded over the DP group (dp_rank / dp_size); with it, over the RDP group.
- Every batch divides by microbatches: drop_last=True, and a batch size that does
  not divide is refused up front.
- Seeds: shuffling is seeded identically on every rank (the sampler shards after
  shuffling), so replicas never overlap and stages agree.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from smp import parallel_state


def data_parallel_coords() -> tuple[int, int]:
    """(index, count) of this rank's data shard: (dp_rank, dp_size), or (rdp_rank, rdp_size) if prescaled."""
    if parallel_state.state().config.prescaled_batch:
        return parallel_state.rdp_rank(), parallel_state.rdp_size()
    return parallel_state.dp_rank(), parallel_state.dp_size()


def sampler(dataset: Dataset, shuffle: bool = True, seed: int = 0) -> DistributedSampler:
    """A DistributedSampler over this rank's data shard, with drop_last so every rank takes as many steps."""
    index, count = data_parallel_coords()
    return DistributedSampler(
        dataset, num_replicas=count, rank=index, shuffle=shuffle, seed=seed, drop_last=True
    )


def data_loader(
    dataset: Dataset, batch_size: int, shuffle: bool = True, seed: int = 0, **kwargs: Any
) -> DataLoader:
    """A DataLoader over this rank's shard whose every batch divides by microbatches.

    Call `loader.sampler.set_epoch(epoch)` each epoch for a new shuffle.
    """
    microbatches = parallel_state.num_microbatches()
    if batch_size % microbatches:
        raise ValueError(
            f"batch size {batch_size} does not divide by microbatches={microbatches}; use a batch size "
            f"that is a multiple of {microbatches} (e.g. {(batch_size // microbatches + 1) * microbatches})"
        )
    for key in ("sampler", "shuffle", "drop_last"):
        if key in kwargs:
            raise ValueError(f"smp.data_loader sets '{key}' itself; remove it from the arguments")
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler(dataset, shuffle, seed), drop_last=True, **kwargs
    )


def data_seed(seed: int) -> int:
    """The seed for this rank's own data randomness (augmentation): one per data shard."""
    return seed + data_parallel_coords()[0]


def tensor_parallel_seed() -> int:
    """The seed for initializing this rank's tensor-parallel shard: tensor_parallel_seed + tp_rank."""
    return parallel_state.state().config.tensor_parallel_seed + parallel_state.tp_rank()


def set_seed(seed: int) -> None:
    """Seeds random, numpy and torch with `seed` on every rank.

    Every rank builds the same model this way: smp partitions and shards the
    module the user built, so all ranks must construct identical weights. (SMP v1
    re-initialized TP shards and so advised `torch.manual_seed(42 + smp.dp_rank())`;
    smp slices the original weights instead.) Use data_seed() for data randomness
    and tensor_parallel_seed() for shard initialization.
    """
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)
