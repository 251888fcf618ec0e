import os
import sys

# Tests import the package from the source tree and the harness from here;
# spawned ranks inherit this sys.path.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for path in (_HERE, os.path.join(_ROOT, "python")):
    if path not in sys.path:
        sys.path.insert(0, path)
