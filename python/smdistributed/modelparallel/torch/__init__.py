"""`smdistributed.modelparallel.torch` is smp: this module replaces itself with smp.

Submodules resolve to smp's own module objects (not copies), so classes and state are
shared: `smdistributed.modelparallel.torch.nn.FusedLayerNorm is smp.nn.FusedLayerNorm`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

import smp
import smp.nn.huggingface  # noqa: F401  (registers smp.nn.huggingface.<model>)

_ALIAS = __name__


class _SmpAliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `smdistributed.modelparallel.torch.X` to the module `smp.X`."""

    def __init__(self):
        self._own_specs = {}

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_ALIAS + "."):
            return None
        target_name = "smp" + fullname[len(_ALIAS) :]
        if target_name not in sys.modules and importlib.util.find_spec(target_name) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module("smp" + spec.name[len(_ALIAS) :])
        self._own_specs[id(module)] = module.__spec__  # the import system overwrites it next
        return module

    def exec_module(self, module):
        module.__spec__ = self._own_specs.pop(id(module))  # smp's module, already executed


sys.meta_path.insert(0, _SmpAliasFinder())
sys.modules[_ALIAS] = smp
