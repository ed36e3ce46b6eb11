"""Reading a weight into the L2 cache ahead of the product that needs it.

For a short prompt the products are bound by reading their weights from HBM, while the kernels between
two products (the delta rule, attention) leave HBM idle. `touch` reads a whole array once, on a side
branch of the graph running beside those kernels, so that the next product finds its weight in L2 (the
H200's is 50 MB; an [4096, 4096] bf16 weight is 33.5 MB). Its only output is a checksum per block (the
XOR of the 8-byte words it read), which makes the reads observable, hence kept by the compiler, and
testable against numpy.
"""

import numpy as np
from numba import cuda, uint64

from .core import BLOCK, SIMULATED, Case, DeviceView, jit

UNROLL = 2 if SIMULATED else 8        # loads in flight per thread per round
BLOCKS = 2 if SIMULATED else 264       # two blocks per SM of the H200


def _make_touch(control):
    @jit
    def touch(words, sums):
        tid = cuda.threadIdx.x
        n = uint64(words.shape[0])
        span = uint64(cuda.gridDim.x * BLOCK * UNROLL)
        acc = uint64(0)
        start = uint64(cuda.blockIdx.x * BLOCK * UNROLL + tid)
        for base in range(start, n, span):
            for u in range(UNROLL):
                i = base + uint64(u * BLOCK)
                if i < n and not (control and u == UNROLL - 1):
                    acc ^= words[i]
        # the block's XOR: every thread's word in shared memory, combined by thread 0
        sh = cuda.shared.array(BLOCK, uint64)
        sh[tid] = acc
        cuda.syncthreads()
        if tid == 0:
            total = uint64(0)
            for j in range(BLOCK):
                total ^= sh[j]
            sums[cuda.blockIdx.x] = total
    return touch


_touch = {c: _make_touch(c) for c in (False, True)}


def words(a):
    """A contiguous array (8-byte aligned, whole words) as uint64 words; the simulator: a numpy view."""
    if SIMULATED:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(a._ary.reshape(-1).view(np.uint64))
    return cuda.as_cuda_array(DeviceView(a, (a.size * a.dtype.itemsize // 8,), None, "<u8"))


def touch(w, sums, stream=0, control=False):
    """Read all of w (uint64 words, e.g. `words(weight)`) once; sums [BLOCKS] uint64 gets each block's XOR."""
    _touch[control][BLOCKS, BLOCK, stream](w, sums)


def touch_reference(w):
    """Each block's XOR over the words it reads (the kernel's partition of the array)."""
    w = np.asarray(w, dtype=np.uint64)
    owner = (np.arange(w.size) // (BLOCK * UNROLL)) % BLOCKS
    return np.array([np.bitwise_xor.reduce(w[owner == b]) if np.any(owner == b) else 0 for b in range(BLOCKS)],
                    dtype=np.uint64)


def _make(rng, size):
    n = 100 if size == "tiny" else 4096 * 4096 // 4
    return {"w": rng.integers(0, 2 ** 63, n, dtype=np.uint64)}


def _run(inp, control):
    sums = cuda.device_array(BLOCKS, np.uint64)
    touch(cuda.to_device(inp["w"]), sums, control=control)
    return sums.copy_to_host().view(np.uint16).astype(np.float64)


def _ref(inp):
    # exact: the checksums' bits as 16-bit pieces (exact in float64); any word left out changes them
    ref = touch_reference(inp["w"]).view(np.uint16).astype(np.float64)
    return ref, np.zeros_like(ref)


CASES = [Case("l2_touch", _make, _run, _ref, notes="control: skips every thread's last word of a round")]
