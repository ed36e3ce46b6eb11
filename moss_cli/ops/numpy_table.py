"""The numpy op table (float32 = the CPU path, float64 = the reference)."""

import numpy as np

from .numpy_conv import ConvOps
from .numpy_core import CoreOps
from .numpy_dit import DitOps
from .numpy_gdn import GdnOps


class NumpyOps(CoreOps, GdnOps, ConvOps, DitOps):
    name = "numpy"

    def __init__(self, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self._params = {}
        self._param_bytes = 0


def numpy_ops(dtype=np.float32):
    return NumpyOps(dtype)
