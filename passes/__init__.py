"""smp.passes: graph passes over torch.fx GraphModules, usable on their own.

    captured = capture(model, args, kwargs)        # torch.export, non-strict
    cost.annotate(captured.graph_module)           # FLOPs and activation bytes per node
    plan = auto_partition(captured.graph_module, num_stages=4, memory_weight=0.8)
    print(plan.report())
    pipe = split(captured, plan)                   # one GraphModule per stage

    tensor_parallel(captured.graph_module, tp_group, marked_module_paths)
                                                   # before split: marked layers sharded over tp_group
    context_parallel(captured.graph_module, cp_group, "p2p")
                                                   # then: this rank's part of the sequence
    regions.outline_regions(pipe.stages[0].module, [Region("layers.0", frozenset({"layers.0"}))], wrap)
                                                   # after split: a module's nodes become one call

Running `pipe.stages` in order, feeding each the values it receives, computes the
model's forward; smp.DistributedModel does that across processes.

Modules: capture.py (torch.export), bindings.py (a graph's forward through the Python bindings
of its ops: faster eager), cost.py (FLOPs, bytes, measured times), partition.py
(pipeline stages), follow.py (stages of another capture, following a partition), split.py (one
GraphModule per stage), outline.py and regions.py (module regions moved into submodules:
activation checkpointing), linear_forms.py (every spelling of a linear layer made one),
fx_utils.py (helpers they share), and the tensor_parallel/ package (the rewrite driver, its
layout algebra, and a registry of rules, one per op, in rules/ by op family). This folder is
installed as smp.passes (setup.py maps it).
"""

from . import bindings, cost, outline, regions
from .capture import CapturedGraph, CaptureError, capture
from .context_parallel import ContextParallelError, ContextParallelResult, context_parallel
from .follow import follow_modules, follow_partition, module_stages
from .partition import (
    PartitionError,
    PartitionPlan,
    Segment,
    auto_partition,
    manual_partition,
    plan_from_assignment,
    segments,
)
from .split import OutputLeaf, PipelineGraph, StageModule, Value, split
from .tensor_parallel import ShardSpec, TensorParallelResult, module_specs, tensor_parallel

__all__ = [
    "CaptureError",
    "ContextParallelError",
    "ContextParallelResult",
    "context_parallel",
    "CapturedGraph",
    "OutputLeaf",
    "PartitionError",
    "PartitionPlan",
    "PipelineGraph",
    "Segment",
    "StageModule",
    "Value",
    "auto_partition",
    "bindings",
    "capture",
    "cost",
    "outline",
    "regions",
    "follow_modules",
    "follow_partition",
    "module_stages",
    "manual_partition",
    "plan_from_assignment",
    "segments",
    "split",
    "ShardSpec",
    "module_specs",
    "TensorParallelResult",
    "tensor_parallel",
]
