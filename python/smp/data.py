"""Data helpers that apply SMP's data advice by construction.

- Shard by the right ranks: every rank of one model replica (all pipeline stages,
  and the TP group when prescaled_batch is on) must read the same samples in the
  same order. Without prescaled_batch each TP rank reads its own samples, so data
  is sharded over the DP group (dp_rank / dp_size); with it, over the RDP group.
- Every batch divides by microbatches: drop_last=True, and a batch size that does
  not divide is refused up front.
- Seeds: shuffling is seeded identically on every rank (the sampler shards after
  shuffling), so replicas never overlap and stages agree.
- Resuming: a loader from data_loader() keeps its place in checkpoints (it registers itself with
  smp.register_stateful): the place is a count of samples of the global order, so a resume on
  fewer or more replicas with the same global batch reads exactly the samples an uninterrupted
  run would have read next.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from smp import parallel_state
from smp.state import rank_state


def data_parallel_coords() -> tuple[int, int]:
    """(index, count) of this rank's data shard: (dp_rank, dp_size), or (rdp_rank, rdp_size) if prescaled."""
    if parallel_state.state().config.prescaled_batch:
        return parallel_state.rdp_rank(), parallel_state.rdp_size()
    return parallel_state.dp_rank(), parallel_state.dp_size()


class ResumableSampler(DistributedSampler):
    """DistributedSampler (drop_last) that can start an epoch at a place in its global order: the
    epoch's permutation (seed + epoch) is the same on every rank and at every replica count, each
    rank taking every num_replicas-th index of it from `start` on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0  # samples of the global order already read this epoch

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = 0

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            order = list(range(len(self.dataset)))
        return order[: len(order) - len(order) % self.num_replicas]  # every rank takes as many

    def __iter__(self):
        return iter(self._order()[self.start + self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return (len(self._order()) - self.start) // self.num_replicas


class ResumableLoader(DataLoader):
    """A DataLoader whose state (epoch, samples of the global order read) resumes on any number of
    replicas with the same global batch (the same state on every rank: `smp_global_state`)."""

    smp_global_state = True

    def __iter__(self):
        sampler, count = self.sampler, itertools.count(1)
        start = sampler.start
        for batch, n in zip(super().__iter__(), count, strict=False):
            sampler.start = start + n * self.batch_size * sampler.num_replicas  # read: counted
            yield batch
        sampler.start = 0

    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch, "start": self.sampler.start, "seed": self.sampler.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.sampler.seed:
            raise ValueError(
                f"smp.data_loader: the checkpoint's loader was seeded {state['seed']}, this one "
                f"{self.sampler.seed}; resume with the seed the run started with"
            )
        self.sampler.epoch, self.sampler.start = state["epoch"], state["start"]


def sampler(dataset: Dataset, shuffle: bool = True, seed: int = 0) -> ResumableSampler:
    """A DistributedSampler over this rank's data shard, with drop_last so every rank takes as many steps."""
    index, count = data_parallel_coords()
    return ResumableSampler(
        dataset, num_replicas=count, rank=index, shuffle=shuffle, seed=seed, drop_last=True
    )


def data_loader(
    dataset: Dataset, batch_size: int, shuffle: bool = True, seed: int = 0, **kwargs: Any
) -> DataLoader:
    """A DataLoader over this rank's shard whose every batch divides by microbatches, and whose
    place is kept in checkpoints (registered as "smp.data_loader.<n>", n counting this process's
    loaders).

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
    loader = ResumableLoader(
        dataset, batch_size=batch_size, sampler=sampler(dataset, shuffle, seed), drop_last=True, **kwargs
    )
    rank_state.register_numbered("smp.data_loader", loader)
    return loader


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
