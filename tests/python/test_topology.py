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
        "C": 0,
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


def cp_layouts(max_world=24):
    for world in range(1, max_world + 1):
        for cp in range(2, world + 1):
            for pp in (1, 3):
                for tp in (1, 2):
                    if world % (pp * tp * cp) == 0:
                        for sdp in range(1, world // (pp * tp * cp) + 1):
                            if (world // (pp * tp * cp)) % sdp == 0:
                                for order in PLACEMENT_ORDERS:
                                    yield world, pp, tp, cp, sdp, order


def expected_cp_coords(rank, world, pp, tp, cp, order):
    """Independent of Topology: C is the digit right after D, the rightmost letter fastest."""
    sizes = {"D": world // (pp * tp * cp), "C": cp, "P": pp, "T": tp}
    coords = {}
    for axis in reversed(order.replace("D", "DC")):
        rank, coords[axis] = divmod(rank, sizes[axis])
    return coords


def test_context_parallel_axis():
    """world = pp x tp x cp x rdp; cp ranks share their data coordinates (they read the same batch),
    and the groups that average gradients and shard parameters span C with D."""
    count = 0
    for world, pp, tp, cp, sdp, order in cp_layouts():
        count += 1
        t = Topology(world, pp, tp, order, sdp, cp)
        rdp = world // (pp * tp * cp)
        size = {g: t.group_size(g) for g in G}
        assert (size[G.CP_GROUP], size[G.RDP_GROUP], size[G.DP_GROUP]) == (cp, rdp, rdp * tp)
        assert size[G.PP_GROUP] * size[G.TP_GROUP] * size[G.CP_GROUP] * size[G.RDP_GROUP] == world
        assert size[G.RDP_CP_GROUP] == rdp * cp and size[G.DP_CP_GROUP] == rdp * cp * tp
        block = sdp * cp if sdp > 1 else 1  # FSDP2 shards over data x context; nothing without sdp
        assert size[G.SDP_GROUP] == block and size[G.SDP_REPLICA_GROUP] == rdp * cp // block
        for g in G:
            groups = t.all_groups(g)
            assert sorted(r for grp in groups for r in grp) == list(range(world)), (g, world, order)
            assert all(len(grp) == size[g] for grp in groups)
        coords = [t.coords(r) for r in range(world)]
        spans = {
            G.CP_GROUP: "DPT",
            G.RDP_GROUP: "CPT",
            G.DP_GROUP: "CP",
            G.MP_GROUP: "DC",
            G.RDP_CP_GROUP: "PT",
        }
        for r in range(world):
            c = coords[r]
            assert c == expected_cp_coords(r, world, pp, tp, cp, order)
            assert t.rank_of(c) == r
            assert t.group_rank(G.CP_GROUP, r) == c["C"]
            assert t.group_rank(G.RDP_GROUP, r) == c["D"]
            ranks = {g: set(t.group_ranks(g, r)) for g in G}
            for g, fixed in spans.items():
                assert all([coords[o][a] for a in fixed] == [c[a] for a in fixed] for o in ranks[g])
            assert ranks[G.CP_GROUP] | ranks[G.RDP_GROUP] <= ranks[G.RDP_CP_GROUP]
            assert sdp == 1 or ranks[G.SDP_GROUP] >= ranks[G.CP_GROUP]  # FSDP2 over data x context
            assert ranks[G.RDP_CP_GROUP] <= ranks[G.DP_CP_GROUP]
            # The FSDP2 mesh reads the replica ranks as rows of sdp groups: ascending rank order.
            replica = sorted(ranks[G.RDP_CP_GROUP])
            assert [c["D"] * cp + c["C"] for c in (coords[o] for o in replica)] == list(range(rdp * cp))
    assert count > 200


def test_context_parallel_one_is_smp_v1():
    """With cp = 1 the groups spanning C are the data groups: smp.init shares their processes."""
    for world, pp, tp, order in layouts(16):
        t = Topology(world, pp, tp, order)
        assert t.all_groups(G.RDP_CP_GROUP) == t.all_groups(G.RDP_GROUP)
        assert t.all_groups(G.DP_CP_GROUP) == t.all_groups(G.DP_GROUP)
        assert all(len(g) == 1 for g in t.all_groups(G.CP_GROUP))


@pytest.mark.parametrize(
    "args, match",
    [
        ((6, 4, 1), "not divisible"),
        ((4, 2, 2, "DPX"), "permutation"),
        ((4, 0, 1), "not divisible"),
        ((8, 1, 2, "DPT", 1, 3), "x cp \\(3\\)"),
        ((8, 1, 1, "DPT", 4, 4), "does not divide"),
    ],
)
def test_bad_topology(args, match):
    with pytest.raises(ValueError, match=match):
        Topology(*args)
