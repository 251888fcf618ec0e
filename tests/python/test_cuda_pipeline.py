"""Pipelines on CUDA tensors over NCCL (the ordered message path, no host staging), where a GPU is
available: pp = 2 under every schedule and pp = 2 x tp = 2 with sharded optimizer state, each
trained 3 Adam steps against one process on the CPU.

NCCL refuses two ranks on one GPU of one host. With fewer GPUs than ranks, each rank reports a
host of its own (NCCL_HOSTID) and NCCL's network transport over loopback is used
(NCCL_P2P_DISABLE, NCCL_SHM_DISABLE): if NCCL refuses even that, the test is skipped with what
NCCL answered. Skipped without CUDA (the CPU suite runs the same ordered path over Gloo).
"""

from __future__ import annotations

import os

import pipeline_cases
import pytest
import torch
from harness import RankFailure, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# CUDA's fp32 kernels add in other orders than the CPU reference's (TF32 stays off for fp32).
TOL = 1e-4

PP2 = {"pipeline_parallel_degree": 2, "microbatches": 4}
PP2_TP2 = PP2 | {"tensor_parallel_degree": 2, "shard_optimizer_state": True}


def _train_on_cuda(rank, world_size, configs):
    if torch.cuda.device_count() < world_size:  # ranks share a GPU: one NCCL "host" per rank
        os.environ["NCCL_HOSTID"] = f"smp-test-rank-{rank}"
        os.environ["NCCL_P2P_DISABLE"] = "1"
        os.environ["NCCL_SHM_DISABLE"] = "1"
    results = pipeline_cases.train_smp(rank, world_size, "gpt", configs, 3, 8)
    keep = ("loss_err", "param_err", "grad_err")
    on_gpu = torch.cuda.max_memory_allocated() > 0
    return [{k: r[k] for k in keep} | {"on_gpu": on_gpu} for r in results]


def _run(world: int, configs: list[dict]):
    try:
        return run_ranks(_train_on_cuda, world, configs, timeout=600)
    except RankFailure as failure:
        answer = str(failure)
        if torch.cuda.device_count() < world and "Duplicate GPU" in answer:
            pytest.skip(f"NCCL refused {world} ranks on {torch.cuda.device_count()} GPU(s): {answer[-600:]}")
        raise


@pytest.mark.parametrize(
    ("world", "configs"),
    [
        (2, [PP2 | {"pipeline": name} for name in ("interleaved", "simple", "zero_bubble", "zero_bubble_v")]),
        (4, [PP2_TP2 | {"pipeline": name} for name in ("interleaved", "zero_bubble_v")]),
    ],
    ids=["pp2", "pp2_tp2"],
)
def test_cuda_pipeline_over_nccl_trains_like_one_process(world, configs):
    for results in _run(world, configs):
        for config, r in zip(configs, results, strict=True):
            assert r["on_gpu"], (config, r)
            for key in ("loss_err", "param_err", "grad_err"):
                assert r[key] < TOL, (config, key, r)
