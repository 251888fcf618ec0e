"""Seconds of the pieces a step is made of, on a Hardware: a matmul, a memory-bound pass, a ring
collective, a point-to-point message.

- A matmul of [m, k] x [k, n] (`batch` of them) runs at the hardware's sustained matmul rate,
  scaled by how much of its tiles' waves does useful work: the output is cut into tiles (the best
  of the hardware's tile shapes), `compute_units` run at once, and the last wave's idle units and
  the tiles' padding past the matrix edge are lost. That is why small shards run slower: a
  tensor-parallel shard of a small layer fills few waves. It cannot run faster than it moves its
  operands through memory (the roofline), plus a fixed per-kernel overhead.
- A memory-bound pass (norms, activations, softmax, dropout, gradient accumulation, the
  optimizer) moves its bytes at the sustained memory bandwidth.
- A ring collective over n ranks moves 2 (n - 1) / n (all-reduce) or (n - 1) / n (all-gather,
  reduce-scatter) of the buffer through each rank's link at the link's sustained bandwidth, plus
  NCCL's latency per ring step. A group crossing nodes is bounded by the network: its members on
  one node share their node's adapters (NCCL runs a ring per adapter), so it moves at the network
  bandwidth of the GPUs of the group in one node, at most the NVLink bandwidth.
"""

from __future__ import annotations

import dataclasses
import math

from smp.planner.hardware import Hardware

GB = 1e9


def matmul(hw: Hardware, dtype: str, m: int, n: int, k: int, batch: int = 1) -> float:
    flops = 2.0 * m * n * k * batch
    if flops == 0:
        return 0.0
    compute = flops / (hw.peak(dtype) * wave_efficiency(hw, m, n, batch))
    elem = 4 if dtype == "fp32" else 2
    memory = elem * batch * (m * k + k * n + m * n) / _memory_bandwidth(hw)
    return max(compute, memory) + hw.kernel_overhead_us * 1e-6


def wave_efficiency(hw: Hardware, m: int, n: int, batch: int = 1) -> float:
    """The useful fraction of the tile slots a matmul's waves occupy (1: no quantization)."""
    best = 0.0
    for tm, tn in hw.matmul_tiles:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        waves = math.ceil(tiles / hw.compute_units)
        best = max(best, m * n * batch / (waves * hw.compute_units * tm * tn))
    return best


def memory_pass(hw: Hardware, nbytes: float, kernels: float = 0.0) -> float:
    """Seconds to move `nbytes` through memory, in `kernels` kernels."""
    return nbytes / _memory_bandwidth(hw) + kernels * hw.kernel_overhead_us * 1e-6


def transcendental(hw: Hardware, elements: float) -> float:
    """Seconds `elements` of exp, tanh, log, ... cost beyond their memory traffic."""
    return elements * hw.transcendental_ns * 1e-9


def _memory_bandwidth(hw: Hardware) -> float:
    return hw.memory_rate()


@dataclasses.dataclass(frozen=True)
class Group:
    """A process group: `size` ranks `stride` global ranks apart (smp's topology puts tensor
    parallelism fastest, then pipeline, then data parallelism)."""

    size: int
    stride: int

    def spans_nodes(self, gpus_per_node: int, gpus: int) -> bool:
        """Whether some group of this shape crosses a node boundary (the slowest paces them all):
        its block of size x stride ranks is larger than a node or does not divide it."""
        block = self.size * self.stride
        return gpus > gpus_per_node and (block > gpus_per_node or gpus_per_node % block != 0)

    def members_per_node(self, gpus_per_node: int) -> int:
        return max(1, min(self.size, gpus_per_node // self.stride))


def link_bandwidth(hw: Hardware, group: Group, gpus_per_node: int, gpus: int) -> float:
    """Bytes per second a ring over `group` moves per rank (see the module's docstring)."""
    intra = hw.intra_node_gbps * GB * hw.link_efficiency
    if not group.spans_nodes(gpus_per_node, gpus):
        return intra
    inter = hw.inter_node_gbps * GB * hw.link_efficiency * group.members_per_node(gpus_per_node)
    return min(intra, inter)


def _step_latency(hw: Hardware, group: Group, gpus_per_node: int, gpus: int) -> float:
    spans = group.spans_nodes(gpus_per_node, gpus)
    return (hw.inter_node_step_latency_us if spans else hw.intra_node_step_latency_us) * 1e-6


def all_reduce(hw: Hardware, nbytes: float, group: Group, gpus_per_node: int, gpus: int) -> float:
    return 2 * _half_ring(hw, nbytes, group, gpus_per_node, gpus)


def all_gather(hw: Hardware, nbytes: float, group: Group, gpus_per_node: int, gpus: int) -> float:
    """An all-gather (or a reduce-scatter) of a `nbytes` buffer (the whole, not a shard)."""
    return _half_ring(hw, nbytes, group, gpus_per_node, gpus)


def _half_ring(hw: Hardware, nbytes: float, group: Group, gpus_per_node: int, gpus: int) -> float:
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    bandwidth = link_bandwidth(hw, group, gpus_per_node, gpus)
    return (n - 1) / n * nbytes / bandwidth + half_ring_latency(hw, group, gpus_per_node, gpus)


def half_ring_latency(hw: Hardware, group: Group, gpus_per_node: int, gpus: int) -> float:
    """The fixed cost of an all-gather or a reduce-scatter (an all-reduce is two): NCCL's base
    latency (counted half per half) and one step per rank passed."""
    if group.size <= 1:
        return 0.0
    steps = group.size - 1
    return hw.collective_latency_us * 1e-6 / 2 + steps * _step_latency(hw, group, gpus_per_node, gpus)


def send(hw: Hardware, nbytes: float, across_nodes: bool) -> float:
    """One point-to-point message between two GPUs (a pipeline boundary)."""
    if nbytes <= 0:
        return 0.0
    gbps = hw.inter_node_gbps if across_nodes else hw.intra_node_gbps
    step = hw.inter_node_step_latency_us if across_nodes else hw.intra_node_step_latency_us
    return nbytes / (gbps * GB * hw.link_efficiency) + (hw.collective_latency_us + step) * 1e-6
