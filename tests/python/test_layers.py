"""The layering of docs/architecture.md, checked against the code's imports.

Each unit (a top-level module of python/smp/, a package of it, or passes/ as smp.passes) sits on
one layer; an import may point down or sideways, never up. And no two modules import each other,
directly or in a longer circle, type-only imports included. Both read the source with ast, so the
check needs nothing imported.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Bottom to top, as docs/architecture.md draws them.
LAYERS: dict[str, int] = {
    "_C": 0,  # the C++ extension (ops/, backend/)
    "passes": 1,
    **dict.fromkeys(
        [
            "config",
            "config_options",
            "config_rules",
            "inert",
            "devices",
            "schedules",
            "groups",
            "topology",
            "faults",
            "params",
            "finite_check",
            "module_marks",
            "hf",
            "ops",
            "cp_ops",
            "_backend",
            "_checkout",
            "attempt",
            "services",
        ],
        2,
    ),
    **dict.fromkeys(
        [
            "pipeline",
            "tensor_parallel",
            "context_parallel",
            "data_parallel",
            "expert_parallel",
            "sharded_data",
            "optim",
            "gradients",
            "recompute",
            "state",
            "planner",
        ],
        3,
    ),
    "engine": 4,
    **dict.fromkeys(
        [
            "__init__",
            "model",
            "optimizer",
            "optimizer_guards",
            "step",
            "checkpoint",
            "comm",
            "data",
            "compat",
            "creation",
            "plan",
            "parallel_state",
            "nn",
            "amp",
        ],
        5,
    ),
}


def _sources() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for smp and smp.passes."""
    found = {}
    for base, prefix in ((ROOT / "python" / "smp", "smp"), (ROOT / "passes", "smp.passes")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: set[str]) -> set[str]:
    """The smp modules `name` imports (`from smp import faults` imports smp.faults), type-only
    imports included."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        out |= {t for t in targets if t.split(".")[0] == "smp"}
    return out


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    sources = _sources()
    modules = set(sources) | {"smp._C"}
    return {name: _imports(name, path, modules) - {name} for name, path in sources.items()}


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _graph()}
    assert units <= set(LAYERS), (
        f"units without a layer in this test and docs/architecture.md: {units - set(LAYERS)}"
    )


def test_no_import_points_up_a_layer():
    upward = [
        f"{source} (layer {LAYERS[_unit(source)]}) imports {target} (layer {LAYERS[_unit(target)]})"
        for source, targets in _graph().items()
        for target in targets
        if _unit(target) in LAYERS and LAYERS[_unit(target)] > LAYERS[_unit(source)]
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = _graph()
    # smp/__init__.py imports the API and the API imports submodules through `from smp import x`,
    # which loads smp first: the package's own face is not part of any module's dependencies.
    edges = {m: {t for t in ts if t in graph and t != "smp"} for m, ts in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                return path[path.index(t) :] + [t]
            if t not in state and (found := visit(t)) is not None:
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(edges):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)
