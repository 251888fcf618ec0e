"""smp: pipeline, tensor and sharded-optimizer parallelism for unmodified PyTorch models.

`import smp` registers the "smp" c10d backend with torch.distributed.
"""

from smp._backend import BACKEND_NAME, backend_stats
from smp._backend import register as _register_backend

__version__ = "0.1.0"

_register_backend()

__all__ = ["BACKEND_NAME", "__version__", "backend_stats"]
