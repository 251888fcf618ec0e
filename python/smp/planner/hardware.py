"""What a GPU (or a CPU process) and its node can do: the figures the step-time model reads.

A description is a preset's name (hardware_presets.py, each figure with its public source) or a
JSON file with the same keys (`--hardware my_cluster.json`); `benchmarks/plan_step_time.py`
writes one for the CPU processes it measures. Every mistake is a ValueError naming the value and
the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any

from smp.planner.hardware_presets import DEFAULT, PRESETS
from smp.planner.json_file import read_object
from smp.planner.units import parse_memory

DTYPES = ("bf16", "fp16", "fp32")


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    peak_tflops: Mapping[str, float]  # dense matmul peak per dtype (bf16, fp16, fp32)
    matmul_efficiency: float  # the fraction of the peak a large, well-shaped matmul sustains
    compute_units: int  # matmul tiles run at once (SMs); 1 where tiles do not apply (CPU)
    matmul_tiles: tuple[tuple[int, int], ...]  # output tiles a GEMM may use ((1, 1): none)
    memory: int  # bytes per GPU
    memory_bandwidth_gbps: float  # GB/s
    memory_efficiency: float  # the fraction of it elementwise (memory-bound) kernels sustain
    gpus_per_node: int
    intra_node_gbps: float  # per GPU, one direction (NVLink)
    inter_node_gbps: float  # per GPU, one direction (the node's network over its GPUs)
    link_efficiency: float  # the fraction of a link a ring collective sustains
    collective_latency_us: float  # a collective's fixed cost
    intra_node_step_latency_us: float  # per ring step inside a node
    inter_node_step_latency_us: float  # per ring step across nodes
    kernel_overhead_us: float  # added to every kernel (launch; dispatch on a CPU)
    # The fraction of the kernels' rates a whole training step sustains (gaps between kernels,
    # clocks under sustained load), calibrated on smp's own measured steps.
    sustained_fraction: float
    overlap: bool  # whether communication runs beside compute (its own engines or cores)
    sources: str = ""
    # Nanoseconds an element of a transcendental operation (exp, tanh, log, erf, sigmoid, softmax)
    # costs beyond its memory traffic: a CPU core computes them at a few ns an element; a GPU's
    # special-function units keep them memory-bound (0: not counted). Optional in a file.
    transcendental_ns: float = 0.0
    # TFLOP/s a fused attention kernel (sdpa's flash or efficient one) sustains per dtype, forward
    # and backward together (FlashAttention's count: the backward 2.5 forwards). None: the matmul
    # rate (`peak`), as a GPU's flash kernels run near it. A CPU's flash kernel accumulates in fp32
    # whatever the dtype: in bf16 it runs at a fifth or less of a CPU's bf16 matmuls. Optional in
    # a file.
    attention_tflops: Mapping[str, float] | None = None

    def peak(self, dtype: str) -> float:
        """FLOP/s a large matmul sustains in a training step in `dtype` (bf16, fp16, fp32)."""
        return self.peak_tflops[dtype] * 1e12 * self.matmul_efficiency * self.sustained_fraction

    def attention_peak(self, dtype: str) -> float:
        """FLOP/s a fused attention kernel sustains in a training step in `dtype`."""
        if self.attention_tflops is None:
            return self.peak(dtype)
        return self.attention_tflops[dtype] * 1e12 * self.sustained_fraction

    def memory_rate(self) -> float:
        """Bytes per second memory-bound kernels sustain in a training step."""
        return self.memory_bandwidth_gbps * 1e9 * self.memory_efficiency * self.sustained_fraction

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["matmul_tiles"] = [list(t) for t in self.matmul_tiles]
        out["peak_tflops"] = dict(self.peak_tflops)
        if self.attention_tflops is None:
            del out["attention_tflops"]
        else:
            out["attention_tflops"] = dict(self.attention_tflops)
        return out


_OPTIONAL = ("transcendental_ns", "attention_tflops")
_FIELDS = [f.name for f in dataclasses.fields(Hardware) if f.name not in ("name", "sources")]
_FIXES = {
    "peak_tflops": '{"bf16": 312, "fp16": 312, "fp32": 19.5}',
    "memory": '"40GiB"',
    "matmul_tiles": "[[256, 128]] (or [[1, 1]] for a CPU)",
    "overlap": "true or false",
}


def load(spec: str | Mapping[str, Any] | Hardware | None) -> Hardware:
    """A preset's name, a JSON file's path, a dict with the fields, or a Hardware (None: the
    default preset, the seed's ml.p4d.24xlarge)."""
    if isinstance(spec, Hardware):
        return spec
    if spec is None:
        return from_dict(PRESETS[DEFAULT], DEFAULT)
    if isinstance(spec, Mapping):
        return from_dict(spec, str(spec.get("name", "custom")))
    if not isinstance(spec, str):
        raise ValueError(
            f"smp.plan: hardware must be a preset's name or a JSON file, got {type(spec).__name__}"
        )
    if spec in PRESETS:
        return from_dict(PRESETS[spec], spec)
    if spec.endswith(".json") or os.path.exists(spec):
        return from_dict(_read(spec), spec, where=spec)
    close = difflib.get_close_matches(spec, PRESETS, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ValueError(
        f"smp.plan: unknown hardware {spec!r}; {hint}use one of {', '.join(PRESETS)}, or a JSON file "
        "describing yours (see docs/planner.md, 'Hardware')"
    )


def _read(path: str) -> Mapping[str, Any]:
    fix = f"give a JSON object of the fields (docs/planner.md, 'Hardware') or a preset: {', '.join(PRESETS)}"
    return read_object(path, "the hardware file", fix)


def from_dict(data: Mapping[str, Any], name: str, where: str = "") -> Hardware:
    """A Hardware from its fields, each checked; `where` names the file in errors."""
    source = f"the hardware file {where!r}" if where else f"hardware {name!r}"
    unknown = [k for k in data if k not in _FIELDS and k not in ("name", "sources")]
    if unknown:
        close = difflib.get_close_matches(unknown[0], _FIELDS, n=1, cutoff=0.6)
        fix = f"did you mean '{close[0]}'?" if close else f"the fields are {', '.join(_FIELDS)}"
        raise ValueError(f"smp.plan: {source} has an unknown field '{unknown[0]}'; {fix}")
    missing = [k for k in _FIELDS if k not in data and k not in _OPTIONAL]
    if missing:
        example = _FIXES.get(missing[0], "a number")
        raise ValueError(
            f"smp.plan: {source} is missing the field '{missing[0]}'; add \"{missing[0]}\": {example} "
            "(docs/planner.md, 'Hardware', lists every field and its unit)"
        )
    peak = _per_dtype(source, "peak_tflops", data["peak_tflops"])
    attention = data.get("attention_tflops")
    attention = None if attention is None else _per_dtype(source, "attention_tflops", attention)
    numbers = {k: _number(source, k, data[k]) for k in _FIELDS if k not in _NOT_NUMBERS and k in data}
    for k in ("matmul_efficiency", "memory_efficiency", "link_efficiency", "sustained_fraction"):
        if not 0 < numbers[k] <= 1:
            raise ValueError(f"smp.plan: {source}: {k} must be a fraction in (0, 1], got {data[k]!r}")
    return Hardware(
        name=name,
        description=str(data["description"]),
        peak_tflops=peak,
        matmul_efficiency=numbers["matmul_efficiency"],
        compute_units=_count(source, "compute_units", data["compute_units"]),
        matmul_tiles=_tiles(source, data["matmul_tiles"]),
        memory=parse_memory(data["memory"]),
        memory_bandwidth_gbps=numbers["memory_bandwidth_gbps"],
        memory_efficiency=numbers["memory_efficiency"],
        gpus_per_node=_count(source, "gpus_per_node", data["gpus_per_node"]),
        intra_node_gbps=numbers["intra_node_gbps"],
        inter_node_gbps=numbers["inter_node_gbps"],
        link_efficiency=numbers["link_efficiency"],
        collective_latency_us=numbers["collective_latency_us"],
        intra_node_step_latency_us=numbers["intra_node_step_latency_us"],
        inter_node_step_latency_us=numbers["inter_node_step_latency_us"],
        kernel_overhead_us=numbers["kernel_overhead_us"],
        sustained_fraction=numbers["sustained_fraction"],
        overlap=_flag(source, data["overlap"]),
        sources=str(data.get("sources", "")),
        transcendental_ns=numbers.get("transcendental_ns", 0.0),
        attention_tflops=attention,
    )


def _per_dtype(source: str, key: str, value: Any) -> dict[str, float]:
    if not isinstance(value, Mapping) or any(not _positive_number(value.get(d)) for d in DTYPES):
        raise ValueError(
            f"smp.plan: {source}: {key} must give a positive number for each of {', '.join(DTYPES)}, "
            f"got {value!r}; write e.g. {_FIXES['peak_tflops']}"
        )
    return {d: float(value[d]) for d in DTYPES}


_NOT_NUMBERS = (
    "description",
    "peak_tflops",
    "attention_tflops",
    "compute_units",
    "matmul_tiles",
    "memory",
    "gpus_per_node",
    "overlap",
)
_MAY_BE_ZERO = (
    "kernel_overhead_us",
    "collective_latency_us",
    "intra_node_step_latency_us",
    "inter_node_step_latency_us",
    "transcendental_ns",
)


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _number(source: str, key: str, value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or value < 0 or (value == 0 and key not in _MAY_BE_ZERO):
        raise ValueError(f"smp.plan: {source}: {key} must be a positive number, got {value!r}")
    return float(value)


def _count(source: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"smp.plan: {source}: {key} must be a positive integer, got {value!r}")
    return value


def _flag(source: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"smp.plan: {source}: overlap must be true or false, got {value!r}")
    return value


def _tiles(source: str, value: Any) -> tuple[tuple[int, int], ...]:
    try:
        tiles = tuple((int(m), int(n)) for m, n in value)
    except (TypeError, ValueError):
        tiles = ()
    if not tiles or any(m < 1 or n < 1 for m, n in tiles):
        raise ValueError(
            f"smp.plan: {source}: matmul_tiles must be a list of [rows, columns] pairs, got {value!r}; "
            f"write e.g. {_FIXES['matmul_tiles']}"
        )
    return tiles


def check_nodes(hardware: Hardware, gpus: int, gpus_per_node: int | None = None) -> int:
    """The GPUs per node to plan with (given, else the hardware's), checked against `gpus`."""
    per_node = hardware.gpus_per_node if gpus_per_node is None else gpus_per_node
    if gpus > per_node and gpus % per_node:
        fewer, more = gpus // per_node * per_node, (gpus // per_node + 1) * per_node
        raise ValueError(
            f"smp.plan: {gpus} GPUs do not fill nodes of {per_node} ({hardware.name}); give a multiple of "
            f"{per_node}, e.g. {fewer} or {more}"
        )
    return per_node
