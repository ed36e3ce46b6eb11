"""The channel-major tap product variant (conv.TAP_PLANAR: the tap product written [O, grid], finish_planar
streaming it into the output) gives the decoder's 3x3 convs bit for bit what the default path gives, in the
numba CUDA simulator (its products are the same float64 sums on the host): with a bias and a residual, over
silu(group_norm(x)) and over the 2x upsampling, each in chunks of two rows. The default path is the one held to
float64 by the kernel contract and to the numpy table; the planted control (finish_planar's bias[0] for every
channel) must differ."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

SCRIPT = r'''
import numpy as np
from cuda_kernels import conv
from moss_cli.ops.cuda_table import CudaOps

rng = np.random.default_rng(5)
ops = CudaOps()
planted = conv.finish_planar


def run(kind, planar, control=False):
    conv.TAP_PLANAR = planar
    conv.finish_planar = (lambda *a, **k: planted(*a, **dict(k, control=True))) if control else planted
    try:
        c, o, h, w = 8, 6, 5, 4
        x = ops.array(rng_x[kind])
        wt, b = ops.array(weights[0]), ops.array(weights[1])
        res = ops.array(residual) if kind == "plain" else None
        if kind == "norm":
            gw, gb = ops.array(np.full(c, 1.3, np.float32)), ops.array(np.full(c, 0.2, np.float32))
            x = ops.group_norm_silu(x, 4, gw, gb, 1e-6)
        if kind == "up":
            x = ops.upsample_nearest2x(x)
        return ops.host(ops.conv2d(x, wt, b, padding=1, residual=res))
    finally:
        conv.TAP_PLANAR, conv.finish_planar = False, planted


rng_x = {"plain": rng.standard_normal((8, 5, 4)).astype(np.float32) * 3,
         "norm": (rng.standard_normal((8, 5, 4)) * 2 + 5).astype(np.float32),
         "up": rng.standard_normal((8, 3, 2)).astype(np.float32)}
weights = ((rng.standard_normal((6, 8, 3, 3)) / 8).astype(np.float32), rng.standard_normal(6).astype(np.float32))
residual = rng.standard_normal((6, 5, 4)).astype(np.float32)
for kind in ("plain", "norm", "up"):
    want = run(kind, False)
    print(kind, "planar", "equal" if np.array_equal(run(kind, True), want) else "differ")
    print(kind, "control", "equal" if np.array_equal(run(kind, True, control=True), want) else "differ")
'''


@pytest.fixture(scope="module")
def lines():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_planar_tap_convs_equal_the_default_bit_for_bit(lines):
    got = [line for line in lines if " planar " in line]
    assert len(got) == 3 and all(line.endswith(" equal") for line in got), lines


def test_planted_control_differs(lines):
    got = [line for line in lines if " control " in line]
    assert len(got) == 3 and all(line.endswith(" differ") for line in got), lines
