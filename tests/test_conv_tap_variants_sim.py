"""The tap conv variants give the decoder's 3x3 convs bit for bit what the default path gives, in the numba
CUDA simulator (its products are float64 sums of the same terms on the host): conv.TAP_PLANAR (the tap product
written [O, grid], finish_planar streaming it into the output), conv.TAP_ROWS (a kernel row's taps in one
product over the row3 split image) and both; with a bias and a residual, over silu(group_norm(x)) and over the
2x upsampling, each in chunks of two rows. The default path is the one held to float64 by the kernel contract
and to the numpy table. Planted controls must differ: finish_planar's bias[0] for every channel, and the row3
weights' taps of a row in reverse order."""

import pytest
from sim_util import simulated_lines

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

SCRIPT = r'''
import numpy as np
from cuda_kernels import conv
from moss_cli.ops.cuda_table import CudaOps

rng = np.random.default_rng(5)
ops = CudaOps()
planted, row_weights = conv.finish_planar, conv.tap_row_weights


def run(kind, planar, rows=False, control=False):
    conv.TAP_PLANAR, conv.TAP_ROWS = planar, rows
    if control and planar:
        conv.finish_planar = lambda *a, **k: planted(*a, **dict(k, control=True))
    if control and rows:
        conv.tap_row_weights = lambda w: row_weights(w, reversed_rows=True)
    ops._params.clear()
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
        conv.TAP_PLANAR, conv.TAP_ROWS, conv.finish_planar, conv.tap_row_weights = False, False, planted, row_weights


rng_x = {"plain": rng.standard_normal((8, 5, 4)).astype(np.float32) * 3,
         "norm": (rng.standard_normal((8, 5, 4)) * 2 + 5).astype(np.float32),
         "up": rng.standard_normal((8, 3, 2)).astype(np.float32)}
weights = ((rng.standard_normal((6, 8, 3, 3)) / 8).astype(np.float32), rng.standard_normal(6).astype(np.float32))
residual = rng.standard_normal((6, 5, 4)).astype(np.float32)
for kind in ("plain", "norm", "up"):
    want = run(kind, False)
    for name, planar, rows in (("planar", True, False), ("rows", False, True), ("planar+rows", True, True)):
        for control in (False, True):
            same = np.array_equal(run(kind, planar, rows, control), want)
            print(kind, name, "control" if control else "variant", "equal" if same else "differ")
'''


@pytest.fixture(scope="module")
def lines():
    return simulated_lines(SCRIPT)


def test_tap_conv_variants_equal_the_default_bit_for_bit(lines):
    got = [line for line in lines if " variant " in line]
    assert len(got) == 9 and all(line.endswith(" equal") for line in got), lines


def test_planted_controls_differ(lines):
    got = [line for line in lines if " control " in line]
    assert len(got) == 9 and all(line.endswith(" differ") for line in got), lines
