"""Flash attention, forward: softmax(scale q k^T) v per head without a scores buffer, its two products on bf16
tensor cores (mma.mma_bf16, float32 accumulators) and an online softmax in float32 (FlashAttention-2).

Two kernels. The pre-pass (`_make_prep`) reads q, k, v once (float32, any strides) and writes them rounded
to bf16 into a workspace (workspace_shapes) in head-major layouts of 32-bit words (bf16 pairs), rows zero-
padded to a multiple of PREP_ROWS tokens: Q [H, Lp, dp / 2], K [Hkv, Lp, dp / 2] and V^T [Hkv, dp, Lp / 2]
(word (dim, j) holds keys 2j, 2j + 1: each B register of O += P V is one 32-bit shared load); V goes through
a shared tile so both its reads and its writes are coalesced.

The attention kernel: one block per (block of BM query rows, head). Each warp owns 16 query rows; past
SPLIT_FROM head dims two warps share the same 16 rows and split d (each its half of O, <= 64 accumulators
a thread, and its half of S = Q K^T's contraction, the two partials summed through shared memory in one
fixed order so both warps hold the same S). Every tile comes in by asynchronous 16-byte copies (mma.copy16,
no registers on the way, no bounds checks: the workspace is padded): Q once, K and V^T double-buffered, the
next key block's tiles in flight while the current one computes (one barrier per key block). Rows are
padded to a stride of 4 mod 8 words so fragment reads hit distinct banks. P goes from S's accumulators to
the A fragments of P V in registers (an m16n8 C tile pair is an m16n8k16 A tile). Causal: key blocks up to
the diagonal, the longest query blocks launched first.
"""

import math

import numpy as np
from numba import cuda, float32, uint32, uint64

from .core import EPS16, EPS32, SIMULATED, Case, allow_shared, from_bf16_bits, gamma, heads_view, jit, narrow, \
    team_max, team_sum, to_bf16_bits
from .mma import copy16, copy_wait, copy_commit, mma_bf16

BM = 16 if SIMULATED else 64           # query rows per block, 16 per warp (times the split)
SPLIT_FROM = 16 if SIMULATED else 128  # head dims past which two warps share 16 rows and split d
PREP_ROWS = 64                         # the workspace's rows are padded to a multiple of this (>= BM, keys a block)
PREP_THREADS = 32 if SIMULATED else 256
BATCH = 8                              # the pre-pass's loads per batch (then the stores)
NEG_INF = np.float32(-np.inf)


KEYS_WIDE = 64                         # keys a block past SPLIT_FROM (32: 125 KB of shared memory, 203 registers)


def geometry(d):
    """(split, padded d, keys per block, threads) for head dim d. GPU: 64 keys a block up to d = 128 (4 warps,
    87 KB of shared memory: two blocks an SM), KEYS_WIDE past it (8 warps, two per 16 rows; 64 keys: 203 KB,
    one block an SM)."""
    split = 2 if d > SPLIT_FROM else 1
    dp = -(-d // (16 * split)) * 16 * split
    bn = 16 if SIMULATED else (64 if d <= 128 else KEYS_WIDE)
    return split, dp, bn, 32 * (BM // 16) * split


def padded_rows(n):
    return -(-n // PREP_ROWS) * PREP_ROWS


def workspace_shapes(n, heads, kv_heads, d):
    """The bf16-pair (uint32) work arrays of one call, flat: Q [H, Lp, dp / 2], K [Hkv, Lp, dp / 2], V^T
    [Hkv, dp, Lp / 2]."""
    dp, lp = geometry(d)[1], padded_rows(n)
    return {"q": (heads * lp * dp // 2,), "k": (kv_heads * lp * dp // 2,), "v": (kv_heads * dp * lp // 2,)}


def shared_layout(dp, bn, split):
    """Word offsets (32-bit: bf16 pairs, or float32 partials of S) and row strides of the staged tiles:
    Q [BM, dp / 2], two buffers of K [bn, dp / 2] then V^T [dp, bn / 2] (buffer b at k + b * buf, its V^T
    at + vrel), and the split's S partials; and the word count."""
    qs, vs = dp // 2 + 4, bn // 2 + 4
    ok = BM * qs
    vrel = bn * qs
    buf = vrel + dp * vs
    ox = ok + 2 * buf
    return {"q": 0, "k": ok, "vrel": vrel, "buf": buf, "x": ox, "qs": qs, "vs": vs}, \
        ox + (BM * bn * split if split > 1 else 0)


@jit(device=True, forceinline=True)
def _pack(lo, hi):
    """Two float32 rounded to bf16 (nearest even) in one register, lo in the low half."""
    return uint32(narrow(lo)) | (uint32(narrow(hi)) << uint32(16))


def _make_prep(dp):
    """The pre-pass for padded head dim dp: block (token tile of PREP_ROWS rows, slot), slots the H query heads,
    then the Hkv key heads, then the Hkv value heads."""
    u = uint64
    half, threads, rows = dp // 2, PREP_THREADS, PREP_ROWS
    per_row = -(-(rows * half) // threads)          # words a thread per tile of Q or K
    tw = 33                                         # the V tile's row stride (floats)
    per_vl, per_vs = -(-(rows * 32) // threads), -(-(32 * rows // 2) // threads)
    pairs, tile_n = 2 * BATCH, rows * tw            # local and shared array sizes (constants)

    @jit(device=True, forceinline=True)
    def rows_of(x, hh, dst, t0, n, d, lp, tid):
        vals = cuda.local.array(pairs, float32)
        for b in range(0, per_row, BATCH):
            for e in range(BATCH):
                idx = u(tid) + u((b + e) * threads)
                r, w = idx // u(half), idx % u(half)
                live = b + e < per_row and idx < u(rows * half) and u(t0) + r < u(n) and u(2) * w < u(d)
                vals[2 * e] = x[u(t0) + r, u(hh), u(2) * w] if live else float32(0.0)
                vals[2 * e + 1] = x[u(t0) + r, u(hh), u(2) * w + u(1)] if live else float32(0.0)
            for e in range(BATCH):
                idx = u(tid) + u((b + e) * threads)
                if b + e < per_row and idx < u(rows * half):
                    r, w = idx // u(half), idx % u(half)
                    dst[(u(hh) * u(lp) + u(t0) + r) * u(half) + w] = _pack(vals[2 * e], vals[2 * e + 1])

    @jit(launch_bounds=(threads, 2))
    def prep(q, k, v, qw, kw, vt):
        n, heads, d = q.shape[0], q.shape[1], q.shape[2]
        hkv = k.shape[1]
        lp = (n + rows - 1) // rows * rows
        t0 = cuda.blockIdx.x * rows
        slot = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        if slot < heads:
            rows_of(q, slot, qw, t0, n, d, lp, tid)
        elif slot < heads + hkv:
            rows_of(k, slot - heads, kw, t0, n, d, lp, tid)
        else:
            hh = u(slot - heads - hkv)
            tile = cuda.shared.array(tile_n, float32)
            vals = cuda.local.array(BATCH, float32)
            for dc in range(0, dp, 32):         # 32 dims at a time: rows x 32 floats in, 32 x rows / 2 words out
                cuda.syncthreads()
                for b in range(0, per_vl, BATCH):
                    for e in range(BATCH):
                        idx = u(tid) + u((b + e) * threads)
                        key, dim = idx // u(32), idx % u(32)
                        live = b + e < per_vl and u(t0) + key < u(n) and u(dc) + dim < u(d)
                        vals[e] = v[u(t0) + key, hh, u(dc) + dim] if live else float32(0.0)
                    for e in range(BATCH):
                        idx = u(tid) + u((b + e) * threads)
                        if b + e < per_vl:
                            tile[(idx // u(32)) * u(tw) + idx % u(32)] = vals[e]
                cuda.syncthreads()
                for e in range(per_vs):
                    idx = u(tid) + u(e * threads)
                    dim, j = idx // u(rows // 2), idx % u(rows // 2)
                    if u(dc) + dim < u(dp):
                        vt[(hh * u(dp) + u(dc) + dim) * u(lp // 2) + u(t0 // 2) + j] = _pack(
                            tile[u(2) * j * u(tw) + dim], tile[(u(2) * j + u(1)) * u(tw) + dim])
    return prep


def _make_flash(dp, split, bn, causal, control):
    """The kernel for padded head dim dp. control: O's rescale by the running max left out (l keeps it)."""
    u = uint64
    rw = BM // 16                          # warps along the query rows
    threads = 32 * rw * split
    dw = dp // split                       # O's columns (and S's contraction) per warp
    ks, nt_s, nt_o = dw // 16, bn // 8, dw // 8
    lay, _ = shared_layout(dp, bn, split)
    ok, vrel, buf, ox, qs, vs = (lay[x] for x in ("k", "vrel", "buf", "x", "qs", "vs"))
    half = dp // 2
    cq = half // 4                         # 16-byte chunks a row of Q or K
    cv = bn // 8                           # ... a row of V^T
    per_q, per_k, per_v = -(-(BM * cq) // threads), -(-(bn * cq) // threads), -(-(dp * cv) // threads)
    red = threads if SIMULATED else 1       # team_max's shared floats (the simulator has no shuffles)
    s_regs, o_regs = 4 * nt_s, 4 * nt_o     # local array sizes (constants)

    @jit(device=True, forceinline=True)
    def stage_kv(sh, kw, vt, at, hk, k0, lp, tid):
        """Copies (asynchronous) of key rows k0.. of K and their columns of V^T into the buffer at `at`."""
        kb = (u(hk) * u(lp) + u(k0)) * u(half)
        for e in range(per_k):
            idx = u(tid) + u(e * threads)
            if (bn * cq) % threads == 0 or idx < u(bn * cq):
                r, c = idx // u(cq), u(4) * (idx % u(cq))
                copy16(sh, u(at) + r * u(qs) + c, kw, kb + r * u(half) + c, True)
        vb = u(hk) * u(dp) * u(lp // 2) + u(k0 // 2)
        for e in range(per_v):
            idx = u(tid) + u(e * threads)
            if (dp * cv) % threads == 0 or idx < u(dp * cv):
                r, c = idx // u(cv), u(4) * (idx % u(cv))
                copy16(sh, u(at) + u(vrel) + r * u(vs) + c, vt, vb + r * u(lp // 2) + c, True)

    @jit(launch_bounds=(threads, 1 if split > 1 else 2))
    def flash(qw, kw, vt, out, group, scale):
        n, heads, d = out.shape[0], out.shape[1], out.shape[2]
        lp = (n + PREP_ROWS - 1) // PREP_ROWS * PREP_ROWS
        h = cuda.blockIdx.y
        hk = h // group
        blocks = (n + BM - 1) // BM
        q0 = (blocks - 1 - cuda.blockIdx.x) * BM       # the longest causal rows first
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        row, quad = lane // 4, lane % 4
        r16, hw = warp % rw, warp // rw              # the warp's 16 rows and its half of d
        sh = cuda.shared.array(0, uint32)
        shf = cuda.shared.array(0, float32)         # the same memory, as float32 (S partials)
        shr = cuda.shared.array(red, float32)
        s = cuda.local.array(s_regs, float32)
        o = cuda.local.array(o_regs, float32)
        kend = min(n, q0 + BM) if causal else n
        qb = (u(h) * u(lp) + u(q0)) * u(half)
        for e in range(per_q):                      # Q, then the first key block: one group
            idx = u(tid) + u(e * threads)
            if (BM * cq) % threads == 0 or idx < u(BM * cq):
                r, c = idx // u(cq), u(4) * (idx % u(cq))
                copy16(sh, r * u(qs) + c, qw, qb + r * u(half) + c, True)
        stage_kv(sh, kw, vt, ok, hk, 0, lp, tid)
        copy_commit()
        for e in range(4 * nt_o):
            o[e] = float32(0.0)
        m0, m1 = NEG_INF, NEG_INF                   # running maxima of the lane's rows row and row + 8
        l0, l1 = float32(0.0), float32(0.0)        # the lane's partial row sums (its quad's keys)
        i0 = q0 + 16 * r16 + row                   # the lane's first query row
        qa = u(16 * r16 + row) * u(qs) + u(hw * dw // 2) + u(quad)
        xo = u(ox) + u(warp * 16 * bn) + u(lane)                 # this warp's S partial
        xp = u(ox) + u(((1 - hw) * rw + r16) * 16 * bn) + u(lane)   # its partner's
        for k0 in range(0, kend, bn):
            cur = u(ok) + u((k0 // bn) % 2) * u(buf)
            copy_wait()                             # this block's tiles (the only group in flight)
            cuda.syncthreads()                      # ... seen by all; the other buffer's last reads done
            if k0 + bn < kend:                      # the next block's tiles land while this one computes
                stage_kv(sh, kw, vt, u(ok) + u((k0 // bn + 1) % 2) * u(buf), hk, k0 + bn, lp, tid)
                copy_commit()
            kb = cur + u(row) * u(qs) + u(hw * dw // 2) + u(quad)
            vb = cur + u(vrel) + u(hw * dw + row) * u(vs) + u(quad)
            for e in range(4 * nt_s):
                s[e] = float32(0.0)
            for kk in range(ks):                    # S = Q K^T over the warp's dims
                a = qa + u(8 * kk)
                a0, a1, a2, a3 = sh[a], sh[a + u(8 * qs)], sh[a + u(4)], sh[a + u(8 * qs + 4)]
                for nt in range(nt_s):
                    b = kb + u(nt * 8 * qs + 8 * kk)
                    s[4 * nt], s[4 * nt + 1], s[4 * nt + 2], s[4 * nt + 3] = mma_bf16(
                        a0, a1, a2, a3, sh[b], sh[b + u(4)], s[4 * nt], s[4 * nt + 1], s[4 * nt + 2], s[4 * nt + 3])
            if split > 1:                           # the partner's partial, summed low half first
                for e in range(4 * nt_s):
                    shf[xo + u(32 * e)] = s[e]
                cuda.syncthreads()
                for e in range(4 * nt_s):
                    other = shf[xp + u(32 * e)]
                    s[e] = s[e] + other if hw == 0 else other + s[e]
            for e in range(4 * nt_s):
                s[e] = s[e] * scale
            if k0 + bn > n or (causal and k0 + bn - 1 > q0 + 16 * r16):     # keys past n or the diagonal
                for nt in range(nt_s):
                    for e in range(4):
                        j = k0 + 8 * nt + 2 * quad + e % 2
                        if j >= n or (causal and j > i0 + 8 * (e // 2)):
                            s[4 * nt + e] = NEG_INF
            x0, x1 = NEG_INF, NEG_INF
            for nt in range(nt_s):
                x0 = max(x0, max(s[4 * nt], s[4 * nt + 1]))
                x1 = max(x1, max(s[4 * nt + 2], s[4 * nt + 3]))
            x0 = max(m0, team_max(shr, x0, 4))
            x1 = max(m1, team_max(shr, x1, 4))
            base0 = x0 if x0 != NEG_INF else float32(0.0)      # a row with no key yet: exp(-inf) = 0
            base1 = x1 if x1 != NEG_INF else float32(0.0)
            alpha0, alpha1 = float32(math.exp(m0 - base0)), float32(math.exp(m1 - base1))
            m0, m1 = x0, x1
            l0, l1 = l0 * alpha0, l1 * alpha1
            for nt in range(nt_s):
                s[4 * nt] = float32(math.exp(s[4 * nt] - base0))
                s[4 * nt + 1] = float32(math.exp(s[4 * nt + 1] - base0))
                s[4 * nt + 2] = float32(math.exp(s[4 * nt + 2] - base1))
                s[4 * nt + 3] = float32(math.exp(s[4 * nt + 3] - base1))
                l0 += s[4 * nt] + s[4 * nt + 1]
                l1 += s[4 * nt + 2] + s[4 * nt + 3]
            if not control:
                for nt in range(nt_o):
                    o[4 * nt], o[4 * nt + 1] = o[4 * nt] * alpha0, o[4 * nt + 1] * alpha0
                    o[4 * nt + 2], o[4 * nt + 3] = o[4 * nt + 2] * alpha1, o[4 * nt + 3] * alpha1
            for kk in range(bn // 16):              # O += P V, P rounded to bf16
                p0, p1 = _pack(s[8 * kk], s[8 * kk + 1]), _pack(s[8 * kk + 2], s[8 * kk + 3])
                p2, p3 = _pack(s[8 * kk + 4], s[8 * kk + 5]), _pack(s[8 * kk + 6], s[8 * kk + 7])
                for nt in range(nt_o):
                    b = vb + u(nt * 8 * vs + 8 * kk)
                    o[4 * nt], o[4 * nt + 1], o[4 * nt + 2], o[4 * nt + 3] = mma_bf16(
                        p0, p1, p2, p3, sh[b], sh[b + u(4)], o[4 * nt], o[4 * nt + 1], o[4 * nt + 2], o[4 * nt + 3])
        l0, l1 = team_sum(shr, l0, 4), team_sum(shr, l1, 4)
        c0 = u(hw * dw + 2 * quad)
        for nt in range(nt_o):
            c = c0 + u(8 * nt)
            if c < u(d):
                if i0 < n:
                    out[u(i0), u(h), c] = o[4 * nt] / l0
                    out[u(i0), u(h), c + u(1)] = o[4 * nt + 1] / l0
                if i0 + 8 < n:
                    out[u(i0 + 8), u(h), c] = o[4 * nt + 2] / l1
                    out[u(i0 + 8), u(h), c + u(1)] = o[4 * nt + 3] / l1
    return flash


_kernels, _preps = {}, {}


def kernel(d, causal, control=False):
    """The compiled-on-demand kernel for head dim d, and its (threads, shared bytes)."""
    split, dp, bn, threads = geometry(d)
    key = (dp, split, bn, bool(causal), bool(control))
    if key not in _kernels:
        _kernels[key] = _make_flash(*key)
    return _kernels[key], threads, 4 * shared_layout(dp, bn, split)[1]


def prep_kernel(d):
    """The compiled-on-demand pre-pass for head dim d."""
    dp = geometry(d)[1]
    if dp not in _preps:
        _preps[dp] = _make_prep(dp)
    return _preps[dp]


def flash_attention(q, k, v, out, scale, causal, stream=0, control=False, work=None):
    """out [L, H, d] = softmax(scale q k^T) v per head (causal: key j <= query i), query head h reading kv head
    h // (H / Hkv). q [L, H, d], k and v [L, Hkv, d] float32 of any strides; out float32; d a multiple of 16 up
    to 256. q, k, v and the probabilities enter the products as bf16; everything else is float32. work: the
    uint32 arrays of workspace_shapes (allocated here when None). control: O's rescale by the running max
    left out."""
    n, heads, d = q.shape
    if d % 16 or d > 256 or k.shape != v.shape or k.shape[0] != n or k.shape[2] != d or heads % k.shape[1] \
            or out.shape != q.shape:
        raise ValueError(f"flash_attention: q {q.shape}, k {k.shape}, v {v.shape}, out {out.shape}: d must be a "
                         "multiple of 16 up to 256, k and v [L, Hkv, d] with Hkv dividing H")
    if n == 0:
        return
    hkv = k.shape[1]
    if work is None:
        work = {name: cuda.device_array(shape, np.uint32) for name, shape in
                workspace_shapes(n, heads, hkv, d).items()}
    prep_kernel(d)[(padded_rows(n) // PREP_ROWS, heads + 2 * hkv), PREP_THREADS, stream](
        q, k, v, work["q"], work["k"], work["v"])
    fn, threads, nbytes = kernel(d, causal, control)
    args = (work["q"], work["k"], work["v"], out, heads // hkv, np.float32(scale))
    allow_shared(fn, args, nbytes)
    fn[(-(-n // BM), heads), threads, stream, nbytes](*args)


# --- float64 reference and the gate --------------------------------------------------------------------
def _round(x):
    return from_bf16_bits(to_bf16_bits(x))


def flash_reference(q, k, v, scale, causal):
    """Exact softmax attention (float64) of q, k, v rounded to bf16, the kernel's inputs; returns (out [L, H, d],
    the scores x = scale q k^T [H, L, L] with -inf where masked, the probabilities p [H, L, L])."""
    group = q.shape[1] // k.shape[1]
    qr = _round(q).transpose(1, 0, 2)
    kr = np.repeat(_round(k), group, axis=1).transpose(1, 2, 0)
    vr = np.repeat(_round(v), group, axis=1).transpose(1, 0, 2)
    x = scale * (qr @ kr)
    n = q.shape[0]
    if causal:
        x = np.where(np.tril(np.ones((n, n), bool)), x, -np.inf)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ vr).transpose(1, 0, 2), x, p


def flash_bound(q, k, v, scale, causal, x, p, bn):
    """The gate of flash_attention against flash_reference, first order in the roundings, relative to the
    probabilities p_j of the exact output O = sum_j p_j v_j (v as bf16: exact in the products).
    Each unnormalised probability the kernel forms, e^(x_j - m) times the rescales of later key blocks, carries
      delta_j = scale 2 gamma_(d+1) sum_k |q_k k_k|  (bf16 products exact, float32 sums in the tensor cores'
                                                     unknown order, x2, and the split's one added partial)
              + EPS32 |x_j| (the scale) + 2 EPS32 (|x_j| + max |x|) (the exponent x_j - m: m is within the row)
              + 4 EPS32 (exp, 2 ulp) + 2 nb EPS32 (one product by the rescale alpha per key block, nb of them:
                alpha's own error multiplies O and l alike and cancels in O / l);
    P V reads it rounded to bf16 (EPS16) and sums into O in float32 over L keys (2 gamma_L); l sums the float32
    probabilities (gamma_L) and divides O once (EPS32). So, with a = sum_j p_j |v_j|,
      |O~ - O| <= sum_j p_j (delta_j + EPS16 + 2 gamma_L) |v_j| + (max_j delta_j + gamma_L + EPS32) a."""
    group = q.shape[1] // k.shape[1]
    n, d = q.shape[0], q.shape[2]
    qa = np.abs(_round(q)).transpose(1, 0, 2)
    ka = np.repeat(np.abs(_round(k)), group, axis=1).transpose(1, 2, 0)
    va = np.repeat(np.abs(_round(v)), group, axis=1).transpose(1, 0, 2)
    ax = np.where(np.isfinite(x), np.abs(x), 0.0)
    nb = -(-n // bn)
    delta = (scale * 2 * gamma(d + 1) * (qa @ ka) + EPS32 * ax + 2 * EPS32 * (ax + ax.max(axis=-1, keepdims=True))
             + (4 + 2 * nb) * EPS32)
    delta = np.where(p > 0, delta, 0.0)
    a = p @ va
    bound = (p * (delta + EPS16 + 2 * gamma(n))) @ va + (delta.max(axis=-1, keepdims=True) + gamma(n) + EPS32) * a
    return bound.transpose(1, 0, 2) + 1e-30


# --- contract ----------------------------------------------------------------------------------------
def _make(causal):
    def make(rng, size):
        if causal:
            n, hq, hk, d = (24, 4, 2, 32) if size == "tiny" else (1000, 16, 4, 256)
        else:
            n, hq, hk, d = (20, 2, 2, 16) if size == "tiny" else (4352, 8, 8, 128)
        return {"q": rng.standard_normal((n, hq, d)).astype(np.float32),
                "k": (rng.standard_normal((n, hk, d)) * 2).astype(np.float32),
                "v": rng.standard_normal((n, hk, d)).astype(np.float32), "scale": d ** -0.5, "causal": causal}
    return make


def _run(inp, control):
    """q a column block of [L, H 2d] (query | gate, as the encoder's q_proj leaves it), k and v column blocks of
    one [L, 2 Hkv d] matrix."""
    n, hq, d = inp["q"].shape
    hk = inp["k"].shape[1]
    qg = cuda.to_device(np.concatenate([inp["q"], np.zeros_like(inp["q"])], axis=2).reshape(n, 2 * hq * d))
    q = heads_view(qg, 0, hq, 2 * d)[:, :, :d]
    kv = cuda.to_device(np.concatenate([inp["k"].reshape(n, -1), inp["v"].reshape(n, -1)], axis=1))
    k, v = heads_view(kv, 0, hk, d), heads_view(kv, hk * d, hk, d)
    out = cuda.device_array((n, hq, d), np.float32)
    flash_attention(q, k, v, out, inp["scale"], inp["causal"], control=control)
    cuda.synchronize()
    return out.copy_to_host()


def _ref(inp):
    q, k, v, scale, causal = (inp[x] for x in ("q", "k", "v", "scale", "causal"))
    out, x, p = flash_reference(q, k, v, scale, causal)
    return out, flash_bound(q, k, v, scale, causal, x, p, geometry(q.shape[2])[2])


CASES = [
    Case("flash_attention", _make(True), _run, _ref,
         notes="causal GQA (tiny: d = 32, split between two warps); control: O not rescaled by the running max"),
    Case("flash_attention_full", _make(False), _run, _ref,
         notes="not causal, H = Hkv (tiny: d = 16, L past one key block); control: O not rescaled"),
]
