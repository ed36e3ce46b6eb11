"""The decoder's split images (conv.split_image) in the numba CUDA simulator, bit for bit against images built
here with numpy's own float16 rounding: the tap convs' layout (triple: rows of W + 2 pixels, [hi | lo | hi] a
pixel, parts of C rounded up to 8) with the zero pixel each side of a row, rows above and below the input and
channels past C; a 1x1 conv's columns ([hi | lo], parts of C rounded up to 128); the 2x upsampling read
through. The planted control (lo written as zero) must differ."""

import pytest
from sim_util import simulated_lines

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

SCRIPT = r'''
import numpy as np
from numba import cuda
from cuda_kernels import conv


def expected(x, peak, r0, rows, up, triple):
    """x scaled by the power of two putting peak in [2^14, 2^15), hi its float16, lo the float16 of the rest;
    image row i is input row r0 + i (triple: its pixel j input column j - 1)."""
    if up:
        x = x.repeat(2, 1).repeat(2, 2)
    c, h, w = x.shape
    scaled = x.astype(np.float32) * np.float32(2.0 ** (14 - np.floor(np.log2(peak))))
    hi = scaled.astype(np.float16)
    lo = (scaled - hi.astype(np.float32)).astype(np.float16)
    p, pad, parts = (-(-c // 8) * 8, 1, (hi, lo, hi)) if triple else (-(-c // 128) * 128, 0, (hi, lo))
    out = np.zeros((rows, w + 2 * pad, len(parts) * p), np.float16)
    for i in range(rows):
        y = r0 + i
        if 0 <= y < h:
            for k, part in enumerate(parts):
                out[i, pad:pad + w, k * p:k * p + c] = part[:, y, :].T
    return out.reshape(rows * (w + 2 * pad), len(parts) * p).view(np.uint16)


rng = np.random.default_rng(11)
for c, up in ((8, False), (5, False), (12, True)):
    x = (rng.standard_normal((c, 3, 5)) * 3).astype(np.float32)
    peak = float(np.abs(x).max())
    h = 6 if up else 3
    for triple in (True, False):
        # a tap chunk's image: the row above the input, the row below it; a 1x1 chunk's: its first and last rows
        for r0, rows in (((-1, 3), (h - 2, 3)) if triple else ((0, 2), (2, h - 2))):
            want = expected(x, peak, r0, rows, up, triple)
            for control in (False, True):
                image = cuda.to_device(np.full(want.shape, 0xFFFF, np.uint16))      # NaN bits as garbage
                conv.split_image(cuda.to_device(x), cuda.to_device(np.float32([peak])), image, r0, up,
                                 control=control, triple=triple)
                got = image.copy_to_host()
                print(c, up, "taps" if triple else "columns", r0, "control" if control else "kernel",
                      "equal" if np.array_equal(got, want) else f"differ {np.count_nonzero(got != want)}")
'''


@pytest.fixture(scope="module")
def lines():
    return simulated_lines(SCRIPT)


def test_split_images_equal_numpy_float16_images_bit_for_bit(lines):
    kernel = [line for line in lines if " kernel " in line]
    assert len(kernel) == 12, lines
    assert all(line.endswith("equal") for line in kernel), "\n".join(kernel)


def test_planted_control_differs(lines):
    planted = [line for line in lines if " control " in line]
    assert len(planted) == 12 and all(" differ " in line for line in planted), "\n".join(planted)
