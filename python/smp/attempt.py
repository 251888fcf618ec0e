"""Which attempt of the job this process belongs to, for keys in a store that outlives it.

Under `torchrun --max-restarts=N` a lost rank stops every worker and torchrun starts them again,
but the store the workers rendezvous over (the agent's TCPStore, at the same MASTER_PORT) is
kept. Gloo publishes each rank's address under fixed keys per group: a restarted rank read its
peers' addresses from the attempt before (dead processes) and failed with "connectFullMesh ...
Connection refused". Every key smp writes is therefore under this attempt's prefix.
"""

from __future__ import annotations

import os


def number() -> int:
    """torchrun's restart count (0 for the first attempt, or outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def prefix() -> str:
    """The store-key prefix of this attempt ("" for the first one: nothing to tell apart)."""
    n = number()
    return f"attempt_{n}/" if n else ""
