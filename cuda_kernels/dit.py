"""The MOSS DiT's row and element kernels: RMSNorm + adaLN modulation (with the gated residual add fused in
front), per-head q/k RMSNorm + RoPE on bf16 heads, SiTU-GLU, patchify, and the CFG combination + Euler step.

The residual stream stays float32; every kernel that feeds a product writes its bf16 bits (round to nearest
even), the product's operand. Row kernels: a team of threads per row (core.row_team), the row in registers.
"""

import functools
import math

import numpy as np
from numba import cuda, float32, uint64

from .core import (BLOCK, EPS16, EPS32, SHARED, SIMULATED, Case, bf16_bound, from_bf16_bits, gamma, jit, narrow,
                   row_team, team_sum, to_bf16_bits, widen)


def _row_geometry(rows, d):
    """(grid, team, per) for rows of d elements held in registers (d <= team x per)."""
    team, per = row_team(d)
    if team * per < d:
        raise ValueError(f"rows of {d} do not fit a team's registers ({team} x {per})")
    return -(-rows // (BLOCK // team)), team, per


def _grid(n):
    blocks = -(-n // BLOCK)
    return max(1, min(blocks, 2 if SIMULATED else 8192)), BLOCK


# --- RMSNorm + modulation (+ gated residual) -----------------------------------------------
@functools.cache
def _norm_modulate(residual, bits_in, control, team, per):
    """y = (x r) w (1 + scale) + shift as bf16 bits, r = 1 / sqrt(mean(x^2) + eps); with `residual` x is
    first updated in place to x + u gate (u float32 or bf16 bits). Control: the plain form forgets the 1 of
    (1 + scale), the residual form the gate."""
    @jit
    def norm_modulate(x, u, gate, w, shift, scale, out, eps):
        sh = cuda.shared.array(SHARED, float32)
        vals = cuda.local.array(per, float32)
        rows, d = x.shape
        row = cuda.blockIdx.x * (BLOCK // team) + cuda.threadIdx.x // team
        lane = cuda.threadIdx.x % team
        live = row < rows
        r = uint64(min(row, rows - 1))
        acc = float32(0.0)
        for j in range(per):
            i = lane + j * team
            v = float32(0.0)
            if i < d:
                v = x[r, uint64(i)]
                if residual:
                    up = widen(u[r, uint64(i)]) if bits_in else u[r, uint64(i)]
                    v = v + (up if control else up * gate[uint64(i)])
                    if live:
                        x[r, uint64(i)] = v
            vals[j] = v
            acc += v * v
        inv = float32(1.0) / math.sqrt(team_sum(sh, acc, team) / float32(d) + eps)
        if not live:
            return
        for j in range(per):
            i = lane + j * team
            if i < d:
                k = uint64(i)
                s = scale[k] if control and not residual else float32(1.0) + scale[k]
                out[r, k] = narrow((vals[j] * inv) * w[k] * s + shift[k])
    return norm_modulate


def norm_modulate(x, w, shift, scale, out, eps, u=None, gate=None, stream=0, control=False):
    """out [L, D] bf16 bits = modulate(rms_norm(x)); with u and gate, x [L, D] float32 becomes x + u gate
    first (in place). w, shift, scale, gate: float32 [D]."""
    rows, d = x.shape
    grid, team, per = _row_geometry(rows, d)
    residual = u is not None
    kernel = _norm_modulate(residual, residual and u.dtype == np.uint16, control, team, per)
    if not residual:
        u, gate = x, w
    kernel[grid, BLOCK, stream](x, u, gate, w, shift, scale, out, eps)


def norm_modulate_reference(x, w, shift, scale, eps, u=None, gate=None):
    """float64: (x', y) with x' = x + u gate (or x) and y = x' / sqrt(mean(x'^2) + eps) w (1 + scale) + shift."""
    x = np.asarray(x, np.float64)
    if u is not None:
        x = x + np.asarray(u, np.float64) * np.asarray(gate, np.float64)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x, x * r * w * (1.0 + np.asarray(scale, np.float64)) + shift


def norm_modulate_bound(x, w, shift, scale, d):
    """Float32 error of the norm (gamma(d) on the sum, a few roundings after) through the modulation,
    then the bf16 rounding of the result."""
    n = np.abs(x) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-30)
    mag = n * np.abs(w) * np.abs(1.0 + scale) + np.abs(shift)
    return bf16_bound(0.0) * mag + (0.5 * gamma(d) + 8 * EPS32) * mag + 1e-30


# --- per-head q/k RMSNorm + RoPE ------------------------------------------------------------
@functools.cache
def _qk_norm_rope(control, team, per):
    """One team per (token, head); the head's d = team x per elements in registers, element j of a thread
    paired with element j + per / 2 (d / 2 apart: the rotate-half pairs). Control: rotates the other way."""
    half = per // 2

    @jit
    def qk_norm_rope(x, w, cos, sin, out, eps):
        sh = cuda.shared.array(SHARED, float32)
        vals = cuda.local.array(per, float32)
        tokens, heads, d = x.shape
        rows = tokens * heads
        row = cuda.blockIdx.x * (BLOCK // team) + cuda.threadIdx.x // team
        lane = cuda.threadIdx.x % team
        live = row < rows
        row = min(row, rows - 1)
        t, h = uint64(row // heads), uint64(row % heads)
        acc = float32(0.0)
        for j in range(per):
            vals[j] = widen(x[t, h, uint64(lane + j * team)])
            acc += vals[j] * vals[j]
        inv = float32(1.0) / math.sqrt(team_sum(sh, acc, team) / float32(d) + eps)
        if not live:
            return
        for j in range(half):
            ia, ib = lane + j * team, lane + (j + half) * team
            a = (vals[j] * inv) * w[uint64(ia)]
            b = (vals[j + half] * inv) * w[uint64(ib)]
            c, s = cos[t, uint64(ia)], sin[t, uint64(ia)]
            if control:
                s = -s
            out[t, h, uint64(ia)] = narrow(a * c - b * s)
            out[t, h, uint64(ib)] = narrow(b * c + a * s)
    return qk_norm_rope


def _qk_geometry(d):
    """(team, per): a power-of-two team of at most a warp, an even number of a head's d elements each."""
    team = 8 if SIMULATED else 32
    while team > 1 and (d % team or (d // team) % 2):
        team //= 2
    return team, d // team


def qk_norm_rope_fits(d, r):
    team, per = _qk_geometry(d)
    return team * per == d and per % 2 == 0 and 2 * r == d


def qk_norm_rope(x, w, cos, sin, out, eps, stream=0, control=False):
    """out [L, H, d] bf16 bits = rope(rms_norm(x) w) for bf16-bit heads x [L, H, d] of any strides (a column
    block of the fused qkv product); cos, sin [L, d / 2] float32; rotate-half over the whole head."""
    tokens, heads, d = x.shape
    if not qk_norm_rope_fits(d, cos.shape[1]):
        raise ValueError(f"qk_norm_rope: head {d} with {cos.shape[1]} rotary pairs does not fit its geometry")
    team, per = _qk_geometry(d)
    grid = -(-(tokens * heads) // (BLOCK // team))
    _qk_norm_rope(control, team, per)[grid, BLOCK, stream](x, w, cos, sin, out, eps)


def qk_norm_rope_reference(x, w, cos, sin, eps):
    x = np.asarray(x, np.float64)
    n = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
    r = cos.shape[1]
    c, s = np.asarray(cos, np.float64)[:, None, :], np.asarray(sin, np.float64)[:, None, :]
    a, b = n[..., :r], n[..., r:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1), n


# --- SiTU-GLU -------------------------------------------------------------------------------
@jit(device=True)
def _sigmoid(x):
    return float32(1.0) / (float32(1.0) + math.exp(-x))


@functools.cache
def _situ(control):
    @jit
    def situ(hidden, gate, out):
        rows, cols = out.shape
        for r in range(cuda.blockIdx.x, rows, cuda.gridDim.x):      # a block per row: no index division
            ro = uint64(r)
            for c in range(cuda.threadIdx.x, cols, cuda.blockDim.x):
                co = uint64(c)
                g = widen(gate[ro, co])
                h = widen(hidden[ro, co])
                a = float32(4.0) * math.tanh(g * float32(0.25))
                if not control:
                    a = a * _sigmoid(g)
                out[ro, co] = narrow(a * (float32(25.0) * math.tanh(h * float32(0.04))))
    return situ


def situ(hidden, gate, out, stream=0, control=False):
    """out = (4 tanh(g / 4) sigmoid(g)) (25 tanh(h / 25)), bf16 bits in (any strides) and out [L, F].
    Control: the sigmoid factor left out."""
    rows = out.shape[0]
    _situ(control)[max(1, min(rows, 2 if SIMULATED else 16384)), BLOCK, stream](hidden, gate, out)


def situ_reference(h, g):
    h, g = np.asarray(h, np.float64), np.asarray(g, np.float64)
    return (4.0 * np.tanh(g / 4.0) / (1.0 + np.exp(-g))) * (25.0 * np.tanh(h / 25.0))


# --- bf16 heads widened (the flash fallback's float32 inputs) ------------------------------
@functools.cache
def _widen(control):
    @jit
    def widen_heads(x, out):
        tokens, heads, d = out.shape
        start, stride = cuda.grid(1), cuda.gridsize(1)
        for n in range(start, tokens * heads * d, stride):
            t, h, i = uint64(n // (heads * d)), uint64((n // d) % heads), uint64(n % d)
            out[t, h, i] = widen(x[t, h, uint64(d - 1) - i if control else i])
    return widen_heads


def widen_heads(x, out, stream=0, control=False):
    """bf16 bits [L, H, d] of any strides -> float32 [L, H, d], exact. Control: each head read reversed."""
    grid, block = _grid(out.size)
    _widen(control)[grid, block, stream](x, out)


# --- patchify, CFG + Euler ------------------------------------------------------------------
@functools.cache
def _patchify_kernel(control):
    @jit
    def patchify(lat, out):
        channels, tokens = lat.shape
        start, stride = cuda.grid(1), cuda.gridsize(1)
        for n in range(start, channels * tokens, stride):
            t, c = uint64(n // channels), uint64(n % channels)
            if control:       # the transpose forgotten: channel-major order read as token-major
                out[t, c] = narrow(lat[uint64(n // tokens), uint64(n % tokens)])
            else:
                out[t, c] = narrow(lat[c, t])
    return patchify


def patchify(lat, out, stream=0, control=False):
    """Packed latents [C, h w] float32 (channel-major) -> image tokens [h w, C] as bf16 bits."""
    grid, block = _grid(lat.size)
    _patchify_kernel(control)[grid, block, stream](lat, out)


@functools.cache
def _cfg_euler(cfg, control):
    @jit
    def cfg_euler(x, c, u, v, step):
        channels, tokens = x.shape
        dt, g = step[0], step[1]
        start, stride = cuda.grid(1), cuda.gridsize(1)
        for n in range(start, channels * tokens, stride):
            ch, t = uint64(n // tokens), uint64(n % tokens)
            cond = c[t, ch]
            vel = cond
            if cfg:
                base = u[t, ch]
                vel = (cond if control else base) + g * (cond - base)
            v[ch, t] = vel
            x[ch, t] = x[ch, t] + dt * vel
    return cfg_euler


def cfg_euler(x, c, u, v, step, cfg=True, stream=0, control=False):
    """v = u + g (c - u) (or c without CFG) and x += dt v; x, v [C, h w] float32 channel-major, c, u the
    velocities [h w, C] token-major; step a device float32 [2] = (dt, g). Control: c as the base."""
    grid, block = _grid(x.size)
    _cfg_euler(cfg, control)[grid, block, stream](x, c, u, v, step)


# --- contract --------------------------------------------------------------------------------
def _make_rows(rows, d):
    def make(rng, size):
        r, n = (5, 32) if size == "tiny" else (rows, d)
        x = (rng.standard_normal((r, n)) * 2).astype(np.float32)
        x[0] *= np.float32(1e-3)
        x[1, 3] = 300.0                  # a massive channel, as the base model's stream has
        return {"x": x, "u": to_bf16_bits(rng.standard_normal((r, n)) * 4), "gate": (rng.standard_normal(n) * 0.3).astype(np.float32),
                "w": (1 + rng.standard_normal(n) * 0.2).astype(np.float32),
                "shift": (rng.standard_normal(n) * 0.5).astype(np.float32),
                "scale": (rng.standard_normal(n) * 0.5).astype(np.float32), "eps": 1e-6}
    return make


def _run_norm_modulate(inp, control, residual):
    x = cuda.to_device(inp["x"])
    w, shift, scale, gate, u = (cuda.to_device(inp[k]) for k in ("w", "shift", "scale", "gate", "u"))
    out = cuda.device_array(inp["x"].shape, np.uint16)
    if residual:
        norm_modulate(x, w, shift, scale, out, inp["eps"], u=u, gate=gate, control=control)
        return np.concatenate([x.copy_to_host().astype(np.float64), from_bf16_bits(out.copy_to_host())])
    norm_modulate(x, w, shift, scale, out, inp["eps"], control=control)
    return from_bf16_bits(out.copy_to_host())


def _ref_norm_modulate(inp, residual):
    u = from_bf16_bits(inp["u"]) if residual else None
    x, y = norm_modulate_reference(inp["x"], inp["w"], inp["shift"], inp["scale"], inp["eps"], u, inp["gate"])
    d = x.shape[1]
    bound = norm_modulate_bound(x, inp["w"], inp["shift"], inp["scale"], d)
    if not residual:
        return y, bound
    # x' = x + u gate: the product and the sum each rounded once in float32
    xb = 2 * EPS32 * (np.abs(inp["x"]) + np.abs(u * inp["gate"])) + 1e-30
    # y is computed from x' as stored (each element within xb of the exact one): that error through the norm's
    # scale, and the row's rms moved by at most 2 EPS32 relative
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + inp["eps"])
    carried = xb * inv * np.abs(inp["w"] * (1.0 + inp["scale"])) * 1.01 + 4 * EPS32 * np.abs(y - inp["shift"])
    return np.concatenate([x, y]), np.concatenate([xb, bound + carried])


def _make_qk(rng, size):
    tokens, heads, d = (3, 2, 32) if size == "tiny" else (4396, 48, 128)
    wide = rng.standard_normal((tokens, 3 * heads, d)) * 3
    wide[0, 0] *= 1e-3
    r = d // 2
    pos = np.arange(tokens)[:, None] - tokens / 2
    angles = pos * (10000.0 ** (-np.arange(r) / r))[None, :]
    return {"wide": to_bf16_bits(wide), "heads": heads, "w": (1 + rng.standard_normal(d) * 0.2).astype(np.float32),
            "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32), "eps": 1e-6}


def _run_qk(inp, control):
    """The q and k heads as the fused qkv product leaves them: the first 2H heads of a [L, 3H, d] matrix."""
    wide = cuda.to_device(inp["wide"])
    x = wide[:, :2 * inp["heads"], :]
    out = cuda.device_array(x.shape, np.uint16)
    w, cos, sin = (cuda.to_device(inp[k]) for k in ("w", "cos", "sin"))
    qk_norm_rope(x, w, cos, sin, out, inp["eps"], control=control)
    return from_bf16_bits(out.copy_to_host())


def _ref_qk(inp):
    x = from_bf16_bits(inp["wide"])[:, :2 * inp["heads"], :]
    ref, n = qk_norm_rope_reference(x, inp["w"], inp["cos"], inp["sin"], inp["eps"])
    r = inp["cos"].shape[1]
    c, s = np.abs(inp["cos"]).astype(np.float64)[:, None, :], np.abs(inp["sin"]).astype(np.float64)[:, None, :]
    a, b = np.abs(n[..., :r]), np.abs(n[..., r:])
    mag = np.concatenate([a * c + b * s, b * c + a * s], axis=-1)
    return ref, bf16_bound(0.5 * gamma(x.shape[2]) + 9 * EPS32) * np.maximum(mag, np.abs(ref)) + 1e-30


def _make_situ(rng, size):
    rows, f = (4, 24) if size == "tiny" else (4396, 8192)
    both = rng.standard_normal((rows, 2 * f)) * 4
    both[0, :4] = [60.0, -60.0, 200.0, -200.0]    # saturated tanh / sigmoid
    return {"both": to_bf16_bits(both), "f": f}


def _run_situ(inp, control):
    both = cuda.to_device(inp["both"])
    f = inp["f"]
    out = cuda.device_array((both.shape[0], f), np.uint16)
    situ(both[:, :f], both[:, f:], out, control=control)
    return from_bf16_bits(out.copy_to_host())


def _ref_situ(inp):
    both, f = from_bf16_bits(inp["both"]), inp["f"]
    ref = situ_reference(both[:, :f], both[:, f:])
    # tanh, exp, the products in float32 (a few ulp each), then the bf16 rounding of the result
    return ref, bf16_bound(16 * EPS32) * np.abs(ref) + 1e-30


def _make_latents(rng, size):
    c, h, w = (8, 3, 4) if size == "tiny" else (128, 64, 64)
    n = h * w
    return {"x": rng.standard_normal((c, n)).astype(np.float32), "c": rng.standard_normal((n, c)).astype(np.float32),
            "u": rng.standard_normal((n, c)).astype(np.float32), "step": np.array([-0.0421, 3.0], np.float32)}


def _run_widen(inp, control):
    wide = cuda.to_device(inp["wide"])
    x = wide[:, :2 * inp["heads"], :]
    out = cuda.device_array(x.shape, np.float32)
    widen_heads(x, out, control=control)
    return out.copy_to_host().astype(np.float64)


def _ref_widen(inp):
    return from_bf16_bits(inp["wide"])[:, :2 * inp["heads"], :], np.zeros(1) + 1e-300


def _run_patchify(inp, control):
    lat = cuda.to_device(inp["x"])
    out = cuda.device_array(inp["x"].T.shape, np.uint16)
    patchify(lat, out, control=control)
    return from_bf16_bits(out.copy_to_host())


def _ref_patchify(inp):
    ref = inp["x"].T.astype(np.float64)
    return ref, EPS16 * np.abs(ref) + 1e-30


def _run_cfg_euler(inp, control):
    x, c, u, step = (cuda.to_device(inp[k]) for k in ("x", "c", "u", "step"))
    v = cuda.device_array(inp["x"].shape, np.float32)
    cfg_euler(x, c, u, v, step, control=control)
    return np.concatenate([x.copy_to_host(), v.copy_to_host()]).astype(np.float64)


def _ref_cfg_euler(inp):
    dt, g = (float(s) for s in inp["step"])
    c, u = inp["c"].T.astype(np.float64), inp["u"].T.astype(np.float64)
    v = u + g * (c - u)
    x = inp["x"] + dt * v
    vb = 3 * EPS32 * (np.abs(u) + np.abs(g) * (np.abs(c) + np.abs(u)))
    xb = 2 * EPS32 * (np.abs(x) + abs(dt) * (np.abs(v) + vb)) + abs(dt) * vb
    return np.concatenate([x, v]), np.concatenate([xb, vb]) + 1e-30


CASES = [
    Case("norm_modulate", _make_rows(4396, 3072), lambda i, c: _run_norm_modulate(i, c, False),
         lambda i: _ref_norm_modulate(i, False), notes="control: x (scale) + shift, the 1 of 1 + scale forgotten"),
    Case("residual_norm_modulate", _make_rows(4396, 3072), lambda i, c: _run_norm_modulate(i, c, True),
         lambda i: _ref_norm_modulate(i, True), notes="control: the residual added without its gate"),
    Case("qk_norm_rope", _make_qk, _run_qk, _ref_qk, notes="q/k heads of the fused qkv product; control: sin negated"),
    Case("widen_heads", _make_qk, _run_widen, _ref_widen, notes="exact; control: each head read reversed"),
    Case("situ", _make_situ, _run_situ, _ref_situ, notes="control: the gate's sigmoid factor left out"),
    Case("patchify", _make_latents, _run_patchify, _ref_patchify, notes="control: the transpose forgotten"),
    Case("cfg_euler", _make_latents, _run_cfg_euler, _ref_cfg_euler, notes="control: c + g (c - u)"),
]
