"""The context-parallel rules, one module per op family; importing this registers them all."""

from . import attention, layers, pointwise, reduce, shape  # noqa: F401
