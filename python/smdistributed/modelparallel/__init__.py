"""`smdistributed.modelparallel`: scripts read its `__version__` (smp's version)."""

from smp import __version__

__all__ = ["__version__"]
