"""Loading a checkpoint's files without running code from them.

`torch.load(weights_only=True)` unpickles tensors and plain containers only. SMP v1 scripts also
keep ordinary data in their `user_content`: numpy scalars and dtypes (a parameter count from
np.prod), numpy arrays, and a transformers configuration. Those types are data: rebuilding them
calls no function a file can choose. They are allowed by name (`allowed_globals`); any other
global a file names is refused, with the names, before anything is unpickled.
"""

from __future__ import annotations

import importlib
import pickle
from typing import Any

import torch

# numpy's pickled scalars, dtypes and arrays (numpy 2's `_core` and numpy 1's `core`).
_NUMPY = {
    "numpy.ndarray",
    "numpy.dtype",
    "numpy._core.multiarray.scalar",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy.core.multiarray._reconstruct",
}


def load(filename: str, map_location, weights_only: bool, caller: str) -> Any:
    """torch.load, with the data types above allowed under weights_only; other objects are refused
    with an error naming them (pass weights_only=False for a trusted file)."""
    if not weights_only:
        return torch.load(filename, map_location=map_location, weights_only=False)
    allowed, refused = allowed_globals(torch.serialization.get_unsafe_globals_in_checkpoint(filename))
    if refused:
        raise pickle.UnpicklingError(_refusal(caller, filename, ", ".join(refused)))
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(filename, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise pickle.UnpicklingError(_refusal(caller, filename, str(err).splitlines()[0])) from err


def allowed_globals(names: list[str]) -> tuple[list[Any], list[str]]:
    """(the objects to allow for these global names, the names refused)."""
    allowed: list[Any] = []
    refused: list[str] = []
    for name in names:
        found = _data_type(name)
        if found is None:
            refused.append(name)
        else:
            allowed.append(found)
    if any(name.startswith("numpy.") for name in names):
        allowed += _numpy_dtype_classes()  # rebuilt by a dtype's state, never named in the file
    return allowed, refused


def _data_type(name: str) -> Any | None:
    module, _, attr = name.rpartition(".")
    if name in _NUMPY or module == "numpy.dtypes":
        return _attribute(module, attr)
    if module.startswith("transformers."):  # installed code, imported by its own name only
        found = _attribute(module, attr)
        return found if _is_transformers_config(found) else None
    return None


def _attribute(module: str, attr: str) -> Any | None:
    try:
        return getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None


def _is_transformers_config(obj: Any) -> bool:
    try:
        from transformers import PretrainedConfig
    except ImportError:
        return False
    return isinstance(obj, type) and issubclass(obj, PretrainedConfig)


def _numpy_dtype_classes() -> list[type]:
    import numpy

    return [getattr(numpy.dtypes, n) for n in dir(numpy.dtypes) if n.endswith("DType")]


def _refusal(caller: str, filename: str, what: str) -> str:
    return (
        f"{caller}: {filename} holds objects other than tensors, plain containers, numpy values and "
        f"transformers configurations ({what}); unpickling them could run code, so it was refused. "
        "If you wrote this file and trust it, pass weights_only=False"
    )
