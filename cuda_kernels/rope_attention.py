"""Rotate-half RoPE on the first 2r dims of each head, and causal grouped-query attention.

Attention is two float32 strided-batched cuBLAS products (TF32 tensor cores) around a row softmax
kernel: scores [Hq, L, S] = q k^T per head, softmax(scale * scores) with the causal mask, then p v.
"""

import functools
import math

import numpy as np
from numba import cuda, float32

from .core import BLOCK, EPS32, SHARED, SIMULATED, Case, gamma, heads_view, jit, row_team, team_max, team_sum
from .gemm import EPS_TF32, OP_N, OP_T, blas

def _make_rope(control):
    @jit
    def rope(x, cos, sin, out):
        start, stride = cuda.grid(1), cuda.gridsize(1)
        n_heads, d = x.shape[1], x.shape[2]
        r = cos.shape[1]
        for idx in range(start, x.size, stride):
            t = idx // (n_heads * d)
            h = (idx // d) % n_heads
            i = idx % d
            if i >= 2 * r:
                out[t, h, i] = x[t, h, i]
            elif control:
                # interleaved pairs (2j, 2j+1): the GPT-J convention, not Qwen's
                j = i // 2
                if i % 2 == 0:
                    out[t, h, i] = x[t, h, i] * cos[t, j] - x[t, h, i + 1] * sin[t, j]
                else:
                    out[t, h, i] = x[t, h, i] * cos[t, j] + x[t, h, i - 1] * sin[t, j]
            elif i < r:
                out[t, h, i] = x[t, h, i] * cos[t, i] - x[t, h, i + r] * sin[t, i]
            else:
                out[t, h, i] = x[t, h, i] * cos[t, i - r] + x[t, h, i - r] * sin[t, i - r]
    return rope


NEG_INF = np.float32(-np.inf)


@functools.cache
def _softmax(control, team, per):
    @jit(launch_bounds=(BLOCK, 4))     # four blocks per SM: enough scores in flight
    def softmax(s, scale, causal):
        # a team of threads per row of s [B, L, S], per scores each in registers (core.row_team)
        sh = cuda.shared.array(SHARED, float32)
        vals = cuda.local.array(per, float32)
        row = cuda.blockIdx.x * (BLOCK // team) + cuda.threadIdx.x // team
        lane = cuda.threadIdx.x % team
        n_q, n_k = s.shape[1], s.shape[2]
        live = row < s.shape[0] * n_q
        h, t = row // n_q, row % n_q
        last = n_k - 1
        if causal:
            last = t + n_k - n_q - (1 if control else 0)
        if not live:
            last = -1
        # keys past `last` are masked: never read, written as zeros
        m = NEG_INF                     # float32: a Python -inf would make m, and every exp after it, float64
        for j in range(per):
            i = lane + j * team
            vals[j] = s[h, t, i] * scale if i <= last else NEG_INF
            m = max(m, vals[j])
        for i in range(lane + per * team, last + 1, team):
            m = max(m, s[h, t, i] * scale)
        m = team_max(sh, m, team)
        acc = float32(0.0)
        for j in range(per):
            i = lane + j * team
            vals[j] = math.exp(vals[j] - m) if i <= last else float32(0.0)
            acc += vals[j]
        for i in range(lane + per * team, last + 1, team):
            p = math.exp(s[h, t, i] * scale - m)
            s[h, t, i] = p
            acc += p
        total = team_sum(sh, acc, team)
        if not live:
            return
        inv = float32(1.0) / total
        for j in range(per):
            i = lane + j * team
            if i < n_k:
                s[h, t, i] = vals[j] * inv
        for i in range(lane + per * team, n_k, team):
            s[h, t, i] = s[h, t, i] * inv if i <= last else float32(0.0)
    return softmax


_rope = {c: _make_rope(c) for c in (False, True)}


def rope(x, cos, sin, out, stream=0, control=False):
    """out = RoPE(x): x [L, H, d], cos/sin [L, r]; pairs (j, j + r), dims >= 2r copied. One element per
    thread on the GPU (a thread looping over several would wait out one load latency per element: its
    loads may alias its earlier stores)."""
    blocks = max(1, min((x.size + BLOCK - 1) // BLOCK, 2 if SIMULATED else 2 ** 31 - 1))
    _rope[control][blocks, BLOCK, stream](x, cos, sin, out)


def softmax(s, scale, causal, stream=0, control=False):
    """In place: s [B, L, S] <- softmax over S of scale * s; causal keeps keys j <= t + S - L."""
    team, per = row_team(s.shape[2])
    grid = -(-(s.shape[0] * s.shape[1]) // (BLOCK // team))
    _softmax(control, team, per)[grid, BLOCK, stream](s, np.float32(scale), bool(causal))


def attention(q, k, v, out, scale, causal, scores, stream=0, control=False):
    """out [L, Hq, dv] = softmax(scale q k^T) v per head; query head h reads kv head h // (Hq // Hk).

    scores is a float32 workspace [Hq, L, S]. float32 data; cuBLAS runs the products on TF32 tensor cores
    (inputs rounded to 10 mantissa bits, float32 accumulate).
    """
    n_q, hq, d = q.shape
    n_k, hk, dv = v.shape
    group = hq // hk
    # k and v may be column blocks of a wider product (row and head strides in elements; unit last stride)
    (k_row, k_head, k_one), (v_row, v_head, v_one) = ([s // 4 for s in a.strides] for a in (k, v))
    if k_one != 1 or v_one != 1 or not q.is_c_contiguous():
        raise ValueError("attention: q must be contiguous, k and v need a unit stride along head_dim")
    b = blas()
    for i in range(group):
        # query head h = g * group + i for the batch over kv heads g (control: h = i * hk + g)
        q_off, q_stride = (i * hk * d, d) if control else (i * d, group * d)
        h_off, h_stride = (i * hk, 1) if control else (i, group)
        b.gemm_batched_f32(OP_T, OP_N, n_k, n_q, d, k, 0, k_row, k_head, q, q_off, hq * d, q_stride,
                           scores, h_off * n_q * n_k, n_k, h_stride * n_q * n_k, hk, stream=stream, tf32=True)
    softmax(scores, scale, causal, stream)
    for i in range(group):
        h_off, h_stride = (i * hk, 1) if control else (i, group)
        b.gemm_batched_f32(OP_N, OP_N, dv, n_q, n_k, v, 0, v_row, v_head, scores, h_off * n_q * n_k, n_k,
                           h_stride * n_q * n_k, out, h_off * dv, hq * dv, h_stride * dv, hk, stream=stream,
                           tf32=True)


# --- float64 references ------------------------------------------------------------------------
def rope_reference(x, cos, sin):
    x, c, s = x.astype(np.float64), cos.astype(np.float64)[:, None, :], sin.astype(np.float64)[:, None, :]
    r = cos.shape[1]
    a, b = x[..., :r], x[..., r:2 * r]
    return np.concatenate([a * c - b * s, b * c + a * s, x[..., 2 * r:]], axis=-1)


def softmax_reference(s, scale, causal):
    s = s.astype(np.float64) * scale
    n_q, n_k = s.shape[-2:]
    if causal:
        s = np.where(np.tril(np.ones((n_q, n_k), bool), k=n_k - n_q), s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention_reference(q, k, v, scale, causal):
    group = q.shape[1] // k.shape[1]
    kk = np.repeat(k.astype(np.float64), group, axis=1).transpose(1, 2, 0)   # [Hq, d, S]
    vv = np.repeat(v.astype(np.float64), group, axis=1).transpose(1, 0, 2)   # [Hq, S, dv]
    s = q.astype(np.float64).transpose(1, 0, 2) @ kk
    return (softmax_reference(s, scale, causal) @ vv).transpose(1, 0, 2)


# --- contract ----------------------------------------------------------------------------------
def _tables(n, r):
    inv = 1e7 ** (-np.arange(r) / r)
    ang = np.arange(n)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _make_rope_inputs(rng, size):
    n, h, d, r = (3, 2, 16, 4) if size == "tiny" else (1000, 16, 256, 32)
    cos, sin = _tables(n, r)
    return {"x": rng.standard_normal((n, h, d)).astype(np.float32), "cos": cos, "sin": sin}


def _run_rope(inp, control):
    x, cos, sin = (cuda.to_device(inp[n]) for n in ("x", "cos", "sin"))
    out = cuda.device_array(inp["x"].shape, np.float32)
    rope(x, cos, sin, out, control=control)
    return out.copy_to_host()


def _ref_rope(inp):
    ref = rope_reference(inp["x"], inp["cos"], inp["sin"])
    r = inp["cos"].shape[1]
    x = np.abs(inp["x"].astype(np.float64))
    c, s = np.abs(inp["cos"])[:, None, :], np.abs(inp["sin"])[:, None, :]
    a, b = x[..., :r], x[..., r:2 * r]
    mag = np.concatenate([a * c + b * s, b * c + a * s, 0 * x[..., 2 * r:]], axis=-1)
    # two products and a sum (or one fused): 3 roundings of terms this size
    return ref, 3 * EPS32 * mag + 1e-30


def _make_softmax_inputs(rng, size):
    h, n = (1, 34) if size == "tiny" else (16, 1000)    # tiny: rows longer than the simulator's team x per
    return {"s": (rng.standard_normal((h, n, n)) * 8).astype(np.float32), "scale": 0.0625}


def _run_softmax(inp, control):
    s = cuda.to_device(inp["s"])
    softmax(s, inp["scale"], True, control=control)
    return s.copy_to_host()


def softmax_bound(s, scale, p):
    """The gate of softmax(scale s) = p (float64 reference)."""
    y = np.abs(s.astype(np.float64) * scale)
    # exp's argument carries 2 roundings of |scale s| + |max|; exp 2 ulp; the sum gamma_S; the division 1
    arg = 2 * EPS32 * (y + y.max(axis=-1, keepdims=True))
    return p * (arg + arg.max(axis=-1, keepdims=True) + 2 * gamma(s.shape[-1]) + 6 * EPS32) + 1e-30


def _ref_softmax(inp):
    p = softmax_reference(inp["s"], inp["scale"], True)
    return p, softmax_bound(inp["s"], inp["scale"], p)


def _make_attention_inputs(rng, size):
    n, hq, hk, d = (6, 4, 2, 8) if size == "tiny" else (1000, 16, 4, 256)
    return {"q": rng.standard_normal((n, hq, d)).astype(np.float32),
            "k": rng.standard_normal((n, hk, d)).astype(np.float32),
            "v": rng.standard_normal((n, hk, d)).astype(np.float32), "scale": d ** -0.5}


def _run_attention(inp, control):
    """k and v as column blocks of one [L, Hk d + Hk dv] matrix, as the stacked q|k|v product leaves them."""
    q = cuda.to_device(inp["q"])
    n, hk, d = inp["k"].shape
    kv = cuda.to_device(np.concatenate([inp["k"].reshape(n, -1), inp["v"].reshape(n, -1)], axis=1))
    k = heads_view(kv, 0, hk, d)
    v = heads_view(kv, hk * d, hk, inp["v"].shape[2])
    out = cuda.device_array(inp["q"].shape[:2] + inp["v"].shape[2:], np.float32)
    scores = cuda.device_array((q.shape[1], q.shape[0], k.shape[0]), np.float32)
    attention(q, k, v, out, inp["scale"], True, scores, control=control)
    cuda.synchronize()
    return out.copy_to_host()


def _ref_attention(inp):
    q, k, v, scale = inp["q"], inp["k"], inp["v"], inp["scale"]
    ref = attention_reference(q, k, v, scale, True)
    group = q.shape[1] // k.shape[1]
    qa = np.abs(q.astype(np.float64)).transpose(1, 0, 2)
    ka = np.repeat(np.abs(k.astype(np.float64)), group, axis=1).transpose(1, 2, 0)
    va = np.repeat(np.abs(v.astype(np.float64)), group, axis=1).transpose(1, 0, 2)
    s = q.astype(np.float64).transpose(1, 0, 2) @ np.repeat(k.astype(np.float64), group, axis=1).transpose(1, 2, 0)
    p = softmax_reference(s, scale, True)
    ys = np.abs(s * scale)
    # each score carries the TF32 rounding of q and k and gamma_d of its terms, then exp's argument
    # 2 roundings of |s| + |max|; p and v are rounded to TF32 for the second product
    e = (2 * EPS_TF32 + gamma(q.shape[2])) * scale * (qa @ ka) + 2 * EPS32 * (ys + ys.max(axis=-1, keepdims=True))
    n = k.shape[0]
    mix = p @ va
    bound = (p * e) @ va + (e.max(axis=-1, keepdims=True) + 2 * EPS_TF32 + 3 * gamma(n) + 6 * EPS32) * mix
    return ref, bound.transpose(1, 0, 2) + 1e-30


CASES = [
    Case("rope", _make_rope_inputs, _run_rope, _ref_rope, notes="control: interleaved (2j, 2j+1) pairs"),
    Case("softmax_causal", _make_softmax_inputs, _run_softmax, _ref_softmax,
         notes="control: the causal mask also hides the diagonal"),
    Case("attention_gqa", _make_attention_inputs, _run_attention, _ref_attention, simulator=False,
         notes="control: query head h reads kv head h % Hk instead of h // (Hq / Hk)"),
]
