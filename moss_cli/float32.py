"""float32 arithmetic rounded as torch's CPU kernels round it: a fused multiply-add (one rounding), which the
noise's Box-Muller kernels (noise.py) and torch.linspace (schedule.py) use, and its unfused twin."""

import numpy as np

F32 = np.float32


def fma32(a, b, c):
    """float32 a*b + c with one rounding.

    The float64 product of two floats is exact and their float64 sum is within half a float64 ulp of the exact
    one, so casting that sum to float32 rounds as a true FMA would unless the sum sits exactly halfway between
    two floats (or in float32's subnormal range, where halfway lies elsewhere): those few are redone with the
    sum rounded to odd (using the TwoSum error) before the cast.
    """
    p = np.multiply(a, b, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    s = np.asarray(p + c)
    out = np.asarray(s.astype(F32))
    redo = ((s.view(np.int64) & 0x1FFFFFFF) == 0x10000000) | (np.abs(s) < 2.0 ** -126)
    if redo.any():
        pb, cb = np.broadcast_to(p, s.shape)[redo], np.broadcast_to(c, s.shape)[redo]
        out[redo] = _fma32_odd(pb, cb, s[redo])
    return out


def _fma32_odd(p, c, s):
    """float32 of p + c, whose float64 sum is s, rounded once: s rounded to odd, then cast."""
    t = s - p
    err = (p - (s - t)) + (c - t)
    bits = s.view(np.int64)
    even = (bits & 1) == 0
    # one ulp toward the exact sum: up in magnitude when the error has the sum's sign
    toward = np.where(np.signbit(err) == np.signbit(s), 1, -1)
    bits = bits + np.where((err != 0) & even, toward, 0)
    return bits.view(np.float64).astype(F32)


def mul_add32(a, b, c):
    """float32 a*b + c with two roundings (no FMA contraction): the planted control for fma32."""
    return (F32(a) * F32(b) + F32(c)).astype(F32)
