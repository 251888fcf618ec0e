"""The throttle end to end, over real process groups.

On CPU the throttle is opt-in (SMP_GLOO_THROTTLE_LIMIT); the same C++ unit
bounds NCCL work (SMP_NCCL_THROTTLE_LIMIT), which the CUDA test covers where a
GPU exists: two NCCL ranks, on one GPU each or sharing the only one.
"""

from __future__ import annotations

import datetime
import os
import re
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist
from harness import RankFailure, run_ranks

N_OPS = 100
NUMEL = 64 * 1024  # 256 KiB of float32: slow enough for a queue to build


def many_async_all_reduces(rank, world_size):
    import smp

    tensors = [torch.full((NUMEL,), float(rank + i)) for i in range(N_OPS)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for w in works:
        w.wait()
    # Reference: sum over ranks of (rank + i) = i*W + W(W-1)/2.
    for i, t in enumerate(tensors):
        expected = float(i * world_size + world_size * (world_size - 1) // 2)
        assert torch.equal(t, torch.full((NUMEL,), expected)), (i, t[:4])
    return smp.backend_stats()["cpu"]


def test_limit_bounds_outstanding_and_results_stay_right():
    stats = run_ranks(many_async_all_reduces, 2, env={"SMP_GLOO_THROTTLE_LIMIT": "4"})
    for s in stats:
        assert s["limit"] == 4
        assert s["launched"] == N_OPS
        assert s["peak_outstanding"] <= 4
        assert s["throttle_waits"] > 0
        assert s["seconds_blocked"] > 0


def test_disabled_lets_outstanding_grow_past_the_limit():
    stats = run_ranks(many_async_all_reduces, 2, env={"SMP_GLOO_THROTTLE_LIMIT": "-1"})
    for s in stats:
        assert s["limit"] == -1
        assert s["throttle_waits"] == 0
    assert max(s["peak_outstanding"] for s in stats) > 4


def mixed_async_ops(rank, world_size):
    import smp

    ones = torch.ones(world_size * 256)
    outs = [torch.empty(256) for _ in range(40)]
    works = []
    for i, out in enumerate(outs):
        # Gloo's reduce_scatter work never reports is_completed(); the throttle
        # must still get its slot back (it blocks with wait() on CPU).
        works.append(dist.reduce_scatter_tensor(out, ones * (i + 1), async_op=True))
        works.append(dist.all_reduce(torch.ones(256), async_op=True))
    for w in works:
        w.wait()
    for i, out in enumerate(outs):
        assert torch.equal(out, torch.full((256,), float(world_size * (i + 1))))
    return smp.backend_stats()["cpu"]


def test_every_op_kind_gives_its_slot_back():
    stats = run_ranks(mixed_async_ops, 2, env={"SMP_GLOO_THROTTLE_LIMIT": "2"})
    for s in stats:
        assert s["launched"] == 80
        assert s["peak_outstanding"] <= 2
        assert s["outstanding"] == 0  # every waited op reads as finished


def init_expecting_error(rank, world_size, variable, init_file):
    import smp  # noqa: F401

    with pytest.raises(ValueError) as info:
        dist.init_process_group("smp", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    return str(info.value)


@pytest.mark.parametrize("variable", ["SMP_NCCL_THROTTLE_LIMIT", "SMP_GLOO_THROTTLE_LIMIT"])
@pytest.mark.parametrize("value", ["0", "abc", "-5"])
def test_invalid_limit_is_rejected_when_the_group_is_created(variable, value):
    with tempfile.TemporaryDirectory() as tmp:
        (message,) = run_ranks(
            init_expecting_error,
            1,
            variable,
            os.path.join(tmp, "store"),
            env={variable: value},
            init=False,
        )
    assert f"{variable}='{value}'" in message
    assert "positive integer" in message and "-1 to disable" in message


def stuck_peer(rank, world_size, throttled):
    """Rank 1 never joins but stays alive; rank 0 must fail by the group timeout, named."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["rank0_done"], datetime.timedelta(seconds=60))
        return "idle"
    try:
        if throttled:
            # The all_reduce occupies the only slot; the broadcast blocks on it
            # in the throttle and must raise there, naming itself, when the
            # all_reduce times out.
            w = dist.all_reduce(torch.ones(4), async_op=True)
            with pytest.raises(RuntimeError) as info:
                dist.broadcast(torch.ones(4), group_src=0, async_op=True)
            # The all_reduce's own handle gives its error at once: the
            # throttle's wait was its wait, not a second full timeout.
            start = time.monotonic()
            with pytest.raises(RuntimeError, match="smp: all_reduce on process group '0'"):
                w.wait()
            assert time.monotonic() - start < 1.0
        else:
            with pytest.raises(RuntimeError) as info:
                dist.all_reduce(torch.ones(4))
    finally:
        store.set("rank0_done", "1")
    return str(info.value)


@pytest.mark.parametrize("throttled", [False, True], ids=["plain", "throttled"])
def test_timed_out_operation_raises_naming_op_and_group(throttled):
    env = {"SMP_GLOO_THROTTLE_LIMIT": "1"} if throttled else {}
    messages = run_ranks(stuck_peer, 2, throttled, env=env, group_timeout=3, timeout=60)
    assert messages[1] == "idle"
    if throttled:
        assert re.match(
            r"smp: broadcast on process group '0' \(cpu/gloo\) timed out while the throttle "
            r"\(SMP_GLOO_THROTTLE_LIMIT=1\) waited for the oldest outstanding operation "
            r"\(all_reduce, operation #\d+ of this group, launched \d+ ms earlier\), which did not "
            r"complete within 3000 ms",
            messages[0],
        ), messages[0]
    else:
        assert "smp: all_reduce on process group '0' (cpu/gloo)" in messages[0], messages[0]


def stats_of_foreign_group(rank, world_size):
    import smp

    gloo = dist.new_group([0, 1], backend="gloo")
    with pytest.raises(ValueError, match="not 'smp'"):
        smp.backend_stats(gloo)
    return smp.backend_stats()["cpu"]["limit"]


def test_backend_stats_rejects_groups_of_other_backends():
    assert run_ranks(stats_of_foreign_group, 2) == [-1, -1]


def test_harness_reports_a_hang_as_failure():
    with pytest.raises(RankFailure, match="did not report"):
        run_ranks(stuck_forever, 2, timeout=8, group_timeout=600)


def stuck_forever(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins, yet stays alive
    else:
        threading.Event().wait()


CUDA_OPS = 100
CUDA_NUMEL = 8 << 20  # 32 MiB of float32: an all_reduce long enough for the queue to build
CUDA_LIMIT = 2


def cuda_many_async_all_reduces(rank, world_size):
    """100 async all_reduces of 32 MiB over NCCL, launched before any is waited on."""
    import smp

    shared = torch.cuda.device_count() < world_size
    if shared:  # ranks share a GPU: one NCCL "host" per rank, NCCL's network transport over loopback
        os.environ["NCCL_HOSTID"] = f"smp-throttle-rank-{rank}"
    torch.cuda.set_device(0 if shared else rank)
    tensors = [torch.full((CUDA_NUMEL,), float(rank + i), device="cuda") for i in range(CUDA_OPS)]
    torch.cuda.synchronize()
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    # Sum over ranks of (rank + i) = i*W + W(W-1)/2, as on the CPU.
    wrong = [
        i
        for i, t in enumerate(tensors)
        if not torch.equal(t, torch.full_like(t, float(i * world_size + world_size * (world_size - 1) // 2)))
    ]
    return {"wrong": wrong} | smp.backend_stats()["cuda"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("limit", [CUDA_LIMIT, -1], ids=["limit2", "disabled"])
def test_cuda_nccl_throttle_two_ranks(limit):
    """Two NCCL ranks (sharing one GPU where there is only one): real concurrency, so collectives
    queue up. At a low limit the throttle holds the queue to the limit and waits; disabled, the
    queue grows past it. Every sum is right either way."""
    env = {"SMP_NCCL_THROTTLE_LIMIT": str(limit)}
    if torch.cuda.device_count() < 2:
        env |= {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    try:
        stats = run_ranks(cuda_many_async_all_reduces, 2, env=env, timeout=240, group_timeout=120)
    except RankFailure as failure:
        if torch.cuda.device_count() < 2 and "Duplicate GPU" in str(failure):
            pytest.skip(f"NCCL refused 2 ranks on one GPU: {str(failure)[-600:]}")
        raise
    print(f"cuda throttle, SMP_NCCL_THROTTLE_LIMIT={limit}: {stats}")
    for s in stats:
        assert s["wrong"] == [], s
        assert s["limit"] == limit
        assert s["launched"] == CUDA_OPS
        assert s["outstanding"] == 0
    if limit > 0:
        for s in stats:
            assert s["peak_outstanding"] <= limit, s
            assert s["throttle_waits"] > 0, s
    else:
        for s in stats:
            assert s["throttle_waits"] == 0, s
        assert max(s["peak_outstanding"] for s in stats) > CUDA_LIMIT, stats


def test_smp_backend_is_registered_for_cpu_and_cuda():
    import smp

    assert smp.BACKEND_NAME == "smp"
    assert dist.Backend.backend_capability["smp"] == ["cpu", "cuda"]
