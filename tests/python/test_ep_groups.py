"""Expert parallelism's groups, config key and API helpers (issue 47): the ep group is a block of
consecutive data-parallel replicas, the ep replica group the replicas holding the same experts;
bad degrees are clear errors naming the fix."""

from __future__ import annotations

import harness
import pytest
import smp
from smp import config as config_lib
from smp.topology import CommGroup, Topology

G = CommGroup


def _independent_ep_groups(world: int, pp: int, tp: int, ep: int, order: str) -> dict[int, tuple]:
    """rank -> (its ep group, its ep replica group), from the coordinates by brute force."""
    t = Topology(world, pp, tp, order)
    coords = [t.coords(r) for r in range(world)]
    out = {}
    for r, c in enumerate(coords):
        same_pt = [q for q, d in enumerate(coords) if (d["P"], d["T"]) == (c["P"], c["T"])]
        group = [q for q in same_pt if coords[q]["D"] // ep == c["D"] // ep]
        replicas = [q for q in same_pt if coords[q]["D"] % ep == c["D"] % ep]
        same_p = [q for q, d in enumerate(coords) if d["P"] == c["P"]]
        holders = [q for q in same_p if coords[q]["D"] % ep == c["D"] % ep]  # every tp rank too
        out[r] = (group, replicas, holders)
    return out


@pytest.mark.parametrize("order", ["DPT", "TPD", "PDT"])
def test_ep_groups_cut_each_rdp_group_into_blocks(order):
    for world, pp, tp, ep in [(8, 1, 1, 2), (8, 1, 1, 4), (8, 2, 1, 2), (16, 2, 2, 2), (12, 1, 3, 2)]:
        t = Topology(world, pp, tp, order, ep=ep)
        expected = _independent_ep_groups(world, pp, tp, ep, order)
        for r in range(world):
            group, replicas, holders = expected[r]
            assert t.group_ranks(G.EP_GROUP, r) == group
            assert t.group_ranks(G.EP_REPLICA_GROUP, r) == replicas
            assert t.group_ranks(G.EP_HOLDERS_GROUP, r) == holders
            assert t.group_rank(G.EP_GROUP, r) == t.coords(r)["D"] % ep
        assert t.group_size(G.EP_GROUP) == ep
        assert t.group_size(G.EP_REPLICA_GROUP) == world // (pp * tp * ep)
        assert t.group_size(G.EP_HOLDERS_GROUP) == world // (pp * ep)
        # Each rank's ep group and its replica group meet in it alone; together they span its rdp group.
        for r in range(world):
            assert set(t.group_ranks(G.EP_GROUP, r)) & set(t.group_ranks(G.EP_REPLICA_GROUP, r)) == {r}


def test_ep_degree_must_divide_the_data_parallel_degree():
    with pytest.raises(ValueError, match="expert parallel degree 3 does not divide"):
        Topology(8, 1, 2, ep=3)
    cfg = config_lib.parse({"expert_parallel_degree": 3})
    wanted = r"expert_parallel_degree=3 does not divide the data-parallel degree 4.*\[1, 2, 4\]"
    with pytest.raises(ValueError, match=wanted):
        cfg.check_world(4)
    cfg.check_world(6)


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"context_parallel_degree": 2}, "context_parallel_degree=2"),
        (
            {"pipeline_parallel_degree": 2, "sharded_data_parallel_degree": 2},
            "sharded_data_parallel_degree=2 together with pipeline_parallel_degree=2",
        ),
    ],
)
def test_layouts_ep_does_not_serve_yet_are_refused(extra, named):
    served = "data, pipeline and tensor parallelism"
    wanted = f"expert_parallel_degree=2 runs with {served} only so far, not with {named}"
    with pytest.raises(ValueError, match=wanted):
        config_lib.parse({"expert_parallel_degree": 2, **extra})
    for served in ({"pipeline_parallel_degree": 2}, {"tensor_parallel_degree": 2}):
        config_lib.parse({"expert_parallel_degree": 2, **served})


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_ep_degree_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="expert_parallel_degree"):
        config_lib.parse({"expert_parallel_degree": bad})


def _api(rank, world):
    smp.init({"expert_parallel_degree": 2})
    import torch
    import torch.distributed as dist

    assert smp.EP_GROUP is CommGroup.EP_GROUP
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=smp.get_ep_process_group())
    return smp.ep_rank(), smp.ep_size(), smp.get_ep_group(), t.item(), smp.rdp_size()


def test_api_helpers_on_four_ranks():
    results = harness.run_ranks(_api, 4, timeout=120)
    assert results == [
        (0, 2, [0, 1], 1.0, 4),
        (1, 2, [0, 1], 1.0, 4),
        (0, 2, [2, 3], 5.0, 4),
        (1, 2, [2, 3], 5.0, 4),
    ]
