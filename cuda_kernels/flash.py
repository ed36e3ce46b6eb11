"""Flash attention, forward: softmax(scale q k^T) v per head without a scores buffer, its two products on bf16
tensor cores (mma.mma_bf16, float32 accumulators) and an online softmax in float32 (FlashAttention-2).

One block per (block of BM query rows, head). Each warp owns 16 query rows; past SPLIT_FROM head dims two
warps share the same 16 rows and split d (each its half of O, <= 64 accumulators a thread, and its half of
S = Q K^T's contraction, the two partials summed through shared memory in one fixed order so both warps
hold the same S). Q is staged once, K and V per block of BN keys, all rounded to bf16 on the way into
shared memory (the inputs are float32 of any strides, so no cp.async: each thread issues a batch of
global loads, then narrows and stores them). Rows are padded to a stride of 4 mod 8 words so fragment
reads hit distinct banks; V is staged transposed (V^T rows of key pairs), so each B register of O += P V
is one 32-bit shared load. P goes from S's accumulators to the A fragments of P V in registers (an
m16n8 C tile pair is an m16n8k16 A tile). Causal: key blocks up to the diagonal, the longest query blocks
launched first.
"""

import math

import numpy as np
from numba import cuda, float32, uint32, uint64

from .core import EPS16, EPS32, SIMULATED, Case, allow_shared, from_bf16_bits, gamma, heads_view, jit, narrow, \
    team_max, team_sum, to_bf16_bits
from .mma import mma_bf16

BM = 16 if SIMULATED else 64           # query rows per block, 16 per warp (times the split)
SPLIT_FROM = 16 if SIMULATED else 128  # head dims past which two warps share 16 rows and split d
BATCH = 8                              # staged words (bf16 pairs) per batch of global loads
NEG_INF = np.float32(-np.inf)


def geometry(d):
    """(split, padded d, keys per block, threads) for head dim d. GPU: 64 keys a block up to d = 128 (53 KB of
    shared memory, 4 warps; launch bounds of three blocks an SM), 32 past it (88 KB, 8 warps; one block an
    SM: its O, S and staging registers take more than the 128 a thread two blocks would leave)."""
    split = 2 if d > SPLIT_FROM else 1
    dp = -(-d // (16 * split)) * 16 * split
    bn = 16 if SIMULATED else (64 if d <= 128 else 32)
    return split, dp, bn, 32 * (BM // 16) * split


def shared_layout(dp, bn, split):
    """Word offsets (32-bit: bf16 pairs, or float32 partials of S) and row strides of the staged tiles:
    Q [BM, dp / 2], K [bn, dp / 2], V^T [dp, bn / 2], and the split's S partials; and the word count."""
    qs, vs = dp // 2 + 4, bn // 2 + 4
    oq, ok = 0, BM * qs
    ov = ok + bn * qs
    ox = ov + dp * vs
    return {"q": oq, "k": ok, "v": ov, "x": ox, "qs": qs, "vs": vs}, ox + (BM * bn * split if split > 1 else 0)


@jit(device=True, forceinline=True)
def _pack(lo, hi):
    """Two float32 rounded to bf16 (nearest even) in one register, lo in the low half."""
    return uint32(narrow(lo)) | (uint32(narrow(hi)) << uint32(16))


def _make_flash(dp, split, bn, causal, control):
    """The kernel for padded head dim dp. control: O's rescale by the running max left out (l keeps it)."""
    u = uint64
    rw = BM // 16                          # warps along the query rows
    threads = 32 * rw * split
    dw = dp // split                       # O's columns (and S's contraction) per warp
    ks, nt_s, nt_o = dw // 16, bn // 8, dw // 8
    lay, _ = shared_layout(dp, bn, split)
    oq, ok, ov, ox, qs, vs = (lay[x] for x in ("q", "k", "v", "x", "qs", "vs"))
    half_words = dp // 2
    per_qk = -(-(BM * half_words) // threads)      # Q words per thread (K: bn rows)
    per_k = -(-(bn * half_words) // threads)
    per_v = -(-(dp * bn // 2) // threads)
    red = threads if SIMULATED else 1       # team_max's shared floats (the simulator has no shuffles)
    pairs, s_regs, o_regs = 2 * BATCH, 4 * nt_s, 4 * nt_o     # local array sizes (constants)

    @jit(device=True, forceinline=True)
    def stage_rows(sh, at, x, t0, hh, n, d, rows, per, tid):
        """Rows t0.. of head hh of x (zeros past n and d) as bf16 pairs at sh[at + r qs + w]: a batch of
        global loads, then the stores."""
        vals = cuda.local.array(pairs, float32)
        for b in range(0, per, BATCH):
            for e in range(BATCH):
                idx = u(tid) + u((b + e) * threads)
                r, w = idx // u(half_words), idx % u(half_words)
                live = idx < u(rows * half_words) and u(t0) + r < u(n) and u(2) * w < u(d)
                vals[2 * e] = x[u(t0) + r, u(hh), u(2) * w] if live else float32(0.0)
                vals[2 * e + 1] = x[u(t0) + r, u(hh), u(2) * w + u(1)] if live else float32(0.0)
            for e in range(BATCH):
                idx = u(tid) + u((b + e) * threads)
                if idx < u(rows * half_words) and b + e < per:
                    r, w = idx // u(half_words), idx % u(half_words)
                    sh[u(at) + r * u(qs) + w] = _pack(vals[2 * e], vals[2 * e + 1])

    @jit(device=True, forceinline=True)
    def stage_vt(sh, v, t0, hh, n, d, tid):
        """V^T of keys t0.. of head hh: word (dim, j) holds keys t0 + 2j, t0 + 2j + 1; a warp covers 8 dims x
        4 key pairs (distinct banks: the row stride is 4 mod 8)."""
        vals = cuda.local.array(pairs, float32)
        lane, warp = u(tid % 32), u(tid // 32)
        for b in range(0, per_v, BATCH):
            for e in range(BATCH):
                g = warp + u((b + e) * (threads // 32))
                dim, j = (g % u(dp // 8)) * u(8) + lane % u(8), (g // u(dp // 8)) * u(4) + lane // u(8)
                key = u(t0) + u(2) * j
                live = j < u(bn // 2) and dim < u(d)
                vals[2 * e] = v[key, u(hh), dim] if live and key < u(n) else float32(0.0)
                vals[2 * e + 1] = v[key + u(1), u(hh), dim] if live and key + u(1) < u(n) else float32(0.0)
            for e in range(BATCH):
                g = warp + u((b + e) * (threads // 32))
                dim, j = (g % u(dp // 8)) * u(8) + lane % u(8), (g // u(dp // 8)) * u(4) + lane // u(8)
                if j < u(bn // 2) and b + e < per_v:
                    sh[u(ov) + dim * u(vs) + j] = _pack(vals[2 * e], vals[2 * e + 1])

    @jit(launch_bounds=(threads, 1 if split > 1 else 3))
    def flash(q, k, v, out, scale):
        n, heads, d = q.shape[0], q.shape[1], q.shape[2]
        h = cuda.blockIdx.y
        hk = h // (heads // k.shape[1])
        blocks = (n + BM - 1) // BM
        q0 = (blocks - 1 - cuda.blockIdx.x) * BM       # the longest causal rows first
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        row, quad = lane // 4, lane % 4
        r16, half = warp % rw, warp // rw            # the warp's 16 rows and its half of d
        sh = cuda.shared.array(0, uint32)
        shf = cuda.shared.array(0, float32)         # the same memory, as float32 (S partials)
        shr = cuda.shared.array(red, float32)
        s = cuda.local.array(s_regs, float32)
        o = cuda.local.array(o_regs, float32)
        for e in range(4 * nt_o):
            o[e] = float32(0.0)
        m0, m1 = NEG_INF, NEG_INF                   # running maxima of the lane's rows row and row + 8
        l0, l1 = float32(0.0), float32(0.0)        # the lane's partial row sums (its quad's keys)
        i0 = q0 + 16 * r16 + row                   # the lane's first query row
        stage_rows(sh, oq, q, q0, h, n, d, BM, per_qk, tid)
        qa = u(oq) + u(16 * r16 + row) * u(qs) + u(half * dw // 2) + u(quad)
        kb = u(ok) + u(row) * u(qs) + u(half * dw // 2) + u(quad)
        vb = u(ov) + u(half * dw + row) * u(vs) + u(quad)
        xo = u(ox) + u(warp * 16 * bn) + u(lane)                 # this warp's S partial
        xp = u(ox) + u(((1 - half) * rw + r16) * 16 * bn) + u(lane)   # its partner's
        kend = min(n, q0 + BM) if causal else n
        for k0 in range(0, kend, bn):
            cuda.syncthreads()                      # the last block's K, V and partials are read
            stage_rows(sh, ok, k, k0, hk, n, d, bn, per_k, tid)
            stage_vt(sh, v, k0, hk, n, d, tid)
            cuda.syncthreads()
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
                    s[e] = s[e] + other if half == 0 else other + s[e]
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
        c0 = u(half * dw + 2 * quad)
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


_kernels = {}


def kernel(d, causal, control=False):
    """The compiled-on-demand kernel for head dim d, and its (threads, shared bytes)."""
    split, dp, bn, threads = geometry(d)
    key = (dp, split, bn, bool(causal), bool(control))
    if key not in _kernels:
        _kernels[key] = _make_flash(*key)
    return _kernels[key], threads, 4 * shared_layout(dp, bn, split)[1]


def flash_attention(q, k, v, out, scale, causal, stream=0, control=False):
    """out [L, H, d] = softmax(scale q k^T) v per head (causal: key j <= query i), query head h reading kv head
    h // (H / Hkv). q [L, H, d], k and v [L, Hkv, d] float32 of any strides; out float32; d a multiple of 16 up
    to 256. q, k, v and the probabilities enter the products as bf16; everything else is float32.
    control: O's rescale by the running max left out."""
    n, heads, d = q.shape
    if d % 16 or d > 256 or k.shape != v.shape or k.shape[0] != n or k.shape[2] != d or heads % k.shape[1] \
            or out.shape != q.shape:
        raise ValueError(f"flash_attention: q {q.shape}, k {k.shape}, v {v.shape}, out {out.shape}: d must be a "
                         "multiple of 16 up to 256, k and v [L, Hkv, d] with Hkv dividing H")
    if n == 0:
        return
    fn, threads, nbytes = kernel(d, causal, control)
    args = (q, k, v, out, np.float32(scale))
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
