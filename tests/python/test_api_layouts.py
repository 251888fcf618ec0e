"""smp.init on real processes: rank helpers, groups, messaging, barriers, data helpers.

Expected values come from closed-form formulas written here, independent of
smp.topology, and every torch process group is exercised with a real all_reduce.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

# (pp, tp, world) for pp=2 x tp=2, tp=4, pp=4, rdp=4, pp=2 x rdp=2.
LAYOUTS = [(2, 2, 4), (1, 4, 4), (4, 1, 4), (1, 1, 4), (2, 1, 4)]


def expected(rank, world, pp, tp, placement):
    rdp = world // (pp * tp)
    if placement == "cluster":  # DPT: T fastest, then P, then D
        t, p, d = rank % tp, (rank // tp) % pp, rank // (tp * pp)

        def at(d, p, t):
            return (d * pp + p) * tp + t
    else:  # spread = TPD: D fastest, then P, then T
        d, p, t = rank % rdp, (rank // rdp) % pp, rank // (rdp * pp)

        def at(d, p, t):
            return (t * pp + p) * rdp + d

    groups = {
        "pp": sorted(at(d, q, t) for q in range(pp)),
        "tp": sorted(at(d, p, u) for u in range(tp)),
        "rdp": sorted(at(e, p, t) for e in range(rdp)),
        "dp": sorted(at(e, p, u) for e in range(rdp) for u in range(tp)),
        "mp": sorted(at(d, q, u) for q in range(pp) for u in range(tp)),
    }
    ranks = {"pp": p, "tp": t, "rdp": d}
    ranks["dp"] = groups["dp"].index(rank)
    ranks["mp"] = groups["mp"].index(rank)
    return ranks, groups


def check_layout(rank, world, pp, tp, placement):
    import smp

    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "placement_strategy": placement})
    assert smp.is_initialized()
    ranks, groups = expected(rank, world, pp, tp, placement)
    assert (smp.rank(), smp.size(), smp.local_rank(), smp.local_size()) == (rank, world, rank, world)
    for kind in ("pp", "tp", "dp", "rdp", "mp"):
        assert getattr(smp, f"{kind}_rank")() == ranks[kind], kind
        assert getattr(smp, f"{kind}_size")() == len(groups[kind]), kind
        assert getattr(smp, f"get_{kind}_group")() == groups[kind], kind
        pg = getattr(smp, f"get_{kind}_process_group")()
        assert dist.get_process_group_ranks(pg) == groups[kind], kind
        assert dist.get_backend(pg) == "smp"
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pg)  # the group really connects its members
        assert t.item() == sum(groups[kind]), kind
    assert dist.get_process_group_ranks(smp.get_world_process_group()) == list(range(world))
    assert smp.mp_size() * smp.rdp_size() == smp.size()
    assert smp.pp_size() * smp.dp_size() == smp.size()
    assert smp.pp_size() * smp.tp_size() * smp.rdp_size() == smp.size()

    # Messaging. broadcast: the first rank of each TP group sends, the others receive.
    tp_group = groups["tp"]
    if rank == tp_group[0]:
        smp.broadcast({"from": rank}, smp.TP_GROUP)
    else:
        assert smp.recv_from(tp_group[0], smp.WORLD_RANK) == {"from": tp_group[0]}
    # send / recv_from in MP-rank space: a ring over the MP group.
    mp = groups["mp"]
    if len(mp) > 1:
        me = mp.index(rank)
        nxt, prv = (me + 1) % len(mp), (me - 1) % len(mp)
        if me % 2 == 0:
            smp.send(("mp", rank), nxt, smp.MP_RANK)
            got = smp.recv_from(prv, smp.MP_RANK)
        else:
            got = smp.recv_from(prv, smp.MP_RANK)
            smp.send(("mp", rank), nxt, smp.MP_RANK)
        assert got == ("mp", mp[prv])
    # DP-rank space: dp rank 0 sends to every other member of its DP group.
    dp = groups["dp"]
    if ranks["dp"] == 0:
        for k in range(1, len(dp)):
            smp.send([k, "dp"], k, smp.DP_RANK)
    else:
        assert smp.recv_from(0, smp.DP_RANK) == [ranks["dp"], "dp"]
    for kind, group in (("pp", smp.PP_GROUP), ("rdp", smp.RDP_GROUP), ("world", smp.WORLD)):
        members = list(range(world)) if kind == "world" else groups[kind]
        assert smp.allgather(rank * 10, group) == [m * 10 for m in members]
    smp.barrier()
    smp.barrier(smp.TP_GROUP)
    for barrier in (smp.dp_barrier, smp.mp_barrier, smp.pp_barrier, smp.tp_barrier, smp.rdp_barrier):
        barrier()
    return True


@pytest.mark.parametrize("placement", ["cluster", "spread"])
@pytest.mark.parametrize("pp, tp, world", LAYOUTS, ids=["pp2xtp2", "tp4", "pp4", "rdp4", "pp2xrdp2"])
def test_layout(pp, tp, world, placement):
    assert run_ranks(check_layout, world, pp, tp, placement, init=False) == [True] * world


def check_messaging_errors(rank, world):
    import smp

    smp.init({})
    with pytest.raises(ValueError, match="smp.CommGroup"):
        smp.broadcast(1, "tp")
    with pytest.raises(ValueError, match="dest_rank 5 is not a valid MP_RANK"):
        smp.send(1, 5, smp.MP_RANK)
    with pytest.raises(ValueError, match="is this rank itself"):
        smp.send(1, rank, smp.WORLD_RANK)
    with pytest.raises(ValueError, match="smp.RankType"):
        smp.recv_from(0, "world")
    with pytest.raises(RuntimeError, match="different config"):
        smp.init({"microbatches": 2})
    return True


def test_messaging_rejects_bad_arguments():
    assert run_ranks(check_messaging_errors, 2, init=False) == [True, True]


def check_world_size_error(rank, world):
    import smp

    with pytest.raises(ValueError) as info:
        smp.init({"pipeline_parallel_degree": 4})
    dist.destroy_process_group()
    return str(info.value)


def test_world_size_not_divisible_is_rejected():
    messages = run_ranks(check_world_size_error, 2, init=False)
    assert (
        "world size 2 is not divisible by pipeline_parallel_degree (4) x tensor_parallel_degree (1) = 4"
        in messages[0]
    )


def check_data_helpers(rank, world, prescaled):
    import smp

    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "tensor_parallel_degree": 2,
            "microbatches": 2,
            "prescaled_batch": prescaled,
        }
    )
    dataset = torch.utils.data.TensorDataset(torch.arange(103))
    loader = smp.data_loader(dataset, batch_size=4, shuffle=True, seed=3)
    loader.sampler.set_epoch(1)
    seen = [batch[0].tolist() for batch in loader]
    assert all(len(b) == 4 for b in seen)  # drop_last: every batch divides by microbatches
    with pytest.raises(ValueError, match="batch size 5 does not divide by microbatches=2"):
        smp.data_loader(dataset, batch_size=5)
    assert smp.tensor_parallel_seed() == 0 + smp.tp_rank()  # tensor_parallel_seed defaults to 0
    smp.set_seed(5)
    weights = torch.nn.Linear(3, 3).weight.detach().tolist()  # no tensors through queues
    return {
        "seen": seen,
        "dp": smp.dp_rank(),
        "rdp": smp.rdp_rank(),
        "data_seed": smp.data_seed(100),
        "weights": weights,
    }


@pytest.mark.parametrize("prescaled", [False, True], ids=["per-tp-rank", "prescaled"])
def test_data_loader_shards_by_replica(prescaled):
    out = run_ranks(check_data_helpers, 4, prescaled, init=False)
    # pp=2 x tp=2 on 4 ranks (cluster): TP groups {0,1}, {2,3}; PP groups {0,2}, {1,3}.
    key = "rdp" if prescaled else "dp"
    for r in range(4):
        for q in range(4):
            same_shard = out[r][key] == out[q][key]
            if same_shard:  # every rank of one model replica sees the same order
                assert out[r]["seen"] == out[q]["seen"]
            else:  # different shards never share a sample
                a = {x for b in out[r]["seen"] for x in b}
                b = {x for b in out[q]["seen"] for x in b}
                assert not a & b
    # Pipeline stages of one replica agree; with prescaled the TP group agrees too.
    assert out[0]["seen"] == out[2]["seen"]
    assert (out[0]["seen"] == out[1]["seen"]) is prescaled
    assert [o["data_seed"] for o in out] == [100 + o[key] for o in out]
    # set_seed makes every rank build the same model (smp slices it, never re-initializes).
    assert all(o["weights"] == out[0]["weights"] for o in out)
