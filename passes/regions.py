"""Module regions of a graph: the nodes that run inside given modules, outlined one call each.

A region names module paths of the captured model (as in `named_modules()`); its nodes are
those whose module stack contains one of the paths ("" stands for the whole model). On a
pipeline stage only the stage's own nodes exist, so a region that spans a stage boundary
becomes one piece on each stage: regions never cross stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from smp.passes.fx_utils import COMPUTE_OPS, module_stack
from smp.passes.outline import Outlined, convex_pieces, outline
from torch import fx, nn


@dataclasses.dataclass(frozen=True)
class Region:
    label: str  # how reports name it, e.g. "blocks.0-1"
    paths: frozenset[str]


def region_nodes(graph: fx.Graph, region: Region) -> set[fx.Node]:
    """The compute nodes of `graph` that run inside one of the region's modules."""
    whole = "" in region.paths
    return {
        n
        for n in graph.nodes
        if n.op in COMPUTE_OPS and (whole or not region.paths.isdisjoint(module_stack(n)))
    }


def outline_regions(
    gm: fx.GraphModule,
    regions: list[Region],
    wrap: Callable[[Region, list[str], fx.GraphModule], nn.Module],
    prefix: str = "smp_region",
) -> list[tuple[Region, list[str], Outlined]]:
    """Outlines each region's nodes in `gm` (in convex pieces) as calls of
    `wrap(region, paths, body)`, where `paths` are the region's modules the piece holds.

    A node inside several regions goes to the first. Returns every piece outlined, with its
    region and module paths, in region order."""
    done: list[tuple[Region, list[str], Outlined]] = []
    for region in regions:
        members = region_nodes(gm.graph, region)
        for nodes in convex_pieces(gm.graph, members):
            stacks = [set(module_stack(n)) for n in nodes]
            paths = sorted((p for p in region.paths if any(p in s for s in stacks)), key=_natural)
            outlined = outline(
                gm, nodes, f"{prefix}_{len(done)}", lambda body, r=region, p=paths: wrap(r, p, body)
            )
            if outlined is not None:
                done.append((region, paths, outlined))
    gm.graph.lint()
    gm.recompile()
    return done


def _natural(path: str) -> list:
    """Sort key: "blocks.10" after "blocks.9"."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split(".")]
