"""Marking modules for tensor parallelism: `with smp.tensor_parallelism():` and
`smp.set_tensor_parallelism(module)`.

A marked module's linear and embedding layers are sharded over the TP group by the
tensor-parallel graph pass (smp.passes.tensor_parallel) when the DistributedModel
partitions, pairing them Megatron-style where the dataflow allows. Marking a block
(an attention layer, a transformer layer, the whole model) marks everything in it;
`enabled=False` inside a marked block keeps a part replicated. Unmarked modules stay
replicated.
"""

from __future__ import annotations

import contextlib

import torch

from smp import module_marks
from smp.tensor_parallel import registration

_ATTR = "_smp_tensor_parallel"


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, distributed_transformer: bool = False, **kwargs):
    """Modules constructed inside the block are (enabled=True) or are not distributed.

    A class registered with `smp.tp_register` that is built inside is replaced by its
    distributed module, and `kwargs` that the distributed module's __init__ takes override the
    init_hook's (SMP v1's rule); other keywords have no effect: smp shards the model's own layers.
    With `distributed_transformer`, the default registrations (registration.register_default) apply
    too: `smp.tensor_parallelism` (smp.creation) registers SMP v1's Hugging Face models first.
    """
    with (
        module_marks.marking(_ATTR, bool(enabled)),
        registration.distributing(enabled, kwargs, defaults=distributed_transformer),
    ):
        yield


def set_tensor_parallelism(module: torch.nn.Module, enabled: bool = True, **kwargs) -> None:
    """Marks `module` and all its submodules after construction (before smp.DistributedModel)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"smp.set_tensor_parallelism expects an nn.Module, got {type(module).__name__}")
    module_marks.mark(module, _ATTR, bool(enabled), recurse=True, overwrite=True)


def marked_modules(root: torch.nn.Module) -> set[str]:
    """Paths of the modules of `root` marked for tensor parallelism."""
    return {path for path, on in module_marks.marked(root, _ATTR).items() if on}
