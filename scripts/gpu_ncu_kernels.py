"""A few launches for Nsight Compute to read counters on: the token recurrence at the 9B encoder's GDN shape
(112 tokens) and the 100-token products whose weights stream slowest (N = 4096 from K = 4096 and 12288).

    ncu --clock-control none --set full -k regex:'gated_delta_rule|nvjet' python3 scripts/gpu_ncu_kernels.py
"""

import numpy as np
from numba import cuda

from cuda_kernels import gdn, gemm
from scripts.gpu_bench_delta import inputs


def main():
    inp = inputs(112)
    args = [cuda.to_device(inp[name]) for name in ("q", "k", "v", "g", "beta")]
    out = cuda.device_array(inp["v"].shape, np.float32)
    for _ in range(2):
        gdn.gated_delta_rule(*args, out)
    blas = gemm.blas()
    rng = np.random.default_rng(0)
    for k in (4096, 12288):
        x = cuda.to_device(rng.integers(0x3c00, 0x3f00, (100, k)).astype(np.uint16))
        w = cuda.to_device(rng.integers(0x3c00, 0x3f00, (4096, k)).astype(np.uint16))
        y = cuda.device_array((100, 4096), np.float32)
        for _ in range(2):
            blas.linear(x, w, y, accumulate=True)
    cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
