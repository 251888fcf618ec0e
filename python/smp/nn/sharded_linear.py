"""Linear layers whose weights are this rank's shards: the column- and row-parallel halves of a
Megatron pair, and SMP v1's DistributedLinear (a drop-in nn.Linear).

Their state_dict keys are nn.Linear's (`weight` [out, in], `bias`), holding this rank's slice.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from smp import ops
from smp.nn import initialization as init
from smp.nn import tp_group
from smp.nn.distributed_module import DistributedModule


def _fills(fan_in: int, normal: bool, std: float):
    if normal:
        return init.normal(std), init.zeros()
    return init.kaiming_uniform(fan_in), init.linear_bias(fan_in)


class ColumnParallelLinear(DistributedModule):
    """in_features -> this rank's slice of out_features (weight and bias cut by rows). The input
    is the same on every rank; the output is sharded on its last dimension unless `gather`."""

    SHARD_DIMS = {"weight": 0, "bias": 0}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather: bool = False,
        use_normal_initialization: bool = False,
        initializer_range: float = 0.02,
        initialize_with_same_seed: bool = False,
        owner: str = "ColumnParallelLinear",
    ):
        super().__init__()
        self.in_features, self.out_features, self.gather = in_features, out_features, gather
        local = tp_group.divide(owner, "out_features", out_features)
        w, b = _fills(in_features, use_normal_initialization, initializer_range)
        self.new_parameter("weight", (local, in_features), 0, w, initialize_with_same_seed)
        if bias:
            self.new_parameter("bias", (local,), 0, b, initialize_with_same_seed)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        group = self.shard_group()
        if group is None:
            return F.linear(x, self.weight, self.bias)
        out = ops.column_parallel_linear(x, self.weight, self.bias, group)
        return ops.tp_gather(out, -1, group) if self.gather else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (sharded)"


class RowParallelLinear(DistributedModule):
    """This rank's slice of in_features -> out_features, summed over the group (one all-reduce);
    the bias is whole on every rank and added once."""

    SHARD_DIMS = {"weight": 1}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        use_normal_initialization: bool = False,
        initializer_range: float = 0.02,
        initialize_with_same_seed: bool = False,
        owner: str = "RowParallelLinear",
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        local = tp_group.divide(owner, "in_features", in_features)
        w, b = _fills(in_features, use_normal_initialization, initializer_range)
        self.new_parameter("weight", (out_features, local), 1, w, initialize_with_same_seed)
        if bias:
            self.new_parameter("bias", (out_features,), None, b, initialize_with_same_seed)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        group = self.shard_group()
        if group is None:
            return F.linear(x, self.weight, self.bias)
        return ops.row_parallel_linear(x, self.weight, self.bias, group)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (sharded), out_features={self.out_features}"


class DistributedLinear(ColumnParallelLinear):
    """SMP v1's DistributedLinear(in_features, out_features): an nn.Linear with the global sizes,
    its output features cut over the tensor-parallel group and its output gathered, so it takes
    and returns what nn.Linear does. `bias` and the initialization keywords are smp's additions."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        use_normal_initialization: bool = False,
        initializer_range: float = 0.02,
        initialize_with_same_seed: bool = False,
    ):
        super().__init__(
            in_features,
            out_features,
            bias=bias,
            gather=True,
            use_normal_initialization=use_normal_initialization,
            initializer_range=initializer_range,
            initialize_with_same_seed=initialize_with_same_seed,
            owner="DistributedLinear",
        )


__all__ = ["ColumnParallelLinear", "DistributedLinear", "RowParallelLinear"]
