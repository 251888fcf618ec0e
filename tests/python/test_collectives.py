"""Every torch.distributed collective through the smp backend, on 2 and 4 CPU processes.

Each rank's input is a deterministic function of (rank, size, dtype), so every
rank computes the expected result of a collective locally with plain tensor
math, independently of any communication, and compares.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INTS = [torch.int32, torch.int64, torch.uint8]
REDUCTIONS = {
    dist.ReduceOp.SUM: lambda xs: xs.sum(0),
    dist.ReduceOp.PRODUCT: lambda xs: xs.prod(0),
    dist.ReduceOp.MIN: lambda xs: xs.min(0).values,
    dist.ReduceOp.MAX: lambda xs: xs.max(0).values,
    dist.ReduceOp.AVG: lambda xs: xs.mean(0),
}

world_sizes = pytest.mark.parametrize("world_size", [2, 4])


def make(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small positive values (products of 4 ranks stay exact in fp16)."""
    base = (torch.arange(n, dtype=torch.float64) * (salt + 3) + rank * 5 + salt) % 7 + 1
    return base.to(dtype)


def expected_reduction(op, world_size, n, dtype, salt=0):
    xs = torch.stack([make(r, n, torch.float64, salt) for r in range(world_size)])
    return REDUCTIONS[op](xs).to(dtype)


def assert_equal(actual, expected):
    torch.testing.assert_close(
        actual, expected, rtol=2e-2 if actual.dtype in (torch.bfloat16, torch.float16) else 1e-6, atol=0
    )


def call(collective, /, *args, async_op, **kwargs):
    """Runs a collective sync or async; async handles are waited on before checking."""
    work = collective(*args, async_op=async_op, **kwargs)
    if async_op:
        work.wait()
        assert work.is_completed()


# --- reductions -------------------------------------------------------------


def check_all_reduce(rank, world_size):
    n = 37
    for dtype in FLOATS + INTS:
        for op in REDUCTIONS:
            if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
                continue
            if op == dist.ReduceOp.PRODUCT and dtype == torch.uint8:
                continue  # 7**4 overflows uint8
            for async_op in (False, True):
                t = make(rank, n, dtype, salt=int(async_op))
                work = dist.all_reduce(t, op=op, async_op=async_op)
                if async_op:
                    work.wait()
                    assert work.is_completed()
                assert_equal(t, expected_reduction(op, world_size, n, dtype, int(async_op)))


def check_broadcast_and_reduce(rank, world_size):
    n = 19
    for root in range(world_size):
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            t = make(rank, n, dtype, salt=root)
            dist.broadcast(t, src=root)
            assert_equal(t, make(root, n, dtype, salt=root))
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
                t = make(rank, n, dtype, salt=root)
                call(dist.reduce, t, dst=root, op=op, async_op=op == dist.ReduceOp.MAX)
                if rank == root:  # elsewhere the buffer is unspecified (Gloo uses it)
                    assert_equal(t, expected_reduction(op, world_size, n, dtype, salt=root))
        work = dist.broadcast(t := make(rank, n, torch.float64), src=root, async_op=True)
        work.wait()
        assert_equal(t, make(root, n, torch.float64))


@world_sizes
def test_all_reduce_every_op_and_dtype(world_size):
    run_ranks(check_all_reduce, world_size)


@world_sizes
def test_broadcast_and_reduce_every_root(world_size):
    run_ranks(check_broadcast_and_reduce, world_size)


# --- gathers and scatters ---------------------------------------------------


def check_gathers(rank, world_size):
    n = 11
    for dtype in (torch.float32, torch.int32, torch.float16):
        out = [torch.empty(n, dtype=dtype) for _ in range(world_size)]
        call(dist.all_gather, out, make(rank, n, dtype), async_op=dtype == torch.int32)
        for r in range(world_size):
            assert_equal(out[r], make(r, n, dtype))

        flat = torch.empty(world_size * n, dtype=dtype)
        dist.all_gather_into_tensor(flat, make(rank, n, dtype), async_op=True).wait()
        assert_equal(flat, torch.cat([make(r, n, dtype) for r in range(world_size)]))

        for root in (0, world_size - 1):
            gathered = [torch.empty(n, dtype=dtype) for _ in range(world_size)] if rank == root else None
            call(dist.gather, make(rank, n, dtype, salt=1), gathered, dst=root, async_op=root != 0)
            if rank == root:
                for r in range(world_size):
                    assert_equal(gathered[r], make(r, n, dtype, salt=1))

            received = torch.empty(n, dtype=dtype)
            chunks = [make(r, n, dtype, salt=2) + root for r in range(world_size)] if rank == root else None
            call(dist.scatter, received, chunks, src=root, async_op=root != 0)
            assert_equal(received, make(rank, n, dtype, salt=2) + root)


def check_reduce_scatter(rank, world_size):
    n = 6
    for dtype in (torch.float32, torch.float64, torch.int64):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG):
            if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
                continue
            full = expected_reduction(op, world_size, world_size * n, dtype)
            mine = full[rank * n : (rank + 1) * n]

            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, make(rank, world_size * n, dtype), op=op)
            assert_equal(out, mine)

            out = torch.empty(n, dtype=dtype)
            pieces = list(make(rank, world_size * n, dtype).chunk(world_size))
            dist.reduce_scatter(out, pieces, op=op, async_op=True).wait()
            assert_equal(out, mine)


def check_all_to_all(rank, world_size):
    # Uneven splits: rank r sends (r + d + 1) elements to rank d.
    def block(src, dst, dtype):
        return torch.full((src + dst + 1,), float(src * 10 + dst)).to(dtype)

    for dtype in (torch.float32, torch.int64):
        send = torch.cat([block(rank, d, dtype) for d in range(world_size)])
        in_splits = [rank + d + 1 for d in range(world_size)]
        out_splits = [s + rank + 1 for s in range(world_size)]
        recv = torch.empty(sum(out_splits), dtype=dtype)
        dist.all_to_all_single(recv, send, out_splits, in_splits)
        assert_equal(recv, torch.cat([block(s, rank, dtype) for s in range(world_size)]))

        # Even splits, async, no split sizes given.
        send = torch.arange(world_size * 3, dtype=dtype) + 100 * rank
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, async_op=True).wait()
        expected = torch.cat(
            [
                (torch.arange(world_size * 3, dtype=dtype) + 100 * s)[rank * 3 : rank * 3 + 3]
                for s in range(world_size)
            ]
        )
        assert_equal(recv, expected)

        # List form, uneven sizes.
        outs = [torch.empty(s + rank + 1, dtype=dtype) for s in range(world_size)]
        call(
            dist.all_to_all,
            outs,
            [block(rank, d, dtype) for d in range(world_size)],
            async_op=dtype == torch.int64,
        )
        for s in range(world_size):
            assert_equal(outs[s], block(s, rank, dtype))


@world_sizes
def test_gather_scatter_family(world_size):
    run_ranks(check_gathers, world_size)


@world_sizes
def test_reduce_scatter_list_and_tensor(world_size):
    run_ranks(check_reduce_scatter, world_size)


@world_sizes
def test_all_to_all_uneven_splits(world_size):
    run_ranks(check_all_to_all, world_size)


# --- point to point, barrier, objects ---------------------------------------


def check_point_to_point(rank, world_size):
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    n = 9
    # Blocking ring, ordered so it cannot deadlock.
    got = torch.empty(n)
    if rank % 2 == 0:
        dist.send(make(rank, n, torch.float32), dst=nxt)
        dist.recv(got, src=prv)
    else:
        dist.recv(got, src=prv)
        dist.send(make(rank, n, torch.float32), dst=nxt)
    assert_equal(got, make(prv, n, torch.float32))

    # isend/irecv in either order.
    got = torch.empty(n, dtype=torch.float64)
    reqs = [dist.irecv(got, src=prv), dist.isend(make(rank, n, torch.float64, 1), dst=nxt)]
    for req in reqs:
        req.wait()
    assert_equal(got, make(prv, n, torch.float64, 1))

    # batch_isend_irecv, both directions of the ring in one batch.
    from_prev, from_next = torch.empty(n), torch.empty(n)
    ops = [
        dist.P2POp(dist.isend, make(rank, n, torch.float32, 2), nxt),
        dist.P2POp(dist.isend, make(rank, n, torch.float32, 3), prv),
        dist.P2POp(dist.irecv, from_prev, prv),
        dist.P2POp(dist.irecv, from_next, nxt),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    assert_equal(from_prev, make(prv, n, torch.float32, 2))
    assert_equal(from_next, make(nxt, n, torch.float32, 3))

    # recv from any source reports the sender.
    if rank == 0:
        senders = set()
        for _ in range(world_size - 1):
            t = torch.empty(1)
            src = dist.recv(t)
            assert t.item() == src * 7.0
            senders.add(src)
        assert senders == set(range(1, world_size))
    else:
        dist.send(torch.tensor([rank * 7.0]), dst=0)


def check_barrier_and_objects(rank, world_size):
    dist.barrier()
    dist.barrier(async_op=True).wait()

    objs = [{"rank": rank, "payload": list(range(rank + 1))}, f"r{rank}"]
    dist.broadcast_object_list(objs, src=world_size - 1)
    assert objs == [{"rank": world_size - 1, "payload": list(range(world_size))}, f"r{world_size - 1}"]

    gathered = [None] * world_size
    dist.all_gather_object(gathered, ("x", rank, {rank: rank * rank}))
    assert gathered == [("x", r, {r: r * r}) for r in range(world_size)]

    out = [None]
    dist.scatter_object_list(out, [f"to{r}" for r in range(world_size)] if rank == 0 else None, src=0)
    assert out == [f"to{rank}"]

    into = [None] * world_size if rank == 0 else None
    dist.gather_object(rank * 3, into, dst=0)
    if rank == 0:
        assert into == [r * 3 for r in range(world_size)]


@world_sizes
def test_point_to_point(world_size):
    run_ranks(check_point_to_point, world_size)


@world_sizes
def test_barrier_and_object_collectives(world_size):
    run_ranks(check_barrier_and_objects, world_size)


# --- subgroups and async handles --------------------------------------------


def check_subgroups(rank, world_size):
    evens = dist.new_group([0, 2], backend="smp")
    odds = dist.new_group([1, 3], backend="smp")
    pair = dist.new_group([1, 2], backend="smp")
    mine = evens if rank % 2 == 0 else odds
    members = [0, 2] if rank % 2 == 0 else [1, 3]
    t = make(rank, 5, torch.float32)
    dist.all_reduce(t, group=mine)
    assert_equal(t, sum(make(r, 5, torch.float32) for r in members))
    assert dist.get_backend(mine) == "smp"
    assert dist.get_world_size(mine) == 2
    assert dist.get_group_rank(mine, rank) == members.index(rank)

    out = [torch.empty(3) for _ in range(2)]
    dist.all_gather(out, torch.full((3,), float(rank)), group=mine)
    assert [o[0].item() for o in out] == [float(m) for m in members]

    if rank in (1, 2):
        t = torch.full((4,), float(rank))
        dist.broadcast(t, group_src=1, group=pair)  # group rank 1 is global rank 2
        assert_equal(t, torch.full((4,), 2.0))
    # Every subgroup is an smp group with its own statistics.
    import smp

    assert smp.backend_stats(mine)["cpu"]["launched"] == 2


def check_async_handles(rank, world_size):
    tensors = [make(rank, 1000, torch.float32, salt=i % 5) for i in range(50)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for i, (t, w) in enumerate(zip(tensors, works, strict=True)):
        fut = w.get_future()
        w.wait()
        assert w.is_completed()  # (Work.exception() has no working binding in torch 2.11)
        fut.wait()
        assert_equal(t, expected_reduction(dist.ReduceOp.SUM, world_size, 1000, torch.float32, salt=i % 5))


def test_subgroups_from_new_group():
    run_ranks(check_subgroups, 4)


@world_sizes
def test_async_handles(world_size):
    run_ranks(check_async_handles, world_size)


# --- explicit store ---------------------------------------------------------


def check_explicit_store(rank, world_size, path):
    import smp  # noqa: F401

    store = dist.FileStore(path, world_size)
    dist.init_process_group("smp", store=store, rank=rank, world_size=world_size)
    try:
        t = make(rank, 8, torch.float64)
        dist.all_reduce(t)
        assert_equal(t, expected_reduction(dist.ReduceOp.SUM, world_size, 8, torch.float64))
        assert dist.get_backend() == "smp"
    finally:
        dist.destroy_process_group()


def test_init_with_an_explicit_store(tmp_path):
    run_ranks(check_explicit_store, 2, str(tmp_path / "store"), init=False)
