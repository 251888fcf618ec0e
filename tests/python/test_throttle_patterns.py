"""Every collective and point-to-point pattern through the CPU throttle (issue 22).

The same C++ throttle bounds NCCL work, so its rules are exercised here on Gloo.
Each test is one launch of real processes: SMP_GLOO_THROTTLE_LIMIT is read when
a group is created, so each rank creates one group per limit (1, 2, 8) and runs
every pattern on each. Values are checked against expectations computed from
the ranks' inputs, never from another collective. The groups' timeout is short,
so a throttle deadlock fails in seconds instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
from harness import run_ranks

LIMITS = (1, 2, 8)
GROUP_TIMEOUT = 10  # seconds; every pattern takes milliseconds
N = 6


def make(rank: int, salt: int = 0, n: int = N) -> torch.Tensor:
    """Rank `rank`'s input number `salt`: distinct per rank and salt, increasing in rank."""
    return torch.arange(n, dtype=torch.float32) * (salt + 1) + 100.0 * rank + salt


def groups_per_limit(world_size: int) -> dict[int, dist.ProcessGroup]:
    groups = {}
    for limit in LIMITS:
        os.environ["SMP_GLOO_THROTTLE_LIMIT"] = str(limit)
        groups[limit] = dist.new_group(
            list(range(world_size)), backend="smp", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT)
        )
    del os.environ["SMP_GLOO_THROTTLE_LIMIT"]
    return groups


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert torch.equal(got, want), f"{what}: got {got.tolist()}, want {want.tolist()}"


def cpu_stats(group) -> dict:
    import smp

    return smp.backend_stats(group)["cpu"]


# --- the two repros of issue 22 ------------------------------------------------


def repro_wait_after_throttle_waited(g, rank, world_size):
    """Issue 22's first repro. At limit 1 the old throttle, full with rank 0's isend,
    waited on it inside all_reduce, and rank 0's wait() then waited on the Gloo work
    again until the timeout. Now the isend holds no slot, and every handle waits on
    its work once: waiting again returns at once."""
    t = make(rank) if rank == 0 else torch.zeros(N)
    x = make(rank, 1)
    if rank == 0:
        w = dist.isend(t, 1, group=g)
        dist.all_reduce(x, group=g)
        w.wait()
        w.wait()  # and again
    elif rank == 1:
        dist.recv(t, 0, group=g)
        dist.all_reduce(x, group=g)
        check(t, make(0), "recv")
    else:
        dist.all_reduce(x, group=g)
    check(x, sum(make(r, 1) for r in range(world_size)), "all_reduce")


def repro_receives_posted_before_sends(g, rank, world_size):
    """Both ranks post their receive before their send (a ring beyond two ranks)."""
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    b = torch.zeros(N)
    r = dist.irecv(b, prv, group=g)
    s = dist.isend(make(rank), nxt, group=g)
    r.wait()
    s.wait()
    check(b, make(prv), "irecv")


REPROS = [repro_wait_after_throttle_waited, repro_receives_posted_before_sends]


def test_issue_22_repros_at_limits_1_2_8():
    run_at_limits_1_2_8(REPROS, timeout=120)


# --- collectives ----------------------------------------------------------------


def all_reduces(g, rank, world_size):
    t = make(rank)
    dist.all_reduce(t, group=g)
    check(t, sum(make(r) for r in range(world_size)), "all_reduce sync")
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.SUM, dist.ReduceOp.MAX]
    tensors = [make(rank, i) for i in range(len(ops))]
    works = [dist.all_reduce(t, op=op, group=g, async_op=True) for t, op in zip(tensors, ops, strict=True)]
    for w in reversed(works):  # waited late, newest first
        w.wait()
    for i, (t, op) in enumerate(zip(tensors, ops, strict=True)):
        if op == dist.ReduceOp.SUM:
            want = sum(make(r, i) for r in range(world_size))
        else:
            want = make(world_size - 1 if op == dist.ReduceOp.MAX else 0, i)
        check(t, want, f"all_reduce {op} #{i}")


def broadcasts(g, rank, world_size):
    tensors = [make(rank, i) for i in range(4)]
    works = [
        dist.broadcast(t, group_src=i % world_size, group=g, async_op=True) for i, t in enumerate(tensors)
    ]
    for w in works:
        w.wait()
    for i, t in enumerate(tensors):
        check(t, make(i % world_size, i), f"broadcast #{i}")


def all_gathers(g, rank, world_size):
    outs = [torch.empty(N) for _ in range(world_size)]
    flat = torch.empty(world_size * N)
    w1 = dist.all_gather(outs, make(rank, 1), group=g, async_op=True)
    w2 = dist.all_gather_into_tensor(flat, make(rank, 2), group=g, async_op=True)
    w2.wait()
    w1.wait()
    for r in range(world_size):
        check(outs[r], make(r, 1), "all_gather")
    check(flat, torch.cat([make(r, 2) for r in range(world_size)]), "all_gather_into_tensor")


def reduce_scatters(g, rank, world_size):
    out = torch.empty(N)
    out_t = torch.empty(N)
    w1 = dist.reduce_scatter(out, [make(rank, j) for j in range(world_size)], group=g, async_op=True)
    w2 = dist.reduce_scatter_tensor(
        out_t, torch.cat([make(rank, 10 + j) for j in range(world_size)]), group=g, async_op=True
    )
    w1.wait()
    w2.wait()
    check(out, sum(make(r, rank) for r in range(world_size)), "reduce_scatter")
    check(out_t, sum(make(r, 10 + rank) for r in range(world_size)), "reduce_scatter_tensor")


def all_to_alls(g, rank, world_size):
    # Even list, uneven list (chunk r -> j has 1 + r + 2j elements), even single.
    even_out = [torch.empty(N) for _ in range(world_size)]
    uneven_in = [make(rank, j, n=1 + rank + 2 * j) for j in range(world_size)]
    uneven_out = [torch.empty(1 + r + 2 * rank) for r in range(world_size)]
    single_out = torch.empty(world_size * N)
    works = [
        dist.all_to_all(even_out, [make(rank, j) for j in range(world_size)], group=g, async_op=True),
        dist.all_to_all(uneven_out, uneven_in, group=g, async_op=True),
        dist.all_to_all_single(
            single_out, torch.cat([make(rank, 20 + j) for j in range(world_size)]), group=g, async_op=True
        ),
    ]
    for w in works:
        w.wait()
    for r in range(world_size):
        check(even_out[r], make(r, rank), "all_to_all")
        check(uneven_out[r], make(r, rank, n=1 + r + 2 * rank), "all_to_all uneven")
    check(single_out, torch.cat([make(r, 20 + rank) for r in range(world_size)]), "all_to_all_single")


def rooted(g, rank, world_size):
    last = world_size - 1
    gathered = [torch.empty(N) for _ in range(world_size)] if rank == 0 else None
    scattered = torch.empty(N)
    reduced = make(rank, 3)
    works = [
        dist.gather(make(rank, 1), gathered, group_dst=0, group=g, async_op=True),
        dist.scatter(
            scattered,
            [make(50, r) for r in range(world_size)] if rank == last else None,
            group_src=last,
            group=g,
            async_op=True,
        ),
        dist.reduce(reduced, group_dst=last, group=g, async_op=True),
    ]
    for w in works:
        w.wait()
    if rank == 0:
        for r in range(world_size):
            check(gathered[r], make(r, 1), "gather")
    check(scattered, make(50, rank), "scatter")
    if rank == last:
        check(reduced, sum(make(r, 3) for r in range(world_size)), "reduce")


def barriers_and_objects(g, rank, world_size):
    dist.barrier(group=g)
    works = [dist.barrier(group=g, async_op=True) for _ in range(3)]
    for w in works:
        w.wait()
    objs = [None] * world_size
    dist.all_gather_object(objs, {"rank": rank}, group=g)
    assert objs == [{"rank": r} for r in range(world_size)], objs


def coalesced_collectives(g, rank, world_size):
    """Collectives issued between start/endCoalescing: one unit to the throttle."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    before = cpu_stats(g)["launched"]
    tensors = [make(rank, i) for i in range(3)]
    with _coalescing_manager(g, torch.device("cpu"), async_ops=True) as cm:
        for i, t in enumerate(tensors):
            dist.broadcast(t, group_src=i % world_size, group=g)
    cm.wait()
    for i, t in enumerate(tensors):
        check(t, make(i % world_size, i), f"coalesced broadcast #{i}")
    assert cpu_stats(g)["launched"] - before == 1, "a coalesced batch is one launch"


# --- point to point -------------------------------------------------------------


def blocking_send_recv(g, rank, world_size):
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    got = torch.empty(N)
    if rank % 2 == 0:
        dist.send(make(rank, 1), nxt, group=g)
        dist.recv(got, prv, group=g)
    else:
        dist.recv(got, prv, group=g)
        dist.send(make(rank, 1), nxt, group=g)
    check(got, make(prv, 1), "send/recv")
    if rank == 0:  # recv from any source names the sender
        senders = set()
        for _ in range(world_size - 1):
            t = torch.empty(1)
            src = dist.recv(t, group=g)  # the group holds every rank: group rank == rank
            assert t.item() == 7.0 * src, (t.item(), src)
            senders.add(src)
        assert senders == set(range(1, world_size)), senders
    else:
        dist.send(torch.tensor([7.0 * rank]), 0, group=g)


K = 4  # messages per direction: more than the smallest limits


def receives_first(g, rank, world_size):
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    got = [torch.empty(N) for _ in range(K)]
    recvs = [dist.irecv(t, prv, group=g) for t in got]
    sends = [dist.isend(make(rank, 30 + i), nxt, group=g) for i in range(K)]
    for w in recvs + sends:
        w.wait()
    for i, t in enumerate(got):
        check(t, make(prv, 30 + i), f"irecv-first #{i}")


def sends_first(g, rank, world_size):
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    got = [torch.empty(N) for _ in range(K)]
    sends = [dist.isend(make(rank, 40 + i), nxt, group=g) for i in range(K)]
    recvs = [dist.irecv(t, prv, group=g) for t in got]
    for w in reversed(sends + recvs):
        w.wait()
    for i, t in enumerate(got):
        check(t, make(prv, 40 + i), f"isend-first #{i}")


def batched(g, rank, world_size):
    """batch_isend_irecv with receives before sends, both ring directions, repeated."""
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    before = cpu_stats(g)["launched"]
    a, b, c = torch.empty(N), torch.empty(N), torch.empty(N)
    # From a ring neighbour: A and C travel forward (to nxt), B backward (to prv).
    # With two ranks nxt == prv, so the receives are posted in the peer's send order.
    ops = [
        dist.P2POp(dist.irecv, a, prv, group=g),
        dist.P2POp(dist.isend, make(rank, 60), nxt, group=g),
        dist.P2POp(dist.isend, make(rank, 61), prv, group=g),
        dist.P2POp(dist.irecv, b, nxt, group=g),
        dist.P2POp(dist.isend, make(rank, 62), nxt, group=g),
        dist.P2POp(dist.irecv, c, prv, group=g),
    ]
    reqs = dist.batch_isend_irecv(ops)
    for req in reqs:
        req.wait()
    for req in reqs:
        req.wait()  # waiting again returns at once
    check(a, make(prv, 60), "batch a")
    check(b, make(nxt, 61), "batch b")
    check(c, make(prv, 62), "batch c")
    assert cpu_stats(g)["launched"] - before == 1, "a batch is one launch"
    # Several batches in flight, waited late.
    outs = [torch.empty(N) for _ in range(3)]
    all_reqs = []
    for i, out in enumerate(outs):
        all_reqs += dist.batch_isend_irecv(
            [
                dist.P2POp(dist.irecv, out, prv, group=g),
                dist.P2POp(dist.isend, make(rank, 70 + i), nxt, group=g),
            ]
        )
    for req in reversed(all_reqs):
        req.wait()
    for i, out in enumerate(outs):
        check(out, make(prv, 70 + i), f"batch #{i}")


# --- async collectives and point to point interleaved ---------------------------


def interleaved(g, rank, world_size):
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    # Sends completed only by a receive the peer posts after a collective: a
    # collective launch must not wait on this rank's earlier send.
    if rank == 0:
        s = dist.isend(make(0, 80), 1, group=g)
        x = make(rank, 81)
        dist.all_reduce(x, group=g)
        s.wait()
    else:
        x = make(rank, 81)
        dist.all_reduce(x, group=g)
        if rank == 1:
            got = torch.empty(N)
            dist.recv(got, 0, group=g)
            check(got, make(0, 80), "recv after all_reduce")
    check(x, sum(make(r, 81) for r in range(world_size)), "all_reduce between")

    # Rounds of irecv, async all_reduce, isend, async broadcast: many more
    # operations than the limit in flight, every handle waited only at the end
    # (in reverse), then once more.
    rounds = 5
    got = [torch.empty(N) for _ in range(rounds)]
    sums = [make(rank, 90 + i) for i in range(rounds)]
    bcast = [make(rank, 95 + i) for i in range(rounds)]
    works = []
    for i in range(rounds):
        works.append(dist.irecv(got[i], prv, group=g))
        works.append(dist.all_reduce(sums[i], group=g, async_op=True))
        works.append(dist.isend(make(rank, 85 + i), nxt, group=g))
        works.append(dist.broadcast(bcast[i], group_src=i % world_size, group=g, async_op=True))
    works.append(dist.barrier(group=g, async_op=True))
    for w in reversed(works):
        w.wait()
    start = time.monotonic()
    for w in works:
        w.wait()
    assert time.monotonic() - start < 2.0, "a second wait() waited again"
    for i in range(rounds):
        check(got[i], make(prv, 85 + i), f"interleaved irecv #{i}")
        check(sums[i], sum(make(r, 90 + i) for r in range(world_size)), f"interleaved all_reduce #{i}")
        check(bcast[i], make(i % world_size, 95 + i), f"interleaved broadcast #{i}")


PATTERNS = [
    *REPROS,
    all_reduces,
    broadcasts,
    all_gathers,
    reduce_scatters,
    all_to_alls,
    rooted,
    barriers_and_objects,
    coalesced_collectives,
    blocking_send_recv,
    receives_first,
    sends_first,
    batched,
    interleaved,
]


def run_on_each_limit(rank, world_size, patterns):
    """Runs every pattern on a group of each limit; returns each group's statistics."""
    stats = {}
    for limit, g in groups_per_limit(world_size).items():
        for pattern in patterns:
            try:
                pattern(g, rank, world_size)
            except Exception as e:
                raise AssertionError(f"{pattern.__name__} at limit {limit}: {e}") from e
        stats[limit] = cpu_stats(g)
    return stats


def run_at_limits_1_2_8(patterns, timeout):
    """One launch of two ranks; every handle was waited, so nothing stays outstanding."""
    start = time.monotonic()
    stats = run_ranks(run_on_each_limit, 2, patterns, timeout=timeout)
    for per_rank in stats:
        for limit, s in per_rank.items():
            assert s["limit"] == limit
            assert s["peak_outstanding"] <= limit, s
            assert s["outstanding"] == 0, s
    print(f"{[p.__name__ for p in patterns]}: {time.monotonic() - start:.1f} s")
    return stats


def test_every_collective_and_p2p_pattern_at_limits_1_2_8():
    stats = run_at_limits_1_2_8(PATTERNS, timeout=240)
    for per_rank in stats:
        assert per_rank[1]["throttle_waits"] > 0  # the limit was reached, and waited out
