"""smp.passes lives in the checkout's top-level passes/ folder; setup.py maps it into the package.

An installed wheel holds it under smp/passes. An editable install maps it with a finder that
points at the checkout it was installed from, so a second checkout of smp (a test run from
another tree) would import the first one's passes. In a checkout, `smp.passes` is therefore loaded
from the passes/ beside this package's own python/ folder.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def load_checkout_passes(package_dir: str) -> None:
    """Loads smp.passes from <checkout>/passes when `package_dir` (smp's folder) has no passes/."""
    passes = os.path.join(os.path.dirname(os.path.dirname(package_dir)), "passes")
    init = os.path.join(passes, "__init__.py")
    if "smp.passes" in sys.modules or os.path.isdir(os.path.join(package_dir, "passes")):
        return
    if not os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location("smp.passes", init, submodule_search_locations=[passes])
    module = importlib.util.module_from_spec(spec)
    sys.modules["smp.passes"] = module
    spec.loader.exec_module(module)
    sys.modules["smp"].passes = module  # (as the import system sets a loaded submodule)


load_checkout_passes(os.path.dirname(os.path.abspath(__file__)))
