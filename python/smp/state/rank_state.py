"""What each rank keeps in a checkpoint besides the model and the optimizer: the random number
generators training reads (torch's, CUDA's, Python's, numpy's: dropout and data augmentation
continue as if the job had not stopped) and the state of objects registered with
`smp.register_stateful(name, obj)` (a data loader's position: smp.data_loader's loaders register
themselves; torchdata's StatefulDataLoader, or any object with state_dict() and
load_state_dict(), can be registered).

Each rank writes its own part. A resume on the same layout gives each rank its own back. On
another layout (fewer ranks, other degrees) the generators are left as they are (their streams
belonged to ranks that no longer exist: a warning says so), objects whose state is the same on
every rank (`smp_global_state = True`, as smp.data_loader's: a position in the global sample
order) take the first rank's, and other objects keep theirs, with a warning naming them.
"""

from __future__ import annotations

import random
import warnings
from typing import Any, Protocol

import torch


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


_registered: dict[str, Stateful] = {}
_waiting: dict[str, dict] = {}  # states resumed before their object was registered
_numbered: dict[str, int] = {}  # prefix -> objects registered under it so far


def register_numbered(prefix: str, obj: Stateful) -> str:
    """Registers `obj` as "<prefix>.<n>", n counting this process's registrations under `prefix`
    (a script that makes its loaders in the same order names them alike in every run)."""
    n = _numbered.get(prefix, 0)
    _numbered[prefix] = n + 1
    name = f"{prefix}.{n}"
    register(name, obj)
    return name


def register(name: str, obj: Stateful) -> None:
    """Keeps `obj`'s state (state_dict / load_state_dict) in every checkpoint, under `name`; a state
    resumed before it was registered is loaded into it now."""
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(
            f"smp.register_stateful: {name!r} is a {type(obj).__name__}, which has no state_dict() and "
            "load_state_dict(); register an object that has both (e.g. torchdata's StatefulDataLoader)"
        )
    _registered[name] = obj
    if name in _waiting:
        obj.load_state_dict(_waiting.pop(name))


def forget() -> None:
    """Drops every registration (smp.parallel_state.reset)."""
    _registered.clear()
    _waiting.clear()
    _numbered.clear()


def capture(layout: tuple) -> dict[str, Any]:
    """This rank's state now (copied: training may go on while it is written)."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        rng["numpy"] = np.random.get_state()
    except ImportError:
        pass
    objects = {name: obj.state_dict() for name, obj in _registered.items()}
    return {"layout": tuple(layout), "rng": rng, "objects": objects}


def restore(own: dict[str, Any] | None, first: dict[str, Any], layout: tuple) -> None:
    """Puts back this rank's state (`own`: its file on the same layout, else None) or, on another
    layout, what moves between layouts (`first`: the first rank's)."""
    same = own is not None and tuple(own["layout"]) == tuple(layout)
    if same:
        _set_rng(own["rng"])
        states = own["objects"]
    else:
        warnings.warn(
            f"smp.resume_from_checkpoint: the checkpoint was saved on layout {tuple(first['layout'])} and "
            f"this run is {tuple(layout)}: the random number generators start afresh (their streams "
            "belonged to the ranks that saved them)",
            stacklevel=3,
        )
        states = {}
        for name, state in first["objects"].items():
            obj = _registered.get(name)
            if obj is None or getattr(obj, "smp_global_state", False):
                states[name] = state
            else:
                warnings.warn(
                    f"smp.resume_from_checkpoint: {name!r} keeps its state: it was saved per rank on "
                    f"layout {tuple(first['layout'])} and cannot move to {tuple(layout)}",
                    stacklevel=3,
                )
    for name, state in states.items():
        obj = _registered.get(name)
        if obj is None:
            _waiting[name] = state
        else:
            obj.load_state_dict(state)


def _set_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "numpy" in rng:
        import numpy as np

        np.random.set_state(rng["numpy"])
