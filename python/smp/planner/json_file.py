"""Reading a JSON object from a file the user named, every failure a ValueError naming the file
and the fix (a model's config.json, a hardware description)."""

from __future__ import annotations

import json
from typing import Any


def read_object(path: str, what: str, fix: str) -> dict[str, Any]:
    """The JSON object in `path`; `what` names the file in errors ("the model config"), `fix` says
    what to pass instead."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"smp.plan: cannot read {what} {path!r} ({e.strerror}); {fix}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"smp.plan: {what} {path!r} is not valid JSON ({e}); {fix}") from e
    if not isinstance(data, dict):
        raise ValueError(f"smp.plan: {what} {path!r} must hold a JSON object; {fix}")
    return data
