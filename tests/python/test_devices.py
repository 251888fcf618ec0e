"""Which device each process uses (smp.devices, called by smp.init): one process per GPU, processes
sharing GPUs (the README's first command on a machine with one GPU), CPU processes. The decision is
a function of plain values, tested here without a GPU; the GPU peers are counted through a real
store (torch's HashStore, shared by threads standing in for a host's processes)."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist
from smp import devices

SHARING = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def test_no_gpu_means_cpu():
    for local_rank in range(4):
        assert devices.decide(local_rank, 4, 0, {}) == devices.Placement(None)


@pytest.mark.parametrize("local_size", [1, 2, 4])
def test_one_process_per_gpu_uses_its_own_and_leaves_nccl_alone(local_size):
    for local_rank in range(local_size):
        assert devices.decide(local_rank, local_size, 4, {}, "h") == devices.Placement(local_rank)


def test_readme_command_on_one_gpu_shares_it_and_says_so_once():
    """torchrun --nproc_per_node=4 on a machine with one GPU: NCCL would refuse it (Duplicate GPU)."""
    placements = [devices.decide(r, 4, 1, {}, "node7") for r in range(4)]
    assert [p.cuda_index for p in placements] == [0, 0, 0, 0]
    assert all(p.shared for p in placements)
    hostids = [p.env.pop("NCCL_HOSTID") for p in placements]
    assert len(set(hostids)) == 4 and all(h.startswith("node7-") for h in hostids)  # per process, per host
    assert all(p.env == SHARING for p in placements)
    warning = placements[0].warning
    assert warning and "\n" not in warning  # one line, from local rank 0 only
    assert all(p.warning is None for p in placements[1:])
    for words in ("4 processes", "4 of them", "cuda:0", "network transport"):
        assert words in warning, warning
    assert "--nproc_per_node" in warning and 'CUDA_VISIBLE_DEVICES=""' in warning  # the two ways out


def test_more_processes_than_gpus_spread_over_them():
    placements = [devices.decide(r, 6, 4, {}, "h") for r in range(6)]
    assert [p.cuda_index for p in placements] == [0, 1, 2, 3, 0, 1]
    # cuda:0 and cuda:1 have two processes each, cuda:2 and cuda:3 one.
    assert [p.shared for p in placements] == [True, True, False, False, True, True]
    assert "2 of them" in placements[0].warning
    assert placements[2].env == {} and placements[3].env == {}


def test_variables_the_user_set_stay():
    env = {"NCCL_HOSTID": "mine", "NCCL_P2P_DISABLE": "0"}
    placement = devices.decide(1, 4, 1, env, "h")
    assert placement.shared and placement.env == {"NCCL_SHM_DISABLE": "1"}


def test_with_cuda_visible_devices_the_processes_count_their_gpu_peers():
    """A launcher that gives each process its own GPU (one visible each) must keep NCCL's fast
    paths; one that gives the whole job one GPU must share it. Only comparing tells them apart."""
    env = {"CUDA_VISIBLE_DEVICES": "3"}
    assert devices.must_count_peers(8, 1, env)
    assert not devices.must_count_peers(8, 1, {})  # every process sees the same GPUs: counts decide
    assert not devices.must_count_peers(8, 8, env)  # enough GPUs for one each
    assert not devices.must_count_peers(8, 0, {"CUDA_VISIBLE_DEVICES": ""})  # hidden: CPU
    assert devices.decide(5, 8, 1, env, "h", gpu_peers=1) == devices.Placement(0)
    shared = devices.decide(5, 8, 1, env, "h", gpu_peers=8)
    assert shared.shared and shared.cuda_index == 0 and set(shared.env) == {"NCCL_HOSTID", *SHARING}
    assert devices.decide(5, 8, 1, env, "h") == devices.Placement(0)  # not counted: left alone


def test_gpu_peers_counted_through_the_store():
    store = dist.HashStore()
    gpus = ["uuid-a", "uuid-a", "uuid-b", "uuid-a"]
    counts = [None] * len(gpus)

    def process(i):
        counts[i] = devices.count_gpu_peers(store, "smp/devices/1/h", len(gpus), gpus[i])

    threads = [threading.Thread(target=process, args=(i,)) for i in range(len(gpus))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert counts == [3, 3, 1, 3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_place_without_a_gpu_changes_nothing(monkeypatch):
    for name in ("NCCL_HOSTID", *SHARING):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    assert devices.place(0, 4) == devices.Placement(None)
    assert dict(os.environ) == before
