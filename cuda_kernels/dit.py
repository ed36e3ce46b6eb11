"""The MOSS DiT's row and element kernels: RMSNorm + adaLN modulation (with the gated residual add fused in
front), per-head q/k RMSNorm + RoPE on bf16 heads, SiTU-GLU, patchify, and the CFG combination + Euler step.

The residual stream stays float32; every kernel that feeds a product writes its bf16 bits (round to nearest
even), the product's operand. Row kernels: a team of threads per row (core.row_team), the row in registers.
"""

import functools
import math

import numpy as np
from numba import cuda, float32, uint16, uint32, uint64

from .elementwise import _words
from .core import (BLOCK, EPS16, EPS32, SHARED, SIMULATED, Case, DeviceView, as_float32, bf16_bound, float32_bits, from_bf16_bits, gamma, jit, narrow,
                   ptx_op, row_team, team_row, team_sum, to_bf16_bits, widen)


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
        r, lane, live = team_row(rows, team)
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


@jit(device=True, forceinline=True)
def _lo(word):
    return as_float32(uint32(word & uint64(0xFFFFFFFF)))


@jit(device=True, forceinline=True)
def _hi(word):
    return as_float32(uint32(word >> uint64(32)))


@functools.cache
def _norm_modulate_pairs(residual, bits_in, control, team, per):
    """norm_modulate on element pairs: x and the float32 vectors as 8-byte words of two floats, u and out
    as 4-byte words of two bf16 (a row of d is d / 2 words; per words a thread)."""
    size = 2 * per

    @jit
    def norm_modulate_pairs(x, u, gate, w, shift, scale, out, eps):
        sh = cuda.shared.array(SHARED, float32)
        vals = cuda.local.array(size, float32)
        rows, words = x.shape
        r, lane, live = team_row(rows, team)
        acc = float32(0.0)
        for j in range(per):
            i = lane + j * team
            a, b = float32(0.0), float32(0.0)
            if i < words:
                k = uint64(i)
                xw = x[r, k]
                a, b = _lo(xw), _hi(xw)
                if residual:
                    if bits_in:
                        uw = u[r, k]
                        ua, ub = widen(uint16(uw & uint32(0xFFFF))), widen(uint16(uw >> uint32(16)))
                    else:
                        uw2 = u[r, k]
                        ua, ub = _lo(uw2), _hi(uw2)
                    if not control:
                        gw = gate[k]
                        ua, ub = ua * _lo(gw), ub * _hi(gw)
                    a, b = a + ua, b + ub
                    if live:
                        x[r, k] = uint64(float32_bits(a)) | (uint64(float32_bits(b)) << uint64(32))
            vals[2 * j], vals[2 * j + 1] = a, b
            acc += a * a + b * b
        inv = float32(1.0) / math.sqrt(team_sum(sh, acc, team) / float32(2 * words) + eps)
        if not live:
            return
        for j in range(per):
            i = lane + j * team
            if i < words:
                k = uint64(i)
                ww, fw, cw = w[k], shift[k], scale[k]
                sa, sb = _lo(cw), _hi(cw)
                if not (control and not residual):
                    sa, sb = float32(1.0) + sa, float32(1.0) + sb
                ya = (vals[2 * j] * inv) * _lo(ww) * sa + _lo(fw)
                yb = (vals[2 * j + 1] * inv) * _hi(ww) * sb + _hi(fw)
                out[r, k] = uint32(narrow(ya)) | (uint32(narrow(yb)) << uint32(16))
    return norm_modulate_pairs


def _view(a, typestr, item):
    """A contiguous device array (last axis even) seen as words of `item` bytes (no copy), else None."""
    if SIMULATED:
        host = a._ary
        if not host.flags.c_contiguous or host.shape[-1] * host.itemsize % item:
            return None
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(host.view(np.dtype(typestr)))
    face = a.__cuda_array_interface__
    shape = tuple(face["shape"])
    own = np.dtype(face["typestr"]).itemsize
    dense = face["strides"] is None or tuple(face["strides"]) == tuple(
        int(np.prod(shape[i + 1:])) * own for i in range(len(shape)))
    if not dense or shape[-1] * own % item or face["data"][0] % item:
        return None
    return cuda.as_cuda_array(DeviceView(a, shape[:-1] + (shape[-1] * own // item,), None, typestr))


def norm_modulate(x, w, shift, scale, out, eps, u=None, gate=None, stream=0, control=False):
    """out [L, D] bf16 bits = modulate(rms_norm(x)); with u and gate, x [L, D] float32 becomes x + u gate
    first (in place). w, shift, scale, gate: float32 [D]."""
    rows, d = x.shape
    residual = u is not None
    bits_in = residual and u.dtype == np.uint16
    if not residual:
        u, gate = x, w
    views = [_view(a, "<u8", 8) for a in (x, gate, w, shift, scale)]
    views += [_view(u, "<u4" if bits_in else "<u8", 4 if bits_in else 8), _view(out, "<u4", 4)]
    if d % 2 == 0 and all(v is not None for v in views):
        grid, team, per = _row_geometry(rows, d // 2)
        xw, gw, ww, fw, cw, uw, ow = views
        _norm_modulate_pairs(residual, bits_in, control, team, per)[grid, BLOCK, stream](xw, uw, gw, ww, fw, cw, ow, np.float32(eps))
        return
    grid, team, per = _row_geometry(rows, d)
    kernel = _norm_modulate(residual, bits_in, control, team, per)
    kernel[grid, BLOCK, stream](x, u, gate, w, shift, scale, out, np.float32(eps))


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
# Bf16 values a thread reads and writes as one word: 2 (4-byte words) or 4 (8-byte words: half the threads a
# head, twice the bytes in flight each). The 8-byte form is the default: a 1024 step took 182.2 ms with it
# against 183.9 with 4-byte words in one H200 run; gpu_dit.py times the 4-byte form beside it.
QK_WIDTH = 4
# Heads a team takes in a row (qk_group: the largest divisor of the heads up to this): the token's cos and sin
# and the weights at the thread's elements are read once for them, not once a head (gpu_dit.py times one head a
# team beside it: 184.2 against 181.2 ms a 1024 step, results/h200/dit-6f7f332.json).
QK_GROUP = 8


@functools.cache
def _qk_norm_rope(control, team, per, width=2, group=1):
    """One team per (token, `group` heads in a row), the head's d elements in registers as per words of `width`
    bf16 each (team x per x width = d); word j of a thread pairs with word j + per / 2 (d / 2 elements on: the
    rotate-half pairs). The token's cos and sin and both weights at the thread's elements are read once for
    its group. Heads from `split` on take the second weight and go to the second output (q and k in one
    launch, each into its own contiguous array). The group's words are all loaded before its first store (the
    compiler may not move a load above a store to memory it cannot tell apart). Control: rotates the other way."""
    half, size, loads = per // 2, width * per, group * per
    word = uint32 if width == 2 else uint64

    @jit
    def qk_norm_rope(x, w, w2, split, cos, sin, out, out2, eps):
        sh = cuda.shared.array(SHARED, float32)
        vals = cuda.local.array(size, float32)
        wa_, wb_ = cuda.local.array(size, float32), cuda.local.array(size, float32)
        cs, sn = cuda.local.array(size, float32), cuda.local.array(size, float32)
        raw = cuda.local.array(loads, word)
        tokens, heads, words = x.shape
        groups = (heads + group - 1) // group
        rows = tokens * groups
        row = cuda.blockIdx.x * (BLOCK // team) + cuda.threadIdx.x // team
        lane = cuda.threadIdx.x % team
        live = row < rows
        row = min(row, rows - 1)
        t, h0 = uint64(row // groups), uint64((row % groups) * group)
        for k in range(group):                     # every load of the group first: stores cannot delay them
            hr = min(h0 + uint64(k), uint64(heads - 1))    # a head past the end (none: group | heads) stores nothing
            for j in range(per):
                raw[per * k + j] = x[t, hr, uint64(lane + j * team)]
        for j in range(per):                       # the thread's elements: weights, and cos / sin of the pairs
            for e in range(width):
                i = uint64(width * (lane + j * team) + e)
                wa_[width * j + e] = w[i]
                wb_[width * j + e] = w2[i]
                if j < half:
                    cs[width * j + e] = cos[t, i]
                    sn[width * j + e] = -sin[t, i] if control else sin[t, i]
        for k in range(group):
            h = h0 + uint64(k)
            acc = float32(0.0)
            for j in range(per):
                bits = raw[per * k + j]
                for e in range(width):
                    v = widen(uint16((bits >> word(16 * e)) & word(0xFFFF)))
                    vals[width * j + e] = v
                    acc += v * v
            inv = float32(1.0) / math.sqrt(team_sum(sh, acc, team) / float32(width * words) + eps)
            if live and h < uint64(heads):
                second = h >= uint64(split)
                dst = out2 if second else out
                ho = h - uint64(split) if second else h
                for j in range(half):
                    lo_a, lo_b = word(0), word(0)
                    for e in range(width):
                        ia, ib = width * j + e, width * (j + half) + e
                        a = (vals[ia] * inv) * (wb_[ia] if second else wa_[ia])
                        b = (vals[ib] * inv) * (wb_[ib] if second else wa_[ib])
                        c, si = cs[ia], sn[ia]
                        lo_a |= word(narrow(a * c - b * si)) << word(16 * e)
                        lo_b |= word(narrow(b * c + a * si)) << word(16 * e)
                    dst[t, ho, uint64(lane + j * team)] = lo_a
                    dst[t, ho, uint64(lane + (j + half) * team)] = lo_b
    return qk_norm_rope


def _qk_geometry(d, width=2):
    """(team, per): a power-of-two team of at most a warp, an even number of `width`-element words each."""
    team = 8 if SIMULATED else 32
    while team > 1 and (d % (width * team) or (d // (width * team)) % 2):
        team //= 2
    return team, d // (width * team)


def qk_group(heads, most=None):
    """Heads a team takes in a row: the largest of `most` (None: QK_GROUP), ..., 1 that divides `heads`."""
    return max(g for g in range(1, (most or QK_GROUP) + 1) if heads % g == 0)


def qk_norm_rope_fits(d, r, width=2):
    team, per = _qk_geometry(d, width)
    return width * team * per == d and per % 2 == 0 and 2 * r == d


def _words3(a, width=2):
    """[L, H, d] bf16 bits of unit element stride as words of `width` bf16 [L, H, d / width] (no copy), else None."""
    item = 2 * width
    if SIMULATED:
        host = a._ary
        if host.strides[2] != 2 or host.shape[2] % width or any(st % item for st in host.strides[:2]):
            return None
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(host.view(np.uint32 if width == 2 else np.uint64))
    face = a.__cuda_array_interface__
    shape = face["shape"]
    strides = face["strides"] or (shape[1] * shape[2] * 2, shape[2] * 2, 2)
    if strides[2] != 2 or shape[2] % width or face["data"][0] % item or strides[0] % item or strides[1] % item:
        return None
    return cuda.as_cuda_array(DeviceView(a, (shape[0], shape[1], shape[2] // width), (strides[0], strides[1], item),
                                         f"<u{item}"))


def qk_norm_rope(x, w, cos, sin, out, eps, w2=None, out2=None, stream=0, control=False, width=None, group=None):
    """out [L, H, d] bf16 bits = rope(rms_norm(x) w) for bf16-bit heads x [L, H, d] (any token and head
    strides, unit element stride: a column block of the fused qkv product); with w2 and out2, x holds the
    q heads then as many k heads ([L, 2H, d]: one launch), the k heads normed with w2 into out2.
    cos, sin [L, d / 2] float32; rotate-half over the whole head. width: bf16 values a word (QK_WIDTH); group:
    at most this many heads a team (qk_group; None: QK_GROUP)."""
    width = width or QK_WIDTH
    tokens, heads, d = x.shape
    split = heads if out2 is None else heads // 2
    words = _words3(x, width), _words3(out, width), _words3(out if out2 is None else out2, width)
    if not qk_norm_rope_fits(d, cos.shape[1], width) or any(wd is None for wd in words):
        raise ValueError(f"qk_norm_rope: heads {tuple(x.shape)} with {cos.shape[1]} rotary pairs do not fit "
                         f"{width}-element words")
    team, per = _qk_geometry(d, width)
    group = qk_group(heads, group)
    grid = -(-(tokens * -(-heads // group)) // (BLOCK // team))
    kernel = _qk_norm_rope(control, team, per, width, group)
    kernel[grid, BLOCK, stream](words[0], w, w if w2 is None else w2, split, cos, sin, words[1], words[2],
                                np.float32(eps))


def qk_norm_rope_reference(x, w, cos, sin, eps):
    x = np.asarray(x, np.float64)
    n = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
    r = cos.shape[1]
    c, s = np.asarray(cos, np.float64)[:, None, :], np.asarray(sin, np.float64)[:, None, :]
    a, b = n[..., :r], n[..., r:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1), n


# --- SiTU-GLU -------------------------------------------------------------------------------
# The special-function unit's instructions (one MUFU op each): tanh.approx.f32 within TANH_APPROX relative of
# tanh over the whole range (PTX ISA, "tanh"), ex2.approx.ftz.f32 and rcp.approx.ftz.f32 within 2^-22 (ex2's
# argument x log2(e) adds |x| 2^-24, under 2^-17 where the sigmoid is not 0 or 1 in float32). libdevice's
# tanhf and an IEEE division made SiTU compute-bound at 3-4x its memory time. The simulator cannot run inline
# PTX: there they are the exact functions, so CI checks the kernels' arithmetic and the GPU contract the
# instructions (its gate allows TANH_APPROX twice).
TANH_APPROX = 2.0 ** -10.987
LOG2E = 1.4426950408889634


def _unary_ptx(text, doc):
    from numba import types
    return ptx_op(text, types.float32, types.float32, "=f,f", doc)


if SIMULATED:
    @jit(device=True)
    def fast_tanh(x):
        return math.tanh(x)

    @jit(device=True)
    def fast_sigmoid(x):
        return float32(1.0) / (float32(1.0) + math.exp(-x))
else:
    _tanh_ptx = _unary_ptx("tanh.approx.f32 $0, $1;", "tanh(x), one MUFU.TANH")
    _ex2_ptx = _unary_ptx("ex2.approx.ftz.f32 $0, $1;", "2^x, one MUFU.EX2")
    _rcp_ptx = _unary_ptx("rcp.approx.ftz.f32 $0, $1;", "1 / x, one MUFU.RCP")

    @jit(device=True, forceinline=True)
    def fast_tanh(x):
        return _tanh_ptx(x)

    @jit(device=True, forceinline=True)
    def fast_sigmoid(x):
        """1 / (1 + 2^(-x log2 e)): 0 past x = -128 log(2) (2^x is inf), 1 past +128 log(2) (ftz)."""
        return _rcp_ptx(float32(1.0) + _ex2_ptx(x * float32(-LOG2E)))


@jit(device=True, forceinline=True)
def _situ_one(h, g, control):
    a = float32(4.0) * fast_tanh(g * float32(0.25))
    if not control:
        a = a * fast_sigmoid(g)
    return narrow(a * (float32(25.0) * fast_tanh(h * float32(0.04))))


@functools.cache
def _situ(control):
    @jit
    def situ(hidden, gate, out):
        rows, cols = out.shape
        for r in range(cuda.blockIdx.x, rows, cuda.gridDim.x):      # a block per row: no index division
            ro = uint64(r)
            for c in range(cuda.threadIdx.x, cols, cuda.blockDim.x):
                co = uint64(c)
                out[ro, co] = _situ_one(widen(hidden[ro, co]), widen(gate[ro, co]), control)
    return situ


SITU_WORDS = 4      # words of each operand a thread loads before it stores any result


@functools.cache
def _situ_packed(control):
    """Four bf16 of each operand in one 8-byte word (elementwise._words), four results stored as one. A
    thread loads SITU_WORDS words of each operand (a block's width apart) before its first store: a store
    between them would hold back the loads the compiler cannot tell apart from it."""
    @jit
    def situ_packed(hidden, gate, out):
        hs, gs = cuda.local.array(SITU_WORDS, uint64), cuda.local.array(SITU_WORDS, uint64)
        rows, cols = out.shape
        step = cuda.blockDim.x
        for r in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            ro = uint64(r)
            for c0 in range(cuda.threadIdx.x, cols, step * SITU_WORDS):
                for m in range(SITU_WORDS):
                    c = c0 + m * step
                    if c < cols:
                        hs[m], gs[m] = hidden[ro, uint64(c)], gate[ro, uint64(c)]
                for m in range(SITU_WORDS):
                    c = c0 + m * step
                    if c < cols:
                        wh, wg = hs[m], gs[m]
                        word = uint64(0)
                        for e in range(4):
                            sh = uint64(16 * e)
                            h = widen(uint16((wh >> sh) & uint64(0xFFFF)))
                            g = widen(uint16((wg >> sh) & uint64(0xFFFF)))
                            word |= uint64(_situ_one(h, g, control)) << sh
                        out[ro, uint64(c)] = word
    return situ_packed


def situ(hidden, gate, out, stream=0, control=False):
    """out = (4 tanh(g / 4) sigmoid(g)) (25 tanh(h / 25)), bf16 bits in (any strides) and out [L, F]; 8-byte
    words where the rows allow (elementwise._words). Control: the sigmoid factor left out."""
    rows = out.shape[0]
    grid = max(1, min(rows, 2 if SIMULATED else 16384))
    words = [_words(a) for a in (hidden, gate, out)]
    if all(w is not None for w in words):
        _situ_packed(control)[grid, BLOCK, stream](*words)
    else:
        _situ(control)[grid, BLOCK, stream](hidden, gate, out)


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


def _run_norm_modulate(inp, control, residual, width=None):
    """The pair form at the case's even width; `width` (odd) cuts the rows there for the element form."""
    cut = (lambda a: np.ascontiguousarray(a[..., :width])) if width else (lambda a: a)
    x = cuda.to_device(cut(inp["x"]))
    w, shift, scale, gate, u = (cuda.to_device(cut(inp[k])) for k in ("w", "shift", "scale", "gate", "u"))
    out = cuda.device_array(x.shape, np.uint16)
    if residual:
        norm_modulate(x, w, shift, scale, out, inp["eps"], u=u, gate=gate, control=control)
        return np.concatenate([x.copy_to_host().astype(np.float64), from_bf16_bits(out.copy_to_host())])
    norm_modulate(x, w, shift, scale, out, inp["eps"], control=control)
    return from_bf16_bits(out.copy_to_host())


def _ref_norm_modulate(inp, residual, width=None):
    if width:
        inp = {k: (v[..., :width] if isinstance(v, np.ndarray) else v) for k, v in inp.items()}
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
            "w2": (1 + rng.standard_normal(d) * 0.2).astype(np.float32),
            "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32), "eps": 1e-6}


def _run_qk(inp, control, width=2):
    """The q and k heads as the fused qkv product leaves them: the first 2H heads of a [L, 3H, d] matrix."""
    wide = cuda.to_device(inp["wide"])
    heads = inp["heads"]
    x = wide[:, :2 * heads, :]
    out, out2 = (cuda.device_array((x.shape[0], heads, x.shape[2]), np.uint16) for _ in range(2))
    w, w2, cos, sin = (cuda.to_device(inp[k]) for k in ("w", "w2", "cos", "sin"))
    qk_norm_rope(x, w, cos, sin, out, inp["eps"], w2=w2, out2=out2, control=control, width=width)
    return from_bf16_bits(np.concatenate([out.copy_to_host(), out2.copy_to_host()], axis=1))


def _ref_qk(inp):
    x = from_bf16_bits(inp["wide"])[:, :2 * inp["heads"], :]
    split = inp["heads"]
    w = np.where(np.arange(x.shape[1])[:, None] < split, inp["w"][None, :], inp["w2"][None, :])
    ref, n = qk_norm_rope_reference(x, w, inp["cos"], inp["sin"], inp["eps"])
    r = inp["cos"].shape[1]
    c, s = np.abs(inp["cos"]).astype(np.float64)[:, None, :], np.abs(inp["sin"]).astype(np.float64)[:, None, :]
    a, b = np.abs(n[..., :r]), np.abs(n[..., r:])
    mag = np.concatenate([a * c + b * s, b * c + a * s], axis=-1)
    return ref, bf16_bound(0.5 * gamma(x.shape[2]) + 9 * EPS32) * np.maximum(mag, np.abs(ref)) + 1e-30


def _make_situ(rng, size):
    rows, f = (4, 168) if size == "tiny" else (4396, 8192)    # tiny: 42 words a row, some threads two
    both = rng.standard_normal((rows, 2 * f)) * 4
    both[0, :4] = [60.0, -60.0, 200.0, -200.0]    # saturated tanh / sigmoid
    both[1, :6] = [0.1, -0.2, 0.24, -0.26, 1e-3, -3e-4]   # small arguments, where tanh is nearly linear
    return {"both": to_bf16_bits(both), "f": f}


def _run_situ(inp, control):
    """The packed form (halves of one product, as the DiT's up_gate) and the element form (odd offsets)."""
    both = cuda.to_device(inp["both"])
    f = inp["f"]
    outs = []
    for h, g in ((both[:, :f], both[:, f:]), (both[:, 1:f], both[:, f + 1:])):
        out = cuda.device_array(h.shape, np.uint16)
        situ(h, g, out, control=control)
        outs.append(from_bf16_bits(out.copy_to_host()).reshape(-1))
    return np.concatenate(outs)


def _ref_situ(inp):
    both, f = from_bf16_bits(inp["both"]), inp["f"]
    ref = np.concatenate([situ_reference(both[:, :f], both[:, f:]).reshape(-1),
                          situ_reference(both[:, 1:f], both[:, f + 1:]).reshape(-1)])
    # two tanh.approx, then exp, the reciprocal and the products a few ulp each (g / 4 and h / 25 exact to a
    # ulp: x 0.04 is not a power of two), then the bf16 rounding
    return ref, bf16_bound(2 * TANH_APPROX + 2.0 ** -17 + 16 * EPS32) * np.abs(ref) + 1e-30


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
    Case("norm_modulate_odd", _make_rows(64, 3071), lambda i, c: _run_norm_modulate(i, c, True, 31 if i["x"].shape[1] == 32 else 3071),
         lambda i: _ref_norm_modulate(i, True, 31 if i["x"].shape[1] == 32 else 3071),
         notes="the element form (odd rows); control: the residual added without its gate"),
    Case("qk_norm_rope", _make_qk, _run_qk, _ref_qk, notes="q/k heads of the fused qkv product; control: sin negated"),
    Case("qk_norm_rope_words8", _make_qk, lambda i, c: _run_qk(i, c, 4), _ref_qk,
         notes="the same on 8-byte words (4 bf16); control: sin negated"),
    Case("widen_heads", _make_qk, _run_widen, _ref_widen, notes="exact; control: each head read reversed"),
    Case("situ", _make_situ, _run_situ, _ref_situ, notes="control: the gate's sigmoid factor left out"),
    Case("patchify", _make_latents, _run_patchify, _ref_patchify, notes="control: the transpose forgotten"),
    Case("cfg_euler", _make_latents, _run_cfg_euler, _ref_cfg_euler, notes="control: c + g (c - u)"),
]
