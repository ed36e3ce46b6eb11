"""Row normalisations: RMSNorm (plain or zero-centred), the L2 norm of GDN q/k, the gated RMSNorm.

A team of threads per row (core.row_team: 16 or 32 for head-sized rows, a whole block for hidden rows),
several rows per block; each thread keeps `per` of the row's elements in registers between the sum of
squares and the write (the row is read once up to team x per elements). The RMSNorms can write bf16 bits, the next product's operand.
"""

import functools
import math

import numpy as np
from numba import cuda, float32, uint64

from .core import (BLOCK, EPS32, SHARED, Case, bf16_bound, from_bf16_bits, gamma, heads_view, jit, narrow, row_team,
                   team_sum)


def _geometry(x):
    """(grid, team, per, exact) for the rows of x [L, H, d], BLOCK // team rows per block; exact: d is
    team x per (the kernels' unchecked form, _load_row)."""
    team, per = row_team(x.shape[2])
    return -(-(x.shape[0] * x.shape[1]) // (BLOCK // team)), team, per, x.shape[2] == team * per


@functools.cache
def _load_row(team, per, exact=False):
    """The device function every norm starts with: this thread's row (t, h), its lane, whether the row exists,
    its `per` elements into vals (zeros past the end) and its share of the row's sum of squares.
    exact: rows of exactly team x per elements, so no element needs a bounds check (a row past the end
    reads the last row, its values unused but for its own team's sum). With the checks Nsight Compute found
    rms_norm's instructions mostly integer ones: the 64-bit compares of three checks an element
    (scripts/gpu_ncu_kernels.py)."""
    @jit(device=True, forceinline=True)
    def load_row(x, vals):
        rows = x.shape[0] * x.shape[1]
        row = cuda.blockIdx.x * (BLOCK // team) + cuda.threadIdx.x // team
        lane = cuda.threadIdx.x % team
        live = row < rows
        if exact:
            row = min(row, rows - 1)
        t, h = uint64(row // x.shape[1]), uint64(row % x.shape[1])   # unsigned: no negative-index wrap
        d = x.shape[2] if live or exact else 0
        acc = float32(0.0)
        for j in range(per):
            i = lane + j * team
            vals[j] = x[t, h, uint64(i)] if exact or i < d else float32(0.0)
            acc += vals[j] * vals[j]
        if not exact:
            for i in range(lane + per * team, d, team):
                acc += x[t, h, uint64(i)] * x[t, h, uint64(i)]
        return t, h, lane, live, acc
    return load_row


@jit(device=True)
def _store(out, t, h, i, y, bits):
    """out[t, h, i] = y, as bf16 bits (round to nearest even) when `bits`."""
    if bits:
        out[t, h, i] = narrow(y)
    else:
        out[t, h, i] = y


@jit(device=True)
def _gate(g, control):
    """silu(g) (control: sigmoid(g))."""
    s = float32(1.0) / (float32(1.0) + math.exp(-g))
    return s if control else g * s


@functools.cache
def _rms(control, bits, team, per, exact=False):
    load_row = _load_row(team, per, exact)

    @jit
    def rms_norm(x, w, out, eps, offset):
        sh = cuda.shared.array(SHARED, float32)
        vals = cuda.local.array(per, float32)
        scale = cuda.local.array(per, float32)
        t, h, lane, live, acc = load_row(x, vals)
        d = x.shape[2]
        # the weights' loads issued before the sum and the stores (a load written after a store waits
        # for it: the two may alias)
        for j in range(per):
            i = lane + j * team
            if exact or i < d:
                scale[j] = w[uint64(i)] if control else offset + w[uint64(i)]
        r = float32(1.0) / math.sqrt(team_sum(sh, acc, team) / float32(d) + eps)
        if not live:
            return
        # the first per x team elements from registers (a constant trip count, unrolled), any rest read again
        for j in range(per):
            i = lane + j * team
            if exact or i < d:
                _store(out, t, h, uint64(i), vals[j] * r * scale[j], bits)
        for i in range(lane + per * team, 0 if exact else d, team):
            u = uint64(i)
            _store(out, t, h, u, x[t, h, u] * r * (w[u] if control else offset + w[u]), bits)
    return rms_norm


@functools.cache
def _l2(control, team, per, exact=False):
    load_row = _load_row(team, per, exact)

    @jit
    def l2_norm(x, out, eps, scale):
        sh = cuda.shared.array(SHARED, float32)
        vals = cuda.local.array(per, float32)
        t, h, lane, live, acc = load_row(x, vals)
        d = x.shape[2]
        total = team_sum(sh, acc, team)
        if control:
            total = total / float32(d)
        r = scale / math.sqrt(total + eps)
        if not live:
            return
        for j in range(per):
            i = lane + j * team
            if exact or i < d:
                out[t, h, uint64(i)] = vals[j] * r
        for i in range(lane + per * team, 0 if exact else d, team):
            out[t, h, uint64(i)] = x[t, h, uint64(i)] * r
    return l2_norm


@functools.cache
def _gated(control, bits, team, per, exact=False):
    load_row = _load_row(team, per, exact)

    @jit
    def gated_rms_norm(x, z, w, out, eps):
        sh = cuda.shared.array(SHARED, float32)
        vals = cuda.local.array(per, float32)
        zs = cuda.local.array(per, float32)
        ws = cuda.local.array(per, float32)
        t, h, lane, live, acc = load_row(x, vals)
        d = x.shape[2]
        for j in range(per):            # loaded before the sum and the stores (as rms_norm)
            i = lane + j * team
            if exact or i < d:
                zs[j], ws[j] = z[t, h, uint64(i)], w[uint64(i)]
        r = float32(1.0) / math.sqrt(team_sum(sh, acc, team) / float32(d) + eps)
        if not live:
            return
        for j in range(per):
            i = lane + j * team
            if exact or i < d:
                _store(out, t, h, uint64(i), ws[j] * (vals[j] * r) * _gate(zs[j], control), bits)
        for i in range(lane + per * team, 0 if exact else d, team):
            u = uint64(i)
            _store(out, t, h, u, w[u] * (x[t, h, u] * r) * _gate(z[t, h, u], control), bits)
    return gated_rms_norm


@functools.cache
def _rms_rope(control, team, per, shift):
    """rms_norm then rotate-half RoPE on the first 2r dims (r = shift x team): element lane + j team's
    partner is the same thread's element j +- shift, so the rotation runs on registers."""
    load_row = _load_row(team, per)

    @jit
    def rms_norm_rope(x, w, cos, sin, out, eps, offset):
        sh = cuda.shared.array(SHARED, float32)
        vals = cuda.local.array(per, float32)
        scale = cuda.local.array(per, float32)
        cs = cuda.local.array(shift, float32)
        sn = cuda.local.array(shift, float32)
        t, h, lane, live, acc = load_row(x, vals)
        d = x.shape[2]
        tc = min(t, uint64(cos.shape[0] - 1))            # (a row past the end reads the last token's angles)
        for j in range(per):                            # loads before the sum and the stores (as rms_norm)
            i = lane + j * team
            if i < d:
                scale[j] = offset + w[uint64(i)]
        for j in range(shift):
            u = uint64(lane + j * team)
            cs[j] = cos[tc, u]
            sn[j] = -sin[tc, u] if control else sin[tc, u]
        r = float32(1.0) / math.sqrt(team_sum(sh, acc, team) / float32(d) + eps)
        if not live:
            return
        for j in range(per):
            vals[j] = vals[j] * r * scale[j]
        for j in range(per):
            i = lane + j * team
            if i < d:
                y = vals[j]
                if j < shift:
                    y = vals[j] * cs[j] - vals[j + shift] * sn[j]
                elif j < 2 * shift:
                    y = vals[j] * cs[j - shift] + vals[j - shift] * sn[j - shift]
                out[t, h, uint64(i)] = y
    return rms_norm_rope


def rms_norm_rope_fits(d, r):
    """Whether rms_norm_rope takes rows of d with r rotated pairs: the rotated dims' partners in one thread."""
    team, per = row_team(d)
    return d <= team * per and r % team == 0 and 2 * r <= team * per


def rms_norm_rope(x, w, cos, sin, out, eps, offset, stream=0, control=False):
    """out = RoPE(rms_norm(x)) (rope_attention.rope of norms.rms_norm, float32) over x [L, H, d] of any strides,
    cos/sin [L, r]: one kernel where rms_norm_rope_fits(d, r), else the two. control: rotates backwards."""
    d, r = x.shape[2], cos.shape[1]
    if not rms_norm_rope_fits(d, r):
        raise ValueError(f"rms_norm_rope: rows of {d} with {r} rotated pairs do not fit one thread's registers")
    grid, team, per, _ = _geometry(x)
    _rms_rope(control, team, per, r // team)[grid, BLOCK, stream](x, w, cos, sin, out, np.float32(eps),
                                                                  np.float32(offset))


def _bits(out):
    return out.dtype == np.uint16


def rms_norm(x, w, out, eps, offset, stream=0, control=False):
    """out = x / sqrt(mean(x^2) + eps) * (offset + w) over the last axis of x [L, H, d] (any strides: the
    heads of a column block); w float32 [d]; out float32, or uint16 for bf16 bits (round to nearest even)."""
    grid, team, per, exact = _geometry(x)
    _rms(control, _bits(out), team, per, exact)[grid, BLOCK, stream](x, w, out, np.float32(eps), np.float32(offset))


def l2_norm(x, out, eps, scale=1.0, stream=0, control=False):
    """out = x / sqrt(sum(x^2) + eps) * scale over the last axis of x [L, H, d] (any strides: the heads of a
    column block) (eps inside the sqrt of the sum)."""
    grid, team, per, exact = _geometry(x)
    _l2(control, team, per, exact)[grid, BLOCK, stream](x, out, np.float32(eps), np.float32(scale))


def gated_rms_norm(x, z, w, out, eps, stream=0, control=False):
    """out = (w * x / sqrt(mean(x^2) + eps)) * silu(z) over the last axis of x, z [L, H, d] (any strides);
    w float32 [d]; out float32 or uint16 (bf16 bits)."""
    grid, team, per, exact = _geometry(x)
    _gated(control, _bits(out), team, per, exact)[grid, BLOCK, stream](x, z, w, out, np.float32(eps))


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


# --- gates: the bound on |kernel - reference| for a reference `ref` over rows of d -----------------------
def rms_norm_bound(ref, d, bits=False):
    # the sum of squares carries gamma_d relative error, the 1/sqrt half of it; a few more roundings
    rel = 0.5 * gamma(d) + 6 * EPS32
    return (bf16_bound(rel) if bits else rel) * np.abs(ref) + 1e-30


def l2_norm_bound(ref, d):
    return (0.5 * gamma(d) + 5 * EPS32) * np.abs(ref) + 1e-30


def gated_rms_norm_bound(ref, d, bits=False):
    # as rms_norm, plus silu (exp within 2 ulp, a division, a product); bf16 bits add half a bf16 ulp
    rel = 0.5 * gamma(d) + 12 * EPS32
    return (bf16_bound(rel) if bits else rel) * np.abs(ref) + 1e-30


# --- contract --------------------------------------------------------------------------------
def _maker(rows, d, tiny=(4, 40)):
    """Inputs of `rows` rows of d at real size (the encoder's: hidden rows 4096, q/k heads 256, GDN heads 128);
    `tiny` the simulator's (rows, d): 40 leaves a rest past the registers' team x per = 32, 32 fills them
    exactly (the kernels' unchecked form, the encoder's at every real size), 6 rows a part block."""
    def make(rng, size):
        r, n = tiny if size == "tiny" else (rows, d)
        x = rng.standard_normal((r, n)).astype(np.float32)
        x[0] *= np.float32(1e-3)    # a small row, where eps matters
        return {"x": x, "z": rng.standard_normal((r, n)).astype(np.float32) * 3,
                "w": (rng.standard_normal(n) * 0.5).astype(np.float32), "eps": 1e-6}
    return make


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
    bound = rms_norm_bound(ref, inp["x"].shape[1], bits)
    return np.concatenate([ref, ref]), np.concatenate([bound, bound])


def _run_l2(inp, control):
    """x as the heads of a column block of a wider matrix, as the GDN q/k come to it."""
    x = _heads(inp, "x")
    out = cuda.device_array(x.shape, np.float32)
    l2_norm(x, out, inp["eps"], 0.25, control=control)
    return out.copy_to_host().reshape(inp["x"].shape)


def _ref_l2(inp):
    ref = l2_norm_reference(inp["x"], inp["eps"], 0.25)
    return ref, l2_norm_bound(ref, inp["x"].shape[1])


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
    return ref, gated_rms_norm_bound(ref, inp["x"].shape[1], bits)


def _make_rms_rope(rng, size):
    rows, heads, d, r = (3, 2, 32, 8) if size == "tiny" else (1000, 16, 256, 32)
    x = rng.standard_normal((rows, 2 * heads, d)).astype(np.float32)
    x[0, 0] *= np.float32(1e-3)
    angles = np.arange(rows)[:, None] * (10000.0 ** (-np.arange(r) / r))[None, :]
    return {"x": x, "w": (rng.standard_normal(d) * 0.5).astype(np.float32), "eps": 1e-6,
            "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}


def _run_rms_rope(inp, control):
    """x the query heads of a [L, 2H, d] product (every other head: q of (q | gate) pairs)."""
    wide, w, cos, sin = _device(inp, "x", "w", "cos", "sin")
    x = wide[:, ::2, :]
    out = cuda.device_array(x.shape, np.float32)
    rms_norm_rope(x, w, cos, sin, out, inp["eps"], 1.0, control=control)
    return out.copy_to_host()


def _ref_rms_rope(inp):
    from .rope_attention import rope_reference
    x = inp["x"][:, ::2, :]
    normed = rms_norm_reference(x, inp["w"], inp["eps"], 1.0)
    ref = rope_reference(normed, inp["cos"], inp["sin"])
    # rms_norm's relative error on each normed value, then the rotation's product pair and sum (3 roundings)
    r = inp["cos"].shape[1]
    n = np.abs(normed)
    c, s = np.abs(inp["cos"]).astype(np.float64)[:, None, :], np.abs(inp["sin"]).astype(np.float64)[:, None, :]
    a, b = n[..., :r], n[..., r:2 * r]
    mag = np.concatenate([a * c + b * s, b * c + a * s, n[..., 2 * r:]], axis=-1)
    return ref, (0.5 * gamma(x.shape[2]) + 9 * EPS32) * mag + 1e-30


CASES = [
    Case("rms_norm_rope", _make_rms_rope, _run_rms_rope, _ref_rms_rope,
         notes="q heads of a (q | gate) product; control: rotates the other way (sin negated)"),
    Case("rms_norm", _maker(16384, 256), _run_rms, _ref_rms, notes="control: plain w where zero-centred needs 1 + w"),
    Case("l2_norm", _maker(16384, 128, (6, 32)), _run_l2, _ref_l2,
         notes="control: mean of squares instead of the sum"),
    Case("rms_norm_bf16_out", _maker(4000, 4096, (6, 32)), lambda i, c: _run_rms(i, c, True),
         lambda i: _ref_rms(i, True), notes="control: plain w where zero-centred needs 1 + w"),
    Case("gated_rms_norm", _maker(4000, 4096), _run_gated, _ref_gated, notes="control: sigmoid(z) gate instead of silu(z)"),
    Case("gated_rms_norm_bf16_out", _maker(32768, 128, (6, 32)), lambda i, c: _run_gated(i, c, True),
         lambda i: _ref_gated(i, True), notes="control: sigmoid(z) gate instead of silu(z)"),
]
