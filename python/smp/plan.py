"""`python -m smp.plan`: the config planner's command line (smp/planner/cli.py).

`smp.plan` is also the planner function (smp/__init__.py imports it from smp.planner). Importing
this module by name (`import smp.plan`) makes the attribute `smp.plan` this module, so the
module is made callable: `smp.plan(...)` plans either way.
"""

from __future__ import annotations

import sys
import types

from smp.planner import plan as _plan
from smp.planner.cli import main


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _plan(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
