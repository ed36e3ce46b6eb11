"""Op tables: every model graph is written once against these methods.

`numpy_ops(np.float32)` is the CPU path, `numpy_ops(np.float64)` the reference (ops/numpy/: core, gdn,
conv and dit ops, composed in numpy/table.py). The GPU table (ops/cuda/table.py: CudaOps) implements the
same method names over device buffers, composed from the same families (ops/cuda/: gdn, conv, dit).
Arrays are token-major: activations are [L, features], attention heads [L, H, head_dim], images [C, H, W]
(batch 1 everywhere).
"""

from .numpy.table import NumpyOps, numpy_ops

__all__ = ["NumpyOps", "numpy_ops"]
