"""Every layout of up to 64 simulated ranks satisfies SMP's invariants (no processes)."""

from __future__ import annotations

import itertools

import pytest
from smp.config import PLACEMENT_ALIASES, PLACEMENT_ORDERS
from smp.topology import CommGroup, Topology

G = CommGroup


def layouts(max_world=64):
    for world in range(1, max_world + 1):
        for pp in range(1, world + 1):
            for tp in range(1, world // pp + 1):
                if world % (pp * tp) == 0:
                    for order in PLACEMENT_ORDERS:
                        yield world, pp, tp, order


def expected_coords(rank, world, pp, tp, order):
    """Independent of Topology: mixed radix with the rightmost letter fastest."""
    sizes = {"D": world // (pp * tp), "P": pp, "T": tp}
    a, b, c = order
    return {
        c: rank % sizes[c],
        b: (rank // sizes[c]) % sizes[b],
        a: rank // (sizes[c] * sizes[b]),
    }


def test_placement_aliases():
    assert PLACEMENT_ALIASES == {"cluster": "DPT", "spread": "TPD"}
    assert sorted(PLACEMENT_ORDERS) == sorted("".join(p) for p in itertools.permutations("DPT"))


def test_every_layout_up_to_64_ranks():
    count = 0
    for world, pp, tp, order in layouts():
        count += 1
        t = Topology(world, pp, tp, order)
        rdp = world // (pp * tp)
        size = {g: t.group_size(g) for g in G}
        # SMP's identities.
        assert size[G.MP_GROUP] * size[G.RDP_GROUP] == world
        assert size[G.PP_GROUP] * size[G.DP_GROUP] == world
        assert size[G.PP_GROUP] * size[G.TP_GROUP] * size[G.RDP_GROUP] == world
        assert (size[G.PP_GROUP], size[G.TP_GROUP], size[G.RDP_GROUP]) == (pp, tp, rdp)
        # Every group kind partitions the world.
        for g in G:
            groups = t.all_groups(g)
            members = sorted(r for grp in groups for r in grp)
            assert members == list(range(world)), (world, pp, tp, order, g)
            assert all(len(grp) == size[g] for grp in groups)
        coords = [t.coords(r) for r in range(world)]
        for r in range(world):
            c = coords[r]
            assert c == expected_coords(r, world, pp, tp, order)
            assert t.rank_of(c) == r
            ranks = {g: set(t.group_ranks(g, r)) for g in G}
            # The TP group lies in both the MP and the DP group.
            assert ranks[G.TP_GROUP] <= ranks[G.MP_GROUP] & ranks[G.DP_GROUP]
            assert ranks[G.PP_GROUP] <= ranks[G.MP_GROUP]
            assert ranks[G.RDP_GROUP] <= ranks[G.DP_GROUP]
            # Members of a group agree on every axis the group does not span.
            spans = {G.PP_GROUP: "DT", G.TP_GROUP: "DP", G.RDP_GROUP: "PT", G.DP_GROUP: "P", G.MP_GROUP: "D"}
            for g, fixed in spans.items():
                key = [c[a] for a in fixed]
                assert all([coords[o][a] for a in fixed] == key for o in ranks[g])
            # Group rank = position among members, and it matches the coordinate on 1-axis groups.
            assert t.group_rank(G.PP_GROUP, r) == c["P"]
            assert t.group_rank(G.TP_GROUP, r) == c["T"]
            assert t.group_rank(G.RDP_GROUP, r) == c["D"]
            assert t.group_rank(G.WORLD, r) == r
        if order == "DPT":  # cluster: TP groups are runs of consecutive ranks
            for grp in t.all_groups(G.TP_GROUP):
                assert grp == list(range(grp[0], grp[0] + tp))
    assert count > 1000


@pytest.mark.parametrize(
    "args, match",
    [((6, 4, 1), "not divisible"), ((4, 2, 2, "DPX"), "permutation"), ((4, 0, 1), "not divisible")],
)
def test_bad_topology(args, match):
    with pytest.raises(ValueError, match=match):
        Topology(*args)
