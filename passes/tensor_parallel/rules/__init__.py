"""The tensor-parallel rules by op family; importing this package registers them all.

- layers: linear layers (column- and row-parallel), embedding (vocab-parallel), cross entropy
- shape: views, transposes, squeezes, slices, cat, split and unpacking
- elementwise: pointwise ops, casts and copies, softmax, reductions, layer norm
- matmul: matmul, bmm and scaled dot-product attention over sharded heads
"""

from . import elementwise, layers, matmul, shape

__all__ = ["elementwise", "layers", "matmul", "shape"]
