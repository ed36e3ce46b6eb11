"""Probe: the decoder's 3x3 tap products at 1024x1024 in two layouts, GPU time of the products alone.

nine: today's, nine products of K = 3P a conv chunk (the image [hi | lo | hi] a pixel), each adding into d.
rows: three products of K = 9P, one per kernel row, over an image that holds each pixel's row of three
neighbours (9P a grid position), so d is read and written three times, not nine.
Random fp16 bits; chunks sized as conv.tap_rows does for each layout (TAP_BYTES). Prints ms per decode.
"""

import json
import sys

import numpy as np
from numba import cuda

from cuda_kernels import conv
from cuda_kernels.gemm import GpuTimer, pointer

# (C in, O, side) of every 3x3 conv of the FLUX.2 small decoder at 1024x1024 output (latents 128x128)
CONVS = ([(32, 384, 128)] + [(384, 384, 128)] * 10 + [(384, 384, 256)] * 7 + [(384, 384, 512)]
         + [(384, 192, 512)] + [(192, 192, 512)] * 5 + [(192, 192, 1024)] + [(192, 96, 1024)]
         + [(96, 96, 1024)] * 5 + [(96, 3, 1024)])


def rows_for(c, o, width, per_pixel_halves):
    per_row = (width + 2) * (per_pixel_halves * 2 + conv.product_rows(o) * 4)
    return max(1, conv.TAP_BYTES // per_row - 2)


def main():
    hp = conv._blas_product()
    rng = np.random.default_rng(0)
    pool = cuda.to_device(rng.integers(0, 0x3C00, 64 << 20, dtype=np.uint16))     # values in [0, 1)
    d = cuda.device_array(16 << 20, np.float32)
    timer = GpuTimer()
    out = {}
    for layout in ("nine", "rows"):
        calls = []
        for c, o, side in CONVS:
            p = conv.tap_part(c)
            n = conv.product_rows(o)
            span = side + 2
            width = 3 * p if layout == "nine" else 9 * p
            rows = min(side, rows_for(c, o, side, width))
            k = width
            plan = hp._plan(rows * span - 2, n, k, k, k, align=16)
            for r0 in range(0, side, rows):
                m = min(rows, side - r0) * span - 2
                pl = plan if m == rows * span - 2 else hp._plan(m, n, k, k, k, align=16)
                taps = 9 if layout == "nine" else 3
                for t in range(taps):
                    dy, dx = divmod(t, 3) if layout == "nine" else (t, 0)
                    calls.append((pl, pointer(pool) + 2 * t * n * k, pointer(pool) + 2 * (dy * span + dx) * k,
                                  t > 0))
        def run():
            for pl, w_at, a_at, add in calls:
                hp._matmul(pl, w_at, a_at, add, d, 0)
        ms = timer(run, 3)
        out[layout] = {"ms": ms, "products": len(calls)}
        print(layout, f"{ms:.2f} ms a decode's 3x3 products, {len(calls)} products", flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1) if len(sys.argv) > 1 else None


if __name__ == "__main__":
    main()
