"""The numpy op table (float32 = the CPU path, float64 = the reference)."""

import numpy as np

from .conv import ConvOps
from .core import CoreOps
from .dit import DitOps
from .gdn import GdnOps


class NumpyOps(CoreOps, GdnOps, ConvOps, DitOps):
    name = "numpy"

    def __init__(self, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self._params = {}
        self._param_bytes = 0


def numpy_ops(dtype=np.float32):
    return NumpyOps(dtype)
