"""How much of a model tensor parallelism actually cut: users turn it on to save memory, so a
model that ends up mostly replicated must say so, and say why."""

from __future__ import annotations

import dataclasses

from torch import nn

import smp.passes as passes
from smp.passes.fx_utils import parent_path

# Below this share of the marked matrix bytes sharded, smp warns.
WARN_BELOW = 0.8


@dataclasses.dataclass(frozen=True)
class Replicated:
    name: str
    bytes: int
    reason: str


@dataclasses.dataclass(frozen=True)
class CoverageReport:
    """Matrix parameters (2 or more dims) of the marked modules: bytes sharded and kept whole."""

    tp_size: int
    sharded_bytes: int
    replicated: tuple[Replicated, ...]  # largest first

    @property
    def replicated_bytes(self) -> int:
        return sum(r.bytes for r in self.replicated)

    @property
    def sharded_share(self) -> float:
        total = self.sharded_bytes + self.replicated_bytes
        return self.sharded_bytes / total if total else 1.0

    def __str__(self) -> str:
        lines = [
            f"smp tensor parallelism (tp={self.tp_size}): {self.sharded_share:.0%} of the marked matrix "
            f"parameters sharded ({_mib(self.sharded_bytes)} sharded, {_mib(self.replicated_bytes)} "
            "replicated on every rank)"
        ]
        for r in self.replicated[:10]:
            lines.append(f"  replicated {r.name} ({_mib(r.bytes)}): {r.reason}")
        if len(self.replicated) > 10:
            lines.append(f"  ... and {len(self.replicated) - 10} smaller ones")
        return "\n".join(lines)


def coverage(
    module: nn.Module, marked: set[str], result: passes.TensorParallelResult, tp_size: int
) -> CoverageReport:
    """The report for `module` (still holding its full parameters) after the pass gave `result`."""
    names: dict[int, list[str]] = {}  # a tied tensor has several names; the pass knows one
    tensors: dict[int, nn.Parameter] = {}
    # smp.nn's modules shard themselves: the pass has no say over their parameters.
    explicit = [path for path, m in module.named_modules() if getattr(m, "smp_explicit_tp", False)]
    for name, p in module.named_parameters(remove_duplicate=False):
        if any(name.startswith(path + ".") for path in explicit):
            continue
        if p.dim() >= 2 and parent_path(name) in marked:
            names.setdefault(id(p), []).append(name)
            tensors[id(p)] = p
    sharded, replicated = 0, []
    for key, p in tensors.items():
        size = p.numel() * p.element_size()
        if any(n in result.specs for n in names[key]):
            sharded += size
        else:
            name = names[key][0]
            replicated.append(Replicated(name, size, _reason(name, result.replicated)))
    replicated.sort(key=lambda r: -r.bytes)
    return CoverageReport(tp_size, sharded, tuple(replicated))


def _reason(name: str, demoted: dict[str, str]) -> str:
    """Why the pass kept `name` whole: its own demotion, or its nearest demoted module's."""
    if name in demoted:
        return demoted[name]
    path = parent_path(name)
    while path:
        if path in demoted:
            return demoted[path]
        path = parent_path(path)
    if "<root>" in demoted:
        return demoted["<root>"]
    return "no tensor-parallel rule cuts the way it is used (not read as a linear or embedding weight)"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
