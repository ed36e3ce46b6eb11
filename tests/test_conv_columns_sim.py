"""The decoder's split columns (conv.im2col: conv.split_image, then conv.gather_columns) in the numba CUDA
simulator, bit for bit against columns built here with numpy's own float16 rounding: every tap, the image's
zero edges, a chunk's first and last rows, the 2x upsampling read through, words of 8, 4 and 2 bytes (8, 6
and 5 channels), and a 1x1 conv (its columns are its split image). Planted controls (lo written as zero, taps
transposed) must differ."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

SCRIPT = r'''
import numpy as np
from numba import cuda
from cuda_kernels import conv


def expected(x, peak, r0, rows, taps, up):
    """[hi | lo] columns: x scaled by the power of two putting peak in [2^14, 2^15), hi its float16, lo the
    float16 of the rest; tap t = (dy, dx) of channel c at column t C + c of each part (128-column multiples)."""
    if up:
        x = x.repeat(2, 1).repeat(2, 2)
    c, h, w = x.shape
    scaled = x.astype(np.float32) * np.float32(2.0 ** (14 - np.floor(np.log2(peak))))
    hi = scaled.astype(np.float16)
    lo = (scaled - hi.astype(np.float32)).astype(np.float16)
    k = taps * taps * c
    p = -(-k // 128) * 128
    out = np.zeros((rows * w, 2 * p), np.float16)
    pad = taps // 2
    for r in range(rows):
        for xo in range(w):
            for t in range(taps * taps):
                yy, xx = r0 + r + t // taps - pad, xo + t % taps - pad
                if 0 <= yy < h and 0 <= xx < w:
                    out[r * w + xo, t * c:(t + 1) * c] = hi[:, yy, xx]
                    out[r * w + xo, p + t * c:p + (t + 1) * c] = lo[:, yy, xx]
    return out.view(np.uint16)


rng = np.random.default_rng(7)
for c, taps, up in ((8, 3, False), (6, 3, False), (5, 3, True), (6, 1, False)):
    x = (rng.standard_normal((c, 3, 5)) * 3).astype(np.float32)
    peak = float(np.abs(x).max())
    h, w = (6, 10) if up else (3, 5)
    for r0, rows in ((0, 2), (2, h - 2)):
        want = expected(x, peak, r0, rows, taps, up)
        for control in (False, True, "lo", "taps"):
            cols = cuda.to_device(np.full(want.shape, 0xFFFF, np.uint16))      # NaN bits as garbage
            conv.im2col(cuda.to_device(x), cuda.to_device(np.float32([peak])), cols, r0, taps, up, control=control)
            got = cols.copy_to_host()
            kind = {False: "kernel", True: "control", "lo": "control_lo", "taps": "control_taps"}[control]
            print(c, taps, up, r0, rows, kind,
                  "equal" if np.array_equal(got, want) else f"differ {np.count_nonzero(got != want)}")
'''


@pytest.fixture(scope="module")
def lines():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_columns_equal_numpy_float16_columns_bit_for_bit(lines):
    kernel = [line for line in lines if " kernel " in line]
    assert len(kernel) == 8, lines
    assert all(line.endswith("equal") for line in kernel), "\n".join(kernel)


def test_planted_controls_differ(lines):
    """Both bugs together, the lo parts dropped alone (every case), the taps transposed alone (the 3x3 cases:
    a 1x1 conv has one tap)."""
    for kind in ("control", "control_lo"):
        planted = [line for line in lines if f" {kind} " in line]
        assert len(planted) == 8 and all(" differ " in line for line in planted), "\n".join(planted)
    taps = [line for line in lines if " control_taps " in line]
    assert len(taps) == 8, lines
    assert all((" differ " in line) == (line.split()[1] == "3") for line in taps), "\n".join(taps)
