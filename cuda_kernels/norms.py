"""Row normalisations: RMSNorm (plain or zero-centred), the L2 norm of GDN q/k, the gated RMSNorm.

One block per row; float32 sums through a shared-memory tree (no warp shuffles: runs in the simulator).
"""

import math

import numpy as np
from numba import cuda, float32

from .core import BLOCK, EPS32, WARP, Case, block_sum, gamma, jit

MAXBLOCK = 256


def _threads(d):
    """Threads per row: a power of two, at least a warp, at most BLOCK, no more than the row needs."""
    t = WARP
    while t < min(d, BLOCK):
        t *= 2
    return t


def _make_rms_norm(control):
    @jit
    def rms_norm(x, w, out, eps, offset):
        row, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        sh = cuda.shared.array(MAXBLOCK, float32)
        d = x.shape[1]
        acc = float32(0.0)
        for i in range(tid, d, nt):
            acc += x[row, i] * x[row, i]
        r = float32(1.0) / math.sqrt(block_sum(sh, acc) / float32(d) + eps)
        for i in range(tid, d, nt):
            out[row, i] = x[row, i] * r * (w[i] if control else offset + w[i])
    return rms_norm


def _make_l2_norm(control):
    @jit
    def l2_norm(x, out, eps, scale):
        row, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        sh = cuda.shared.array(MAXBLOCK, float32)
        d = x.shape[1]
        acc = float32(0.0)
        for i in range(tid, d, nt):
            acc += x[row, i] * x[row, i]
        total = block_sum(sh, acc)
        if control:
            total = total / float32(d)
        r = scale / math.sqrt(total + eps)
        for i in range(tid, d, nt):
            out[row, i] = x[row, i] * r
    return l2_norm


def _make_gated_rms_norm(control):
    @jit
    def gated_rms_norm(x, z, w, out, eps):
        row, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        sh = cuda.shared.array(MAXBLOCK, float32)
        d = x.shape[1]
        acc = float32(0.0)
        for i in range(tid, d, nt):
            acc += x[row, i] * x[row, i]
        r = float32(1.0) / math.sqrt(block_sum(sh, acc) / float32(d) + eps)
        for i in range(tid, d, nt):
            g = z[row, i]
            gate = float32(1.0) / (float32(1.0) + math.exp(-g))
            if not control:
                gate = g * gate
            out[row, i] = w[i] * (x[row, i] * r) * gate
    return gated_rms_norm


_rms = {c: _make_rms_norm(c) for c in (False, True)}
_l2 = {c: _make_l2_norm(c) for c in (False, True)}
_gated = {c: _make_gated_rms_norm(c) for c in (False, True)}


def rms_norm(x, w, out, eps, offset, stream=0, control=False):
    """out = x / sqrt(mean(x^2) + eps) * (offset + w) per row of x [R, D]; w float32 [D]."""
    _rms[control][x.shape[0], _threads(x.shape[1]), stream](x, w, out, np.float32(eps), np.float32(offset))


def l2_norm(x, out, eps, scale=1.0, stream=0, control=False):
    """out = x / sqrt(sum(x^2) + eps) * scale per row of x [R, d] (eps inside the sqrt of the sum)."""
    _l2[control][x.shape[0], _threads(x.shape[1]), stream](x, out, np.float32(eps), np.float32(scale))


def gated_rms_norm(x, z, w, out, eps, stream=0, control=False):
    """out = (w * x / sqrt(mean(x^2) + eps)) * silu(z) per row of x, z [R, d]; w float32 [d]."""
    _gated[control][x.shape[0], _threads(x.shape[1]), stream](x, z, w, out, np.float32(eps))


# --- float64 references: the spec of each kernel ----------------------------------------------
def rms_norm_reference(x, w, eps, offset):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (offset + w.astype(np.float64))


def l2_norm_reference(x, eps, scale):
    x = x.astype(np.float64)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps) * scale


def gated_rms_norm_reference(x, z, w, eps):
    x, z = x.astype(np.float64), z.astype(np.float64)
    n = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return w.astype(np.float64) * n * (z / (1 + np.exp(-z)))


# --- contract --------------------------------------------------------------------------------
def _make(rng, size):
    rows, d = (3, 40) if size == "tiny" else (4000, 4096)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    x[0] *= np.float32(1e-3)    # a small row, where eps matters
    return {"x": x, "z": rng.standard_normal((rows, d)).astype(np.float32) * 3,
            "w": (rng.standard_normal(d) * 0.5).astype(np.float32), "eps": 1e-6}


def _device(inp, *names):
    return [cuda.to_device(inp[n]) for n in names]


def _run_rms(inp, control):
    x, w = _device(inp, "x", "w")
    out = cuda.device_array(inp["x"].shape, np.float32)
    rms_norm(x, w, out, inp["eps"], 1.0, control=control)
    return out.copy_to_host()


def _ref_rms(inp):
    ref = rms_norm_reference(inp["x"], inp["w"], inp["eps"], 1.0)
    # the sum of squares carries gamma_D relative error, the 1/sqrt half of it; a few more roundings
    return ref, (0.5 * gamma(inp["x"].shape[1]) + 6 * EPS32) * np.abs(ref) + 1e-30


def _run_l2(inp, control):
    (x,) = _device(inp, "x")
    out = cuda.device_array(inp["x"].shape, np.float32)
    l2_norm(x, out, inp["eps"], 0.25, control=control)
    return out.copy_to_host()


def _ref_l2(inp):
    ref = l2_norm_reference(inp["x"], inp["eps"], 0.25)
    return ref, (0.5 * gamma(inp["x"].shape[1]) + 5 * EPS32) * np.abs(ref) + 1e-30


def _run_gated(inp, control):
    x, z, w = _device(inp, "x", "z", "w")
    out = cuda.device_array(inp["x"].shape, np.float32)
    gated_rms_norm(x, z, w, out, inp["eps"], control=control)
    return out.copy_to_host()


def _ref_gated(inp):
    ref = gated_rms_norm_reference(inp["x"], inp["z"], inp["w"], inp["eps"])
    # as rms_norm, plus silu (exp within 2 ulp, a division, a product)
    return ref, (0.5 * gamma(inp["x"].shape[1]) + 12 * EPS32) * np.abs(ref) + 1e-30


CASES = [
    Case("rms_norm", _make, _run_rms, _ref_rms, notes="control: plain w where zero-centred needs 1 + w"),
    Case("l2_norm", _make, _run_l2, _ref_l2, notes="control: mean of squares instead of the sum"),
    Case("gated_rms_norm", _make, _run_gated, _ref_gated, notes="control: sigmoid(z) gate instead of silu(z)"),
]
