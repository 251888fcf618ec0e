"""The base of smp.nn's distributed modules: parameters that are this rank's shards.

What the rest of smp needs to know is kept on the module, not on its Parameter objects
(smp.DistributedModel gives a module new Parameter objects when it wraps it):
- `shard_dims`: for each of the module's own parameters, the dimension along which it is this
  rank's slice of the whole tensor, or None when every rank holds it whole (norms, a
  row-parallel layer's bias);
- the class attribute `smp_explicit_tp`, and every subclass registered with the graph
  tensor-parallel pass (`register_explicit_module`) with its class's `SHARD_DIMS`, so the pass
  never cuts their parameters again and reports the slices as shards (smp.DistributedModel then
  averages their gradients over the replicas only, counts them in the global norm on every
  rank, and gathers them in state_dict()).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from smp.nn import initialization, tp_group
from smp.passes.tensor_parallel import register_explicit_module


class DistributedModule(nn.Module):
    """SMP v1's `smp.nn.DistributedModule`: a module whose parameters are its tensor-parallel shards."""

    smp_explicit_tp = True
    # The class's own parameters that are slices, with their dimension (for the graph pass).
    SHARD_DIMS: ClassVar[dict[str, int]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_explicit_module(cls, cls.SHARD_DIMS)

    def __init__(self):
        super().__init__()
        # The degree the shards were cut for: the group at call time must still have it.
        self.tp_degree = tp_group.tp_size()
        self.shard_dims: dict[str, int | None] = {}
        self._fills: dict[str, tuple[int | None, initialization.Fill, bool]] = {}

    def shard_group(self):
        """The tensor-parallel group the shards belong to (None when they are whole)."""
        if tp_group.tp_size() != self.tp_degree:
            raise RuntimeError(
                f"smp.nn.{type(self).__name__} was built for tensor-parallel degree {self.tp_degree} but "
                f"runs at degree {tp_group.tp_size()}: build distributed modules after smp.init, under "
                "the config they will run with"
            )
        return tp_group.tp_group()

    def new_parameter(
        self, name: str, shape: tuple[int, ...], dim: int | None, fill: initialization.Fill, same_seed: bool
    ) -> nn.Parameter:
        """Registers parameter `name` of local `shape`, this rank's slice along `dim`, filled by `fill`
        (later, by reset_parameters, when delayed initialization registered it on the meta device)."""
        self.register_parameter(name, nn.Parameter(torch.empty(shape)))
        self.shard_dims[name] = dim if self.tp_degree > 1 else None
        self._fills[name] = (dim, fill, same_seed)
        param = self._parameters[name]
        if not param.is_meta:
            initialization.fill_shard(param.data, dim, fill, same_seed)
        return param

    def reset_parameters(self) -> None:
        """Fills the module's own parameters as its constructor does (delayed initialization)."""
        for name, (dim, fill, same_seed) in self._fills.items():
            initialization.fill_shard(self._parameters[name].data, dim, fill, same_seed)


register_explicit_module(DistributedModule)


def shard_dims(module: nn.Module) -> dict[str, int]:
    """Parameter name (as in module.named_parameters()) -> the dimension it is cut along, for
    every sharded parameter of the distributed modules in `module`."""
    cuts = {}
    for path, sub in module.named_modules():
        if isinstance(sub, DistributedModule):
            for name, dim in sub.shard_dims.items():
                if dim is not None:
                    cuts[f"{path}.{name}" if path else name] = dim
    return cuts
