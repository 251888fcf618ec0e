"""Context parallelism's errors, each naming the node, the model line and the fix."""

from __future__ import annotations

from torch import fx


class ContextParallelError(ValueError):
    pass


def where(node: fx.Node) -> str:
    """' at <file>:<line> (<code>)' of the model line a node came from, or '' if not recorded."""
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            return f" at {lines[i][5:]}" + (f" ({code})" if code else "")
    return ""
