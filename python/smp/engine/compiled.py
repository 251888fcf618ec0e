"""torch.compile of the stage graphs, or of a model that runs whole (config key 'compile'),
counting compilations.

Each cached input signature has its own stage graph, compiled on its first call: a
compilation per (signature, mode) is expected, and the count tells a user what the shape
changes cost. Pipeline messages stay outside the compiled region (the stage runtime sends
and receives around the call); tensor-parallel collectives are custom ops inside it. A model
that runs whole (data parallelism alone) is compiled as a module: the gradient buckets'
hooks on its parameters run outside the graph, after each gradient is accumulated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_COMPILES = 0  # compilations since the process started (every compiled stage graph)


def compiles() -> int:
    """How many stage graphs torch.compile has compiled (or recompiled) in this process."""
    return _COMPILES


class _Counting:
    """A torch.compile backend that counts its calls (one per compilation) and delegates."""

    def __init__(self, options: dict[str, Any]):
        backend = options.get("backend", "inductor")
        if backend == "inductor":
            # No on-disk graph cache: with a warm cache the pp2 x tp2 parity test failed (twice),
            # with a fresh one it passed: a cached artifact of another rank's stage graph (whose
            # rank-dependent parts the cache key misses, we suspect) was reused.
            inductor = {"fx_graph_cache": False} | dict(options.get("options") or {})
            self._backend = torch._TorchCompileInductorWrapper(
                options.get("mode"), inductor, options.get("dynamic")
            )
        else:
            self._backend = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend

    def __call__(self, gm, example_inputs):
        global _COMPILES
        _COMPILES += 1
        with torch._functorch.config.patch(enable_autograd_cache=False):  # (see the graph cache above)
            return self._backend(gm, example_inputs)


def compile_stage(module: nn.Module, options: dict[str, Any]) -> nn.Module:
    """`module` (a stage graph, or a model that runs whole) compiled with torch.compile's `options`
    (inductor by default)."""
    return torch.compile(
        module,
        backend=_Counting(options),
        dynamic=options.get("dynamic", False),
        fullgraph=options.get("fullgraph", False),
    )


def compile_forward(module: nn.Module, options: dict[str, Any]) -> None:
    """Compiles `module`'s own forward in place (its hooks, FSDP2's gathers, stay outside the
    graph; its state_dict keys stay): sharded data parallelism's layers, as torchtitan compiles
    each block under FSDP2."""
    module.forward = torch.compile(
        module.forward,
        backend=_Counting(options),
        dynamic=options.get("dynamic", False),
        fullgraph=options.get("fullgraph", False),
    )
