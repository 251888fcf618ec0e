"""Memory sizes as people write them ("40GiB", "80 GB", "1.5TiB") and back."""

from __future__ import annotations

import re

GiB = 2**30
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_memory(text: str | int | float) -> int:
    """Bytes in `text`: a number with a unit (B, KB/MB/GB/TB in powers of 10, KiB/MiB/GiB/TiB in
    powers of 2); a bare number is bytes. A ValueError names the value and the fix."""
    if isinstance(text, bool):
        raise ValueError(f"smp.plan: gpu_memory {text!r} is not a memory size; write e.g. '40GiB'")
    if isinstance(text, (int, float)):
        value, unit = float(text), "b"
    else:
        match = _SIZE.fullmatch(str(text))
        if match is None or match.group(2).lower() not in ("", *_UNITS):
            raise ValueError(
                f"smp.plan: cannot read the memory size {text!r}; write a number and a unit, "
                "e.g. '40GiB', '80GB' or '24576MiB'"
            )
        value, unit = float(match.group(1)), (match.group(2).lower() or "b")
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"smp.plan: the memory size {text!r} must be positive; write e.g. '40GiB'")
    return size


def gib(n_bytes: float) -> float:
    return round(n_bytes / GiB, 3)
