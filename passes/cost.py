"""Cost annotation: how much compute and memory each node of a captured graph costs.

Compute is FLOPs estimated from the shapes the capture recorded (`node.meta["val"]`),
or measured seconds when the caller has them. Memory is activation bytes (each
node's outputs, which autograd may keep for backward) here, plus parameter bytes,
which the partitioner adds per stage so a parameter counts once per stage that holds it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

from .fx_utils import COMPUTE_OPS, tensor_leaves

FLOPS = "smp_flops"
ACTIVATION_BYTES = "smp_activation_bytes"
SECONDS = "smp_seconds"
# On a node that stands for a region of nodes a pass replaced (one call of an experts module): their
# FLOPs, which the call's own shapes do not tell.
REGION_FLOPS = "smp_region_flops"

# Bytes of state per parameter byte: the weights, their gradients and Adam's two moments.
OPTIMIZER_FACTOR = 4


_CONTRACT_LAST_DIM = (torch.ops.aten.linear.default, torch.ops.aten.matmul.default)


def annotate(gm: fx.GraphModule, seconds: Mapping[str, float] | None = None) -> None:
    """Writes FLOPS, ACTIVATION_BYTES (and SECONDS when given, by node name) into node.meta."""
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        node.meta[FLOPS] = node_flops(node)
        node.meta[ACTIVATION_BYTES] = _bytes(node.meta.get("val"))
        if seconds is not None:
            node.meta[SECONDS] = float(seconds.get(node.name, 0.0))


def node_flops(node: fx.Node) -> float:
    if REGION_FLOPS in node.meta:
        return float(node.meta[REGION_FLOPS])
    out = node.meta.get("val")
    target = node.target
    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
    if target in _CONTRACT_LAST_DIM and isinstance(out, torch.Tensor):
        # linear and matmul: every output element is a dot product over the input's last axis.
        return 2.0 * out.numel() * args[0].shape[-1]
    packet = getattr(target, "overloadpacket", None)
    if packet in flop_registry:
        try:
            return float(flop_registry[packet](*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not accept this overload: fall back below
            pass
    # Elementwise ops and reductions: about one operation per element produced or read.
    # Parameters are not all read (an embedding lookup reads a few rows of its table).
    activations = [p.meta.get("val") for p in node.all_input_nodes if p.op != "get_attr"]
    return float(max(_numel(out), _numel(activations)))


def measure_seconds(gm: fx.GraphModule, flat_inputs: list, repeats: int = 3) -> dict[str, float]:
    """Times each node of `gm` run eagerly on `flat_inputs`; the fastest of `repeats` runs per node."""
    best: dict[str, float] = {}

    class Timer(fx.Interpreter):
        def run_node(self, n):
            start = time.perf_counter()
            result = super().run_node(n)
            if isinstance(result, torch.Tensor) and result.is_cuda:
                torch.cuda.synchronize(result.device)
            elapsed = time.perf_counter() - start
            best[n.name] = min(best.get(n.name, math.inf), elapsed)
            return result

    # The graph may update buffers (BatchNorm statistics) or inputs in place: time it on
    # copies of the inputs, put the buffers back, and leave the random state as it was.
    buffers = {name: b.clone() for name, b in gm.named_buffers()}
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for _ in range(repeats):
            inputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in flat_inputs]
            Timer(gm).run(*inputs)
        for name, b in gm.named_buffers():
            b.copy_(buffers[name])
    return best


def _numel(value) -> int:
    return sum(t.numel() for t in tensor_leaves(value))


def _bytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tensor_leaves(value))
