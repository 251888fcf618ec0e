"""Context parallelism's place in the layout, on real processes: smp.cp_rank() and its helpers,
the groups spanning it, and the data helpers that give a cp group's ranks the same batch.

Expected ranks and groups come from the closed form written here (C is the digit right after D
in the placement order), independent of smp.topology; every group is exercised with a real
all_reduce.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks


def expected(rank, world, pp, tp, cp):
    """Cluster placement (D C P T, T fastest): this rank's coordinates and groups."""
    rdp = world // (pp * tp * cp)
    t, p, c, d = rank % tp, (rank // tp) % pp, (rank // (tp * pp)) % cp, rank // (tp * pp * cp)

    def at(d, c, p, t):
        return ((d * cp + c) * pp + p) * tp + t

    groups = {
        "cp": [at(d, k, p, t) for k in range(cp)],
        "rdp": [at(e, c, p, t) for e in range(rdp)],
        "dp": sorted(at(e, c, p, u) for e in range(rdp) for u in range(tp)),
        "tp": [at(d, c, p, u) for u in range(tp)],
        "pp": [at(d, c, q, t) for q in range(pp)],
        "mp": sorted(at(d, c, q, u) for q in range(pp) for u in range(tp)),
    }
    return {"cp": c, "rdp": d, "tp": t, "pp": p}, groups


def check_cp_layout(rank, world, pp, tp, cp):
    import smp

    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "context_parallel_degree": cp})
    ranks, groups = expected(rank, world, pp, tp, cp)
    for kind, members in groups.items():
        if kind in ranks:
            assert getattr(smp, f"{kind}_rank")() == ranks[kind], kind
        assert getattr(smp, f"{kind}_size")() == len(members), kind
        assert getattr(smp, f"get_{kind}_group")() == members, kind
        pg = getattr(smp, f"get_{kind}_process_group")()
        assert dist.get_process_group_ranks(pg) == members, kind
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pg)
        assert t.item() == sum(members), kind
    assert smp.pp_size() * smp.tp_size() * smp.cp_size() * smp.rdp_size() == smp.size()
    assert smp.parallel_state.process_group(smp.CP_GROUP) is smp.get_cp_process_group()
    # The engine's replicas are the data replicas and their cp ranks: gradients average over both.
    engine = smp.parallel_state.parallel_groups()
    replicas = sorted(r for d_rank in groups["rdp"] for r in expected(d_rank, world, pp, tp, cp)[1]["cp"])
    assert list(engine.rdp_ranks) == replicas and engine.cp_ranks == tuple(groups["cp"])
    assert engine.cp_size == cp and engine.cp_rank == ranks["cp"]
    # SMP v1's data helpers shard by the data replicas: a cp group's ranks read the same batch.
    batch = next(iter(smp.data_loader(list(range(64)), batch_size=4)))
    seen = [None] * world
    dist.all_gather_object(seen, batch.tolist())
    assert all(seen[r] == seen[rank] for r in groups["cp"])
    assert len({str(seen[r]) for r in groups["rdp"]}) == len(groups["rdp"])
    smp.barrier(smp.CP_GROUP)
    smp.parallel_state.reset()
    return True


@pytest.mark.parametrize("pp, tp, cp, world", [(1, 1, 2, 4), (1, 2, 2, 4), (2, 1, 2, 4), (1, 1, 4, 4)])
def test_cp_layout(pp, tp, cp, world):
    assert run_ranks(check_cp_layout, world, pp, tp, cp, timeout=120) == [True] * world


def check_config_errors(rank, world):
    import smp

    with pytest.raises(ValueError, match=r"context_parallel_degree \(3\).*launch a multiple of 3"):
        smp.init({"context_parallel_degree": 3})
    with pytest.raises(ValueError, match="'cp_comm_type' must be"):
        smp.init({"context_parallel_degree": 2, "cp_comm_type": "ring"})
    return True


def test_cp_config_errors():
    assert run_ranks(check_config_errors, 2, timeout=60) == [True, True]


def test_cp_config_keys():
    """SMP v2's keys, their defaults, and a clear error naming the key, the value and the fix."""
    from smp import config as cfg

    c = cfg.parse({})
    assert (c.context_parallel_degree, c.cp_comm_type) == (1, "p2p")
    c = cfg.parse({"context_parallel_degree": 2, "cp_comm_type": "all_gather", "tensor_parallel_degree": 2})
    assert (c.context_parallel_degree, c.cp_comm_type) == (2, "all_gather")
    c.check_world(8)
    with pytest.raises(ValueError) as info:
        c.check_world(6)
    assert (
        "world size 6 is not divisible by pipeline_parallel_degree (1) x tensor_parallel_degree (2) "
        "x context_parallel_degree (2) = 4; launch a multiple of 4" in str(info.value)
    )
    with pytest.raises(ValueError, match=r"sharded_data_parallel_degree=2 does not divide .* degree 1"):
        cfg.parse({"context_parallel_degree": 4, "sharded_data_parallel_degree": 2}).check_world(4)
    for bad, message in [
        ({"context_parallel_degree": 0}, "'context_parallel_degree' must be a positive integer, got 0"),
        ({"context_parallel_degree": "2"}, "'context_parallel_degree' must be an integer, got '2' (str)"),
        ({"cp_comm_type": "ring"}, "'cp_comm_type' must be 'p2p' or 'all_gather' or 'a2a', got 'ring'"),
        ({"context_paralel_degree": 2}, "did you mean 'context_parallel_degree'?"),
    ]:
        with pytest.raises(ValueError) as info:
            cfg.parse(bad)
        assert message in str(info.value), str(info.value)
