"""Op tables: every model graph is written once against these methods.

`numpy_ops(np.float32)` is the CPU path, `numpy_ops(np.float64)` the reference. A GPU table implements
the same method names over device buffers. Arrays are token-major: activations are [L, features],
attention heads [L, H, head_dim], images [C, H, W] (batch 1 everywhere).
"""

from .numpy_table import NumpyOps, numpy_ops

__all__ = ["NumpyOps", "numpy_ops"]
