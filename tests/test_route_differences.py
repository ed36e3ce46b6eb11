"""scripts/gpu_decoder.py's route_differences, which finds the convolution (and its rows) where the decoder's
cuDNN route leaves the columns: on a stand-in op table whose "cudnn" route errs in the last two rows of one
conv only, it names that call and those rows, reports zero for the others, and leaves the table as it was."""

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_decoder  # noqa: E402


class StandIn:
    """conv2d as float64 1x1 convolutions; the "cudnn" route adds 1e-3 of the output's peak to the last two rows
    of any conv with `faulty` output channels."""

    convs = "cudnn"

    def __init__(self, faulty):
        self.faulty = faulty

    def conv2d(self, x, w, b=None, padding=0, residual=None):
        y = np.einsum("oc,chw->ohw", w[:, :, 0, 0], x)
        if self.convs == "cudnn" and w.shape[0] == self.faulty:
            y[:, -2:] += 1e-3 * np.abs(y).max()
        return y

    def host(self, x):
        return x


def test_the_faulty_conv_and_its_rows_are_named():
    rng = np.random.default_rng(0)
    ops = StandIn(faulty=5)
    x = rng.standard_normal((4, 6, 3))
    w1, w2, w3 = rng.standard_normal((3, 4, 1, 1)), rng.standard_normal((5, 3, 1, 1)), rng.standard_normal((2, 5, 1, 1))

    def run():
        ops.conv2d(ops.conv2d(ops.conv2d(x, w1), w2), w3)

    calls = gpu_decoder.route_differences(ops, run, top=2)
    assert [c["conv"] for c in calls] == ["1x1 4->3 at 6x3", "1x1 3->5 at 6x3", "1x1 5->2 at 6x3"]
    assert calls[0]["rel"] == 0 and calls[2]["rel"] == 0         # the third's input is the route's own output
    assert abs(calls[1]["rel"] - 1e-3) < 1e-12 and sorted(calls[1]["rows"]) == [4, 5]
    assert ops.convs == "cudnn" and "conv2d" not in ops.__dict__
