"""Row normalisations: RMSNorm (plain or zero-centred), the L2 norm of GDN q/k, the gated RMSNorm.

One block per row, each thread keeping PER of the row's elements in registers between the sum of squares
and the write (the row is read once); the RMSNorms can write bf16 bits, the operand of the next product.
"""

import math

import numpy as np
from numba import cuda, float32

from .core import (BLOCK, EPS32, SIMULATED, WARP, Case, bf16_bound, block_sum, from_bf16_bits, gamma, heads_view, jit,
                   narrow)

MAXBLOCK = 1024
PER = 4          # row elements per thread held in registers (longer rows read the rest twice)


def _threads(d):
    """Threads per row: a power of two, at least a warp, about d / PER, at most MAXBLOCK (BLOCK in the
    simulator, which pays per thread)."""
    t, most = WARP, BLOCK if SIMULATED else MAXBLOCK
    while t < most and t * PER < d:
        t *= 2
    return t


@jit(device=True)
def _store(out, row, i, y, bits):
    """out[row, i] = y, as bf16 bits (round to nearest even) when `bits`."""
    if bits:
        out[row, i] = narrow(y)
    else:
        out[row, i] = y


@jit(device=True)
def _gate(g, control):
    """silu(g) (control: sigmoid(g))."""
    s = float32(1.0) / (float32(1.0) + math.exp(-g))
    return s if control else g * s


def _make_rms_norm(control, bits):
    @jit(max_registers=64)     # 1024-thread blocks must launch: 64 x 1024 = the SM's registers
    def rms_norm(x, w, out, eps, offset):
        row, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        t, h = row // x.shape[1], row % x.shape[1]
        sh = cuda.shared.array(MAXBLOCK, float32)
        vals = cuda.local.array(PER, float32)
        d = x.shape[2]
        acc = float32(0.0)
        for j in range(PER):
            i = tid + j * nt
            vals[j] = x[t, h, i] if i < d else float32(0.0)
            acc += vals[j] * vals[j]
        for i in range(tid + PER * nt, d, nt):
            acc += x[t, h, i] * x[t, h, i]
        r = float32(1.0) / math.sqrt(block_sum(sh, acc) / float32(d) + eps)
        # the first PER elements from registers (a constant trip count, unrolled), any rest read again
        for j in range(PER):
            i = tid + j * nt
            if i < d:
                _store(out[t], h, i, vals[j] * r * (w[i] if control else offset + w[i]), bits)
        for i in range(tid + PER * nt, d, nt):
            _store(out[t], h, i, x[t, h, i] * r * (w[i] if control else offset + w[i]), bits)
    return rms_norm


def _make_l2_norm(control):
    @jit(max_registers=64)     # 1024-thread blocks must launch: 64 x 1024 = the SM's registers
    def l2_norm(x, out, eps, scale):
        row, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        t, h = row // x.shape[1], row % x.shape[1]
        sh = cuda.shared.array(MAXBLOCK, float32)
        vals = cuda.local.array(PER, float32)
        d = x.shape[2]
        acc = float32(0.0)
        for j in range(PER):
            i = tid + j * nt
            vals[j] = x[t, h, i] if i < d else float32(0.0)
            acc += vals[j] * vals[j]
        for i in range(tid + PER * nt, d, nt):
            acc += x[t, h, i] * x[t, h, i]
        total = block_sum(sh, acc)
        if control:
            total = total / float32(d)
        r = scale / math.sqrt(total + eps)
        for j in range(PER):
            i = tid + j * nt
            if i < d:
                out[t, h, i] = vals[j] * r
        for i in range(tid + PER * nt, d, nt):
            out[t, h, i] = x[t, h, i] * r
    return l2_norm


def _make_gated_rms_norm(control, bits):
    @jit(max_registers=64)     # 1024-thread blocks must launch: 64 x 1024 = the SM's registers
    def gated_rms_norm(x, z, w, out, eps):
        row, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        t, h = row // x.shape[1], row % x.shape[1]
        sh = cuda.shared.array(MAXBLOCK, float32)
        vals = cuda.local.array(PER, float32)
        d = x.shape[2]
        acc = float32(0.0)
        for j in range(PER):
            i = tid + j * nt
            vals[j] = x[t, h, i] if i < d else float32(0.0)
            acc += vals[j] * vals[j]
        for i in range(tid + PER * nt, d, nt):
            acc += x[t, h, i] * x[t, h, i]
        r = float32(1.0) / math.sqrt(block_sum(sh, acc) / float32(d) + eps)
        for j in range(PER):
            i = tid + j * nt
            if i < d:
                _store(out[t], h, i, w[i] * (vals[j] * r) * _gate(z[t, h, i], control), bits)
        for i in range(tid + PER * nt, d, nt):
            _store(out[t], h, i, w[i] * (x[t, h, i] * r) * _gate(z[t, h, i], control), bits)
    return gated_rms_norm


_rms = {(c, b): _make_rms_norm(c, b) for c in (False, True) for b in (False, True)}
_l2 = {c: _make_l2_norm(c) for c in (False, True)}
_gated = {(c, b): _make_gated_rms_norm(c, b) for c in (False, True) for b in (False, True)}


def _bits(out):
    return out.dtype == np.uint16


def rms_norm(x, w, out, eps, offset, stream=0, control=False):
    """out = x / sqrt(mean(x^2) + eps) * (offset + w) over the last axis of x [L, H, d] (any strides: the
    heads of a column block); w float32 [d]; out float32, or uint16 for bf16 bits (round to nearest even)."""
    _rms[control, _bits(out)][x.shape[0] * x.shape[1], _threads(x.shape[2]), stream](
        x, w, out, np.float32(eps), np.float32(offset))


def l2_norm(x, out, eps, scale=1.0, stream=0, control=False):
    """out = x / sqrt(sum(x^2) + eps) * scale over the last axis of x [L, H, d] (any strides: the heads of a
    column block) (eps inside the sqrt of the sum)."""
    _l2[control][x.shape[0] * x.shape[1], _threads(x.shape[2]), stream](x, out, np.float32(eps),
                                                                       np.float32(scale))


def gated_rms_norm(x, z, w, out, eps, stream=0, control=False):
    """out = (w * x / sqrt(mean(x^2) + eps)) * silu(z) over the last axis of x, z [L, H, d] (any strides);
    w float32 [d]; out float32 or uint16 (bf16 bits)."""
    _gated[control, _bits(out)][x.shape[0] * x.shape[1], _threads(x.shape[2]), stream](x, z, w, out,
                                                                                      np.float32(eps))


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
    rows, d = (4, 40) if size == "tiny" else (4000, 4096)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    x[0] *= np.float32(1e-3)    # a small row, where eps matters
    return {"x": x, "z": rng.standard_normal((rows, d)).astype(np.float32) * 3,
            "w": (rng.standard_normal(d) * 0.5).astype(np.float32), "eps": 1e-6}


def _device(inp, *names):
    return [cuda.to_device(inp[n]) for n in names]


def _heads(inp, name):
    """inp[name] [R, d] as the heads [R / 2, 2, d] of a column block of a wider device matrix."""
    rows, d = inp[name].shape
    other = "z" if name == "x" else "x"
    wide = cuda.to_device(np.concatenate([inp[other].reshape(rows // 2, 2 * d), inp[name].reshape(rows // 2, 2 * d)],
                                         axis=1))
    return heads_view(wide, 2 * d, 2, d)


def _run_rms(inp, control, bits=False):
    """x dense [R, 1, d] (the hidden rows) and as strided heads (q/k of the stacked product)."""
    rows, d = inp["x"].shape
    (w,) = _device(inp, "w")
    outs = []
    for x in (cuda.to_device(inp["x"]).reshape(rows, 1, d), _heads(inp, "x")):
        out = cuda.device_array(x.shape, np.uint16 if bits else np.float32)
        rms_norm(x, w, out, inp["eps"], 1.0, control=control)
        host = out.copy_to_host().reshape(rows, d)
        outs.append(from_bf16_bits(host) if bits else host)
    return np.concatenate(outs)


def _ref_rms(inp, bits=False):
    ref = rms_norm_reference(inp["x"], inp["w"], inp["eps"], 1.0)
    # the sum of squares carries gamma_D relative error, the 1/sqrt half of it; a few more roundings
    rel = 0.5 * gamma(inp["x"].shape[1]) + 6 * EPS32
    bound = (bf16_bound(rel) if bits else rel) * np.abs(ref) + 1e-30
    return np.concatenate([ref, ref]), np.concatenate([bound, bound])


def _run_l2(inp, control):
    """x as the heads of a column block of a wider matrix, as the GDN q/k come to it."""
    x = _heads(inp, "x")
    out = cuda.device_array(x.shape, np.float32)
    l2_norm(x, out, inp["eps"], 0.25, control=control)
    return out.copy_to_host().reshape(inp["x"].shape)


def _ref_l2(inp):
    ref = l2_norm_reference(inp["x"], inp["eps"], 0.25)
    return ref, (0.5 * gamma(inp["x"].shape[1]) + 5 * EPS32) * np.abs(ref) + 1e-30


def _run_gated(inp, control, bits=False):
    """x as [L, H, d]; z a column block of a wider matrix, as the fused input product leaves it."""
    rows, d = inp["x"].shape
    x, w = _device(inp, "x", "w")
    pairs = [inp[n].reshape(rows // 2, 2 * d) for n in ("x", "z", "x")]
    wide = cuda.to_device(np.concatenate(pairs, axis=1))
    z = heads_view(wide, 2 * d, 2, d)
    out = cuda.device_array((rows // 2, 2, d), np.uint16 if bits else np.float32)
    gated_rms_norm(x.reshape(rows // 2, 2, d), z, w, out, inp["eps"], control=control)
    host = out.copy_to_host().reshape(rows, d)
    return from_bf16_bits(host) if bits else host


def _ref_gated(inp, bits=False):
    ref = gated_rms_norm_reference(inp["x"], inp["z"], inp["w"], inp["eps"])
    # as rms_norm, plus silu (exp within 2 ulp, a division, a product); bf16 bits add half a bf16 ulp
    rel = 0.5 * gamma(inp["x"].shape[1]) + 12 * EPS32
    return ref, (bf16_bound(rel) if bits else rel) * np.abs(ref) + 1e-30


CASES = [
    Case("rms_norm", _make, _run_rms, _ref_rms, notes="control: plain w where zero-centred needs 1 + w"),
    Case("l2_norm", _make, _run_l2, _ref_l2, notes="control: mean of squares instead of the sum"),
    Case("rms_norm_bf16_out", _make, lambda i, c: _run_rms(i, c, True), lambda i: _ref_rms(i, True),
         notes="control: plain w where zero-centred needs 1 + w"),
    Case("gated_rms_norm", _make, _run_gated, _ref_gated, notes="control: sigmoid(z) gate instead of silu(z)"),
    Case("gated_rms_norm_bf16_out", _make, lambda i, c: _run_gated(i, c, True), lambda i: _ref_gated(i, True),
         notes="control: sigmoid(z) gate instead of silu(z)"),
]
