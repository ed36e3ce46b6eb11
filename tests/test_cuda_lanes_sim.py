"""The upload lanes behind CudaOps in the CUDA simulator: param, params and preload through a LaneUploader whose
driver copies into the simulator's device arrays (tests/test_cuda_lanes.py's fake driver, its copies run as they
are queued, so a queued array holds its bytes). 2-D weights arrive as bf16 bits and the rest as float32, stacks by
rows through `out=` slices; preload returns while the lanes are held, and a weight taken later waits for its own
copies. Control: an op table that takes a preloaded weight without waiting reads it unfilled."""

import pytest

from sim_util import simulated_lines

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

SCRIPT = r'''
import ctypes
import sys
import threading

sys.path.insert(0, "tests")
import numpy as np
from numba import cuda

from moss_cli.memory import upload as cuda_upload
from moss_cli.memory.lanes import LaneUploader
from moss_cli.ops.cuda.table import CudaOps
from sim_util import cuda_ops_expected, cuda_ops_weights
from fake_driver import FakeDriver


class SimDriver(FakeDriver):
    """The fake driver over the simulator's device arrays (numpy arrays inside), each copy run as it is queued."""

    def _htod(self, dst, src, n, stream):
        if self.gate is not None:
            self.gate.wait()
        ctypes.memmove(dst, src, n)
        return 0

    def empty(self, shape, dtype):
        out = cuda.device_array(shape, dtype)
        out._ary.view(np.uint8)[...] = 0xA5            # unfilled
        return out

    @staticmethod
    def address(array):
        return array._ary.ctypes.data


stored = cuda_ops_weights(np.random.default_rng(0))
expected = cuda_ops_expected(stored)


def taken(ops_class):
    gate = threading.Event()
    up = cuda_upload._SHARED = LaneUploader(lanes=2, slots=2, slot_bytes=1024, driver=SimDriver(gate=gate))
    ops = ops_class()
    ops.preload(stored, ["f3", ("q", "w2", "k"), "w2", "b1", "f2"])
    assert int(up._done.sum()) == 0 and len(ops._landing) == 5, "preload waited for the lanes"
    threading.Timer(0.2, gate.set).start()
    got = {"f3": ops.param(stored, "f3").copy_to_host(),
           "stack": ops.params(stored, ["q", "w2", "k"]).weight.copy_to_host(),
           "w2": ops.param(stored, "w2").copy_to_host(), "b1": ops.param(stored, "b1").copy_to_host(),
           "f2": ops.param(stored, "f2").copy_to_host()}
    up.finish()
    up.close()
    return got


got = taken(CudaOps)
for name, want in expected.items():
    assert got[name].dtype == want.dtype and np.array_equal(got[name], want), name
print("ok cuda ops through the lanes")


class Hasty(CudaOps):
    def _landed(self, key):
        self._landing.pop(key, None)


got = taken(Hasty)
assert not np.array_equal(got["f3"], stored["f3"]), "taking a weight before its copies is not caught"
print("ok hasty taker caught")
print("all uploads equal")
'''


def test_cuda_ops_upload_through_the_lanes_in_the_simulator():
    lines = simulated_lines(SCRIPT, timeout=300)
    assert lines[-3:] == ["ok cuda ops through the lanes", "ok hasty taker caught", "all uploads equal"], lines
