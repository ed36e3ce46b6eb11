"""scripts/dit_precision.py's FP8 rounding, which BENCHMARKS' FP8 figure rests on: each row scaled so its max
|x| is e4m3's 448, then rounded as ml_dtypes' float8_e4m3fn rounds (an independent statement of the format);
the planted control, the scale left out, fails the same bound on the relative rounding error."""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import dit_precision  # noqa: E402


def _as_ml_dtypes(x, s):
    return (x.numpy() / s.numpy()).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def test_rows_are_scaled_to_448_and_rounded_as_e4m3():
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)[:, None]
    q, s = dit_precision.e4m3_rows(x)
    assert torch.equal(q.abs().amax(-1), torch.full((64,), 448.0))
    assert np.array_equal(q.numpy(), _as_ml_dtypes(x, s))
    normal = (x / s).abs() >= 2.0 ** -6                          # e4m3's normal range, scaled
    assert _worst_relative(q * s, x, normal) <= 2.0 ** -4 * 1.0001   # half a step of a 3-bit mantissa
    bug = x.to(torch.float8_e4m3fn).float()                    # the scale forgotten: small rows underflow,
    assert not _worst_relative(bug, x, normal) <= 2.0 ** -4 * 1.0001   # large ones leave the format (NaN)


def _worst_relative(got, want, where):
    return float(((got - want).abs() / want.abs())[where].max())
