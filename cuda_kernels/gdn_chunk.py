"""The gated delta rule in chunks of CHUNK tokens (encoder.md 3.2), its products on tensor cores.

The same function as gdn.gated_delta_rule; the serial dependence is cut from one step per token to one
small product per chunk. Per value head and chunk, with G = cumsum(g) in the chunk and D_il = e^(G_i - G_l):
  A = strictly_lower(beta K K^T * D),  T = (I + A)^-1,  P = lower(Q K^T * D),  [U | W] = T [beta V | beta e^G K],
all of it in parallel over chunks (two kernels, prep and solve, and two strided-batched cuBLAS products on
TF32 tensor cores). Then the walk, serial over chunks, one block per (value head, block of WALK columns of
the state), its operands staged in shared memory, its products on TF32 mma.sync:
  D = U - W S,  O = e^G (Q S) + P D,  S <- e^(G_n) S + K^T (e^(G_n - G) D).
Buffers hold N + 1 chunk slots per head, the last one zero (the earlier chunk-map form's state walk needed it;
kept, unmeasured without it), so every batched product walks its operands with one stride.
"""

import math

import numpy as np
from numba import cuda, float32, uint64

from .core import SIMULATED, Case, allow_shared, gamma, jit
from .gdn import _make_delta_inputs, delta_reference_terms
from .gemm import EPS_TF32, OP_N, OP_T, blas
from .mma import copy16, copy_commit, copy_wait, copy_wait_prior, mma_tf32

CHUNK = 4 if SIMULATED else 64
ROW = CHUNK + 1                          # padded shared rows: a column walk then hits distinct banks
AREA = CHUNK * ROW
PARTS = 4                                # the triangular solve's threads: PARTS x CHUNK
THREADS = 32 if SIMULATED else 256       # prep (at least CHUNK and the key dim)
SUB = 2 if SIMULATED else 16             # rows of the triangular solve's diagonal blocks
# The walk: (state columns per block, a multiple of 8; threads per block, whole warps). One block per
# SM at the GPU default (its staged operands take ~180 KB of shared memory at dk = 128): 32 value heads x
# 4 column blocks fill the H200's 132 SMs once.
# A third element "strip" selects the register-blocked walk (_make_walk): each warp a 16 x 32 strip of
# four n tiles, one A fragment read per k step for four mma. It needs columns in 32s and an even warp count.
# The GPU default is the register-blocked strip walk: faster than the tile walk (32, 512) on the H200
# (scripts/gpu_bench_delta.py).
WALK = (16, 64) if SIMULATED else (32, 512, "strip")
WALK_STRIP = (32, 64, "strip") if SIMULATED else (32, 512, "strip")
VARIANTS = ("tile", "strip")
DK_MAX = 16 if SIMULATED else 128


def walk_variant(walk):
    """(columns, threads, variant) of a walk geometry: (cols, threads) is the tile variant."""
    cols, threads, *rest = walk
    return cols, threads, (rest[0] if rest else "tile")


def walk_name(walk):
    """A walk geometry as the benchmarks label it: "walk32x512", "walk32x512s" for the strip variant."""
    cols, threads, variant = walk_variant(walk)
    return "walk{}x{}{}".format(cols, threads, "s" if variant == "strip" else "")


# --- kernels -------------------------------------------------------------------------------------
def _make_prep(r):
    """Chunk-major operands, one block per (value head, chunk): the cumulative decays G by a parallel scan,
    then [beta V | beta e^G K] and, from heads whose index is a multiple of r (the value heads per key
    head), the key head's [Q; K] rows. Each thread takes one key (value) dim of four rows at a time, the
    rows' loads issued together before any store (a store may alias a later load, so a load written
    after a store waits for it: one memory latency per row)."""
    @jit(device=True, forceinline=True)
    def key_row(qk, rhs, bs, eg, hv, hk, c, dv, i, d, kv, qv):
        if i < CHUNK:
            rhs[hv, c, i, dv + d] = bs[i] * eg[i] * kv
            if hv % r == 0:
                qk[hk, c, i, d] = qv
                qk[hk, c, CHUNK + i, d] = kv

    @jit(device=True, forceinline=True)
    def four_rows(x, t0, i, rs, m, h, d):
        """x[t0 + i + j rs, h, d] for j = 0..3, zero for rows at or past m: all four loads issued at once."""
        f0 = float32(0.0)
        return (x[t0 + i, h, d] if i < m else f0, x[t0 + i + rs, h, d] if i + rs < m else f0,
                x[t0 + i + 2 * rs, h, d] if i + 2 * rs < m else f0, x[t0 + i + 3 * rs, h, d] if i + 3 * rs < m else f0)

    @jit
    def prep(q, k, v, g, beta, qk, rhs, gam):
        hv, c, tid, nt = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x, cuda.blockDim.x
        n, dk, dv = q.shape[0], q.shape[2], v.shape[2]
        hk = hv // r
        t0 = c * CHUNK
        m = max(0, min(CHUNK, n - t0))
        gs = cuda.shared.array(CHUNK, float32)
        bs = cuda.shared.array(CHUNK, float32)
        eg = cuda.shared.array(CHUNK, float32)
        if tid < CHUNK:
            gs[tid] = g[t0 + tid, hv] if tid < m else float32(0.0)
            bs[tid] = beta[t0 + tid, hv] if tid < m else float32(0.0)
        cuda.syncthreads()
        step = 1
        while step < CHUNK:                     # inclusive scan, Hillis-Steele
            add = gs[tid - step] if tid < CHUNK and tid >= step else float32(0.0)
            cuda.syncthreads()
            if tid < CHUNK:
                gs[tid] += add
            cuda.syncthreads()
            step *= 2
        if tid < CHUNK:
            eg[tid] = math.exp(gs[tid])
            gam[hv, c, tid] = gs[tid]
        cuda.syncthreads()
        rs = nt // dk
        if tid < rs * dk:
            d, i = tid % dk, tid // dk
            while i < CHUNK:
                i1, i2, i3 = i + rs, i + 2 * rs, i + 3 * rs
                k0, k1, k2, k3 = four_rows(k, t0, i, rs, m, hk, d)
                q0, q1, q2, q3 = four_rows(q, t0, i, rs, m, hk, d)
                key_row(qk, rhs, bs, eg, hv, hk, c, dv, i, d, k0, q0)
                key_row(qk, rhs, bs, eg, hv, hk, c, dv, i1, d, k1, q1)
                key_row(qk, rhs, bs, eg, hv, hk, c, dv, i2, d, k2, q2)
                key_row(qk, rhs, bs, eg, hv, hk, c, dv, i3, d, k3, q3)
                i += 4 * rs
        rs = nt // dv
        if tid < rs * dv:
            d, i = tid % dv, tid // dv
            while i < CHUNK:
                i1, i2, i3 = i + rs, i + 2 * rs, i + 3 * rs
                v0, v1, v2, v3 = four_rows(v, t0, i, rs, m, hv, d)
                rhs[hv, c, i, d] = bs[i] * v0
                if i1 < CHUNK:
                    rhs[hv, c, i1, d] = bs[i1] * v1
                if i2 < CHUNK:
                    rhs[hv, c, i2, d] = bs[i2] * v2
                if i3 < CHUNK:
                    rhs[hv, c, i3, d] = bs[i3] * v3
                i += 4 * rs
    return prep


def _make_solve(control, r):
    """T = (I + A)^-1 in diagonal blocks of SUB rows, and the decayed P (control: P without its decay
    factors). Each diagonal block's inverse is a forward substitution, one thread per column of it
    (nothing shared between threads); then block row by block row, T_ij = -T_ii sum_(j<=l<i) A_il T_lj
    for every j < i at once, each step one product over all threads."""
    nb = CHUNK // SUB
    sq, rs_size = SUB * SUB, SUB * ROW
    u = uint64

    @jit
    def solve(gram, gam, beta, t_out, p_out):
        hv, c, tid, nt = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x, cuda.blockDim.x
        n = beta.shape[0]
        hk = hv // r
        t0 = c * CHUNK
        m = max(0, min(CHUNK, n - t0))
        a = cuda.shared.array(AREA, float32)       # CHUNK rows of ROW floats
        x = cuda.shared.array(AREA, float32)
        rs = cuda.shared.array(rs_size, float32)  # the block row's sums sum_l A_il T_lj
        gs = cuda.shared.array(CHUNK, float32)
        bs = cuda.shared.array(CHUNK, float32)
        for i in range(tid, CHUNK, nt):
            gs[i] = gam[hv, c, i]
            bs[i] = beta[t0 + i, hv] if i < m else float32(0.0)
        cuda.syncthreads()
        # the grams into shared memory first (P staged in x), then P out: global loads written after a
        # global store would wait for it (the two may alias), shared stores do not hold them up
        for idx in range(tid, CHUNK * CHUNK, nt):
            i, l = idx // CHUNK, idx % CHUNK
            decay = math.exp(gs[i] - gs[l]) if l <= i else float32(0.0)
            a[i * ROW + l] = bs[i] * decay * gram[hk, c, CHUNK + i, l] if l < i else float32(0.0)
            qk = gram[hk, c, i, l]
            x[i * ROW + l] = (qk if l <= i else float32(0.0)) if control else decay * qk
        cuda.syncthreads()
        for idx in range(tid, CHUNK * CHUNK, nt):
            i, l = idx // CHUNK, idx % CHUNK
            p_out[hv, c, i, l] = x[i * ROW + l]
            x[i * ROW + l] = float32(0.0)
        cuda.syncthreads()
        # the diagonal blocks: column j of block b, rows in order (its own column only: no barrier)
        if tid < CHUNK:
            base, col = u(tid - tid % SUB), u(tid)
            for i in range(SUB):
                ri = base + u(i)
                s = float32(1.0) if ri == col else float32(0.0)
                for l in range(col - base, u(i)):
                    s -= a[ri * u(ROW) + base + u(l)] * x[(base + u(l)) * u(ROW) + col]
                x[ri * u(ROW) + col] = s
        cuda.syncthreads()
        # block rows below: R_ij = sum_(j<=l<i) A_il T_lj, then T_ij = -T_ii R_ij, for all j < i together
        for bi in range(1, nb):
            top = u(bi * SUB)
            for idx in range(tid, bi * sq, nt):
                j, e = idx // sq, idx % sq
                rr, cc = u(e // SUB), u(j * SUB + e % SUB)
                acc = float32(0.0)
                for l in range(u(j * SUB), top):
                    acc += a[(top + rr) * u(ROW) + l] * x[l * u(ROW) + cc]
                rs[rr * u(ROW) + cc] = acc
            cuda.syncthreads()
            for idx in range(tid, bi * sq, nt):
                j, e = idx // sq, idx % sq
                rr, cc = u(e // SUB), u(j * SUB + e % SUB)
                acc = float32(0.0)
                for mm in range(u(SUB)):
                    acc -= x[(top + rr) * u(ROW) + top + mm] * rs[mm * u(ROW) + cc]
                x[(top + rr) * u(ROW) + cc] = acc
            cuda.syncthreads()
        for idx in range(tid, CHUNK * CHUNK, nt):
            i, l = idx // CHUNK, idx % CHUNK
            t_out[hv, c, i, l] = x[i * ROW + l]
    return solve


@jit(device=True, forceinline=True)
def _tile(sh, a, a8, a4, ak, b, b4, bk, steps, c0, c1, c2, c3):
    """C + A B for one m16n8 tile, A and B read from the flat shared array `sh` (mma.py's TF32 fragment
    layout): the lane's a0 at offset a (a1 eight rows on at a + a8, a2 four k on at a + a4), its b0 at b
    (b1 four k on at b + b4); each of the `steps` k steps of 8 moves a by ak and b by bk."""
    for _ in range(steps):
        c0, c1, c2, c3 = mma_tf32(sh[a], sh[a + a8], sh[a + a4], sh[a + a8 + a4], sh[b], sh[b + b4],
                                  c0, c1, c2, c3)
        a += ak
        b += bk
    return c0, c1, c2, c3


@jit(device=True, forceinline=True)
def _strip(sh, a, a8, a4, ak, b, b4, bk, steps, c):
    """C + A B for a 16 x 32 strip, four m16n8 tiles side by side, as _tile with n tile t's b0 at b + 8 t:
    each k step reads the A fragment once for four mma (12 shared loads per 4 mma; _tile reads 6 per mma).
    c and the result: the 16 accumulators, tile by tile (c[4 t : 4 t + 4] as _tile's c0..c3), written out
    by name (a tuple indexed at run time would become compare chains)."""
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = c
    n1, n2, n3 = uint64(8), uint64(16), uint64(24)
    for _ in range(steps):
        x0, x1, x2, x3 = sh[a], sh[a + a8], sh[a + a4], sh[a + a8 + a4]
        c0, c1, c2, c3 = mma_tf32(x0, x1, x2, x3, sh[b], sh[b + b4], c0, c1, c2, c3)
        c4, c5, c6, c7 = mma_tf32(x0, x1, x2, x3, sh[b + n1], sh[b + b4 + n1], c4, c5, c6, c7)
        c8, c9, c10, c11 = mma_tf32(x0, x1, x2, x3, sh[b + n2], sh[b + b4 + n2], c8, c9, c10, c11)
        c12, c13, c14, c15 = mma_tf32(x0, x1, x2, x3, sh[b + n3], sh[b + b4 + n3], c12, c13, c14, c15)
        a += ak
        b += bk
    return c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15


@jit(device=True, forceinline=True)
def _read16(sh, at, down, scale):
    """scale times the 16 values of a 16 x 32 strip at a lane's accumulator places, in _strip's order: the
    lane's (row, 2 quad) at `at`, its row + 8 `down` on, n tile t 8 t columns on."""
    n1, n2, n3, one = uint64(8), uint64(16), uint64(24), uint64(1)
    lo, hi = at, at + down
    return (scale * sh[lo], scale * sh[lo + one], scale * sh[hi], scale * sh[hi + one],
            scale * sh[lo + n1], scale * sh[lo + n1 + one], scale * sh[hi + n1], scale * sh[hi + n1 + one],
            scale * sh[lo + n2], scale * sh[lo + n2 + one], scale * sh[hi + n2], scale * sh[hi + n2 + one],
            scale * sh[lo + n3], scale * sh[lo + n3 + one], scale * sh[hi + n3], scale * sh[hi + n3 + one])


@jit(device=True, forceinline=True)
def _write8(sh, lo, hi, sa, sb, y):
    """Two n tiles of a lane's accumulator places (_strip's order, y 8 values): sa y into the row at lo, sb y
    into the row 8 on at hi, the second tile 8 columns on."""
    n1, one = uint64(8), uint64(1)
    sh[lo], sh[lo + one], sh[hi], sh[hi + one] = sa * y[0], sa * y[1], sb * y[2], sb * y[3]
    sh[lo + n1], sh[lo + n1 + one], sh[hi + n1], sh[hi + n1 + one] = sa * y[4], sa * y[5], sb * y[6], sb * y[7]


@jit(device=True, forceinline=True)
def _diff8(sh, lo, hi, y):
    """The values at _write8's places minus y."""
    n1, one = uint64(8), uint64(1)
    return (sh[lo] - y[0], sh[lo + one] - y[1], sh[hi] - y[2], sh[hi + one] - y[3],
            sh[lo + n1] - y[4], sh[lo + n1 + one] - y[5], sh[hi + n1] - y[6], sh[hi + n1 + one] - y[7])


def walk_layout(cols, dk, variant="tile"):
    """The walk's flat shared arrays: {name: (offset, row stride)} and the float count. Rows are padded to
    whole 16-row tiles (zeros), and each row stride is chosen for conflict-free fragment reads: 4 mod 32
    for A read along rows (W, Q, P), 8 mod 32 for A read down columns (K) and for every B operand. The
    strip variant adds "x", after the rest (not zeroed): the two k halves' exchange of step (1), 512 floats
    per 16 x 32 strip (two halves of 8 values x 32 lanes, lane-linear: conflict-free)."""
    cp, kp = -(-CHUNK // 16) * 16, -(-dk // 16) * 16
    rows = {"w": (cp, kp + 4), "q": (cp, kp + 4), "k": (cp, kp + 8), "p": (cp, cp + 4), "u": (cp, cols + 8),
            "d": (cp, cols + 8), "e": (cp, cols + 8), "o": (cp, cols + 8), "s": (kp, cols + 8), "g": (2, cp)}
    if variant == "strip":
        rows["x"] = (2 * (cp // 16) * (cols // 32) * 16, 32)
    out, at = {}, 0
    for name, (n, stride) in rows.items():
        out[name] = (at, stride)
        at += n * stride
    return out, at


def _make_walk(control, cols, threads, dk, variant="tile"):
    """The serial pass over chunks for one (value head, block of `cols` state columns) per block, key dim
    dk, everything it multiplies staged in shared memory (walk_layout). Each chunk:
      (1) D = U - W S, E = e^(G_n - G) D and O = e^G (Q S);
      (2) O + P D to the output, S <- e^(G_n) S + K^T E.
    variant "tile": each warp takes m16n8 tiles in turn (_tile: 6 shared loads per mma). Variant "strip":
    each warp takes 16 x 32 strips, four n tiles on one A fragment (_strip: 3 loads per mma); step (1)'s
    strips (4 of D, 4 of O at the GPU's dk = 128) have their k range in two halves, one warp each (16
    items for 16 warps), the halves' partial sums exchanged through shared memory (a barrier) and added
    in a fixed order; step (2)'s 12 strips (4 of O + P D, 8 of the state) take whole k. Either way warps
    past the last item compute one and store nothing, so every warp issues the same mma count (the
    simulator's statement of the instruction synchronises the block). The operands come in by asynchronous 16-byte copies (mma.copy16) of coalesced rows, each
    stage one commit group that lands while a step computes: K and P of chunk c during step (1) of chunk c,
    W, Q and U of chunk c + 1 during step (2); no registers hold them on the way.
    q and k come straight from the op's inputs, scaled by e^G in the products' epilogues.
    control: the output without the entry state's read e^G Q S."""
    lay, _ = walk_layout(cols, dk, variant)
    cp, kp = -(-CHUNK // 16) * 16, -(-dk // 16) * 16
    warps, ntl = threads // 32, cols // 8                 # n tiles of 8 columns
    items1, items2 = 2 * (cp // 16) * ntl, (cp // 16 + kp // 16) * ntl
    rounds1, rounds2 = -(-items1 // warps), -(-items2 // warps)
    (ow, aw), (oq, _), (ok, ak), (op, ap) = lay["w"], lay["q"], lay["k"], lay["p"]
    (ou, bs), (od, _), (oe, _), (oo, _), (os, _), (og, _) = (lay[x] for x in "udeosg")
    u = uint64

    # staging: asynchronous 16-byte copies (mma.copy16), each thread one 4-float group of a row-major tile
    # walking its rows rstep apart, every offset a base plus a constant (unsigned: no negative-index wrap)
    gk, gp, gu = dk // 4, CHUNK // 4, cols // 4
    kstep, pstep, ustep = threads // gk, threads // gp, threads // gu
    per_k, per_p, per_u = -(-CHUNK // kstep), -(-CHUNK // pstep), -(-CHUNK // ustep)

    @jit(device=True, forceinline=True)
    def stage_wqu(sh, uw, q, cr, t0, m, hkdk, qoff, wide, dv, col0, tid):
        """W, Q (rows of the chunk from token t0, m of them real) and the block's columns of U."""
        i0, d = u(tid // gk), u(4 * (tid % gk))
        wb = (u(cr) + i0) * u(wide) + u(dv) + d
        qb = (u(t0) + i0) * u(hkdk) + u(qoff) + d
        for j in range(per_k):
            i = i0 + u(j * kstep)
            if i < u(CHUNK):
                copy16(sh, u(ow) + i * u(aw) + d, uw, wb + u(j * kstep) * u(wide), True)
                live = i < u(m)
                copy16(sh, u(oq) + i * u(aw) + d, q, qb + u(j * kstep) * u(hkdk) if live else u(0), live)
        i0, x = u(tid // gu), u(4 * (tid % gu))
        ub = (u(cr) + i0) * u(wide) + u(col0) + x
        live = u(col0) + x < u(dv)
        for j in range(per_u):
            i = i0 + u(j * ustep)
            if i < u(CHUNK):
                copy16(sh, u(ou) + i * u(bs) + x, uw, ub + u(j * ustep) * u(wide) if live else u(0), live)

    @jit(device=True, forceinline=True)
    def stage_kp(sh, p, k, cr, t0, m, hkdk, qoff, tid):
        """K (rows of the chunk from token t0, m of them real) and P."""
        i0, d = u(tid // gk), u(4 * (tid % gk))
        kb = (u(t0) + i0) * u(hkdk) + u(qoff) + d
        for j in range(per_k):
            i = i0 + u(j * kstep)
            if i < u(CHUNK):
                live = i < u(m)
                copy16(sh, u(ok) + i * u(ak) + d, k, kb + u(j * kstep) * u(hkdk) if live else u(0), live)
        i0, l = u(tid // gp), u(4 * (tid % gp))
        pb = (u(cr) + i0) * u(CHUNK) + l
        for j in range(per_p):
            i = i0 + u(j * pstep)
            if i < u(CHUNK):
                copy16(sh, u(op) + i * u(ap) + l, p, pb + u(j * pstep) * u(CHUNK), True)

    @jit(device=True, forceinline=True)
    def first(sh, on_q, i, j, x):
        """One value of step (1): e^G (Q S) into O, or D = U - W S into D and e^(G_n - G) D into E."""
        at = u(i) * u(bs) + u(j)
        if on_q:
            sh[u(oo) + at] = float32(0.0) if control else sh[u(og) + u(i)] * x
        else:
            dd = sh[u(ou) + at] - x
            sh[u(od) + at] = dd
            sh[u(oe) + at] = sh[u(og + cp) + u(i)] * dd

    @jit(device=True, forceinline=True)
    def second(sh, out, on_s, t0, hv, col0, i, j, x):
        """One value of step (2): the new state, or the output (inside it)."""
        if on_s:
            sh[u(os) + u(i) * u(bs) + u(j)] = x
        elif i < CHUNK and t0 + i < out.shape[0] and col0 + j < out.shape[2]:
            out[t0 + i, hv, col0 + j] = x

    @jit(device=True, forceinline=True)
    def tiles_first(sh, warp, row, quad, lane):
        """Step (1) of the tile variant."""
        # (1) D = U - W S (tiles below items1 / 2), e^G (Q S) (the rest)
        for it in range(rounds1):
            item = min(warp + it * warps, items1 - 1)
            on_q = item >= items1 // 2
            part = item - items1 // 2 if on_q else item
            r0, n0 = 16 * (part // ntl), 8 * (part % ntl)
            a = u(oq if on_q else ow) + u(r0 + row) * u(aw) + u(quad)
            b = u(os) + u(quad) * u(bs) + u(n0 + row)
            f0 = float32(0.0)
            c0, c1, c2, c3 = _tile(sh, a, u(8 * aw), u(4), u(8), b, u(4 * bs), u(8 * bs), kp // 8,
                                   f0, f0, f0, f0)
            if warp + it * warps < items1:
                i, j = r0 + row, n0 + 2 * quad
                first(sh, on_q, i, j, c0)
                first(sh, on_q, i, j + 1, c1)
                first(sh, on_q, i + 8, j, c2)
                first(sh, on_q, i + 8, j + 1, c3)

    @jit(device=True, forceinline=True)
    def tiles_second(sh, out, t0, hv, col0, warp, row, quad, lane, decay):
        """Step (2) of the tile variant."""
        # (2) O + P D to the output (tiles below cp / 16 ntl), S <- e^(G_n) S + K^T E (the rest)
        for it in range(rounds2):
            item = min(warp + it * warps, items2 - 1)
            on_s = item >= (cp // 16) * ntl
            part = item - (cp // 16) * ntl if on_s else item
            r0, n0 = 16 * (part // ntl), 8 * (part % ntl)
            i, j = r0 + row, n0 + 2 * quad
            if on_s:
                at = u(os) + u(i) * u(bs) + u(j)
                c0, c1 = decay * sh[at], decay * sh[at + u(1)]
                c2, c3 = decay * sh[at + u(8 * bs)], decay * sh[at + u(8 * bs + 1)]
                a = u(ok) + u(quad) * u(ak) + u(r0 + row)
                c0, c1, c2, c3 = _tile(sh, a, u(8), u(4 * ak), u(8 * ak), u(oe) + u(quad) * u(bs) + u(n0 + row),
                                       u(4 * bs), u(8 * bs), cp // 8, c0, c1, c2, c3)
            else:
                at = u(oo) + u(i) * u(bs) + u(j)
                c0, c1 = sh[at], sh[at + u(1)]
                c2, c3 = sh[at + u(8 * bs)], sh[at + u(8 * bs + 1)]
                a = u(op) + u(r0 + row) * u(ap) + u(quad)
                c0, c1, c2, c3 = _tile(sh, a, u(8 * ap), u(4), u(8), u(od) + u(quad) * u(bs) + u(n0 + row),
                                       u(4 * bs), u(8 * bs), cp // 8, c0, c1, c2, c3)
            if warp + it * warps < items2:
                second(sh, out, on_s, t0, hv, col0, i, j, c0)
                second(sh, out, on_s, t0, hv, col0, i, j + 1, c1)
                second(sh, out, on_s, t0, hv, col0, i + 8, j, c2)
                second(sh, out, on_s, t0, hv, col0, i + 8, j + 1, c3)

    # the strip variant: 16 x 32 strips (_strip). Step (1): each strip of D (the first strips1 / 2) or O
    # has its k range in two halves, items 2 s and 2 s + 1 (the same round: warps is even); half h
    # finishes n tiles 2 h and 2 h + 1, its partner's partial sums for them through "x". Step (2): a
    # strip of O + P D (the first cp / 16 nst) or of the state, whole k.
    nst = cols // 32
    strips1, strips2 = 2 * (cp // 16) * nst, (cp // 16 + kp // 16) * nst
    items1s = 2 * strips1
    srounds1, srounds2 = -(-items1s // warps), -(-strips2 // warps)
    khalf = kp // 2                                       # a multiple of 8
    ox = lay["x"][0] if variant == "strip" else 0

    @jit(device=True, forceinline=True)
    def strips_first(sh, warp, row, quad, lane):
        """Step (1) of the strip variant."""
        f0 = float32(0.0)
        for it in range(srounds1):
            item = min(warp + it * warps, items1s - 1)
            strip, half = item // 2, item % 2
            on_q = strip >= strips1 // 2
            part = strip - strips1 // 2 if on_q else strip
            r0, n0 = 16 * (part // nst), 32 * (part % nst)
            a = u(oq if on_q else ow) + u(r0 + row) * u(aw) + u(half * khalf + quad)
            b = u(os) + u(half * khalf + quad) * u(bs) + u(n0 + row)
            c = _strip(sh, a, u(8 * aw), u(4), u(8), b, u(4 * bs), u(8 * bs), khalf // 8,
                       (f0, f0, f0, f0, f0, f0, f0, f0, f0, f0, f0, f0, f0, f0, f0, f0))
            keep, give = (c[:8], c[8:]) if half == 0 else (c[8:], c[:8])
            xs = u(ox) + u(strip) * u(512) + u(lane)
            live = warp + it * warps < items1s
            if live:                  # the partner's tiles, into its half of the strip's exchange
                at = xs + u(256) * u(1 - half)
                sh[at], sh[at + u(32)], sh[at + u(64)], sh[at + u(96)] = give[0], give[1], give[2], give[3]
                sh[at + u(128)], sh[at + u(160)], sh[at + u(192)], sh[at + u(224)] = give[4], give[5], give[6], give[7]
            cuda.syncthreads()
            if live:
                at = xs + u(256) * u(half)
                y = (keep[0] + sh[at], keep[1] + sh[at + u(32)], keep[2] + sh[at + u(64)], keep[3] + sh[at + u(96)],
                     keep[4] + sh[at + u(128)], keep[5] + sh[at + u(160)], keep[6] + sh[at + u(192)],
                     keep[7] + sh[at + u(224)])
                i = r0 + row
                lo = u(i) * u(bs) + u(n0 + 16 * half + 2 * quad)
                hi = lo + u(8 * bs)
                if on_q:                  # e^G (Q S)
                    ga, gb = sh[u(og) + u(i)], sh[u(og) + u(i + 8)]
                    if control:
                        ga, gb = f0, f0
                    _write8(sh, u(oo) + lo, u(oo) + hi, ga, gb, y)
                else:                     # D = U - W S and E = e^(G_n - G) D
                    dd = _diff8(sh, u(ou) + lo, u(ou) + hi, y)
                    _write8(sh, u(od) + lo, u(od) + hi, float32(1.0), float32(1.0), dd)
                    _write8(sh, u(oe) + lo, u(oe) + hi, sh[u(og + cp) + u(i)], sh[u(og + cp) + u(i + 8)], dd)

    @jit(device=True, forceinline=True)
    def strips_second(sh, out, t0, hv, col0, warp, row, quad, lane, decay):
        """Step (2) of the strip variant."""
        for it in range(srounds2):
            item = min(warp + it * warps, strips2 - 1)
            on_s = item >= (cp // 16) * nst
            part = item - (cp // 16) * nst if on_s else item
            r0, n0 = 16 * (part // nst), 32 * (part % nst)
            i, j = r0 + row, n0 + 2 * quad
            c = _read16(sh, (u(os) if on_s else u(oo)) + u(i) * u(bs) + u(j), u(8 * bs),
                        decay if on_s else float32(1.0))
            if on_s:
                c = _strip(sh, u(ok) + u(quad) * u(ak) + u(r0 + row), u(8), u(4 * ak), u(8 * ak),
                           u(oe) + u(quad) * u(bs) + u(n0 + row), u(4 * bs), u(8 * bs), cp // 8, c)
            else:
                c = _strip(sh, u(op) + u(r0 + row) * u(ap) + u(quad), u(8 * ap), u(4), u(8),
                           u(od) + u(quad) * u(bs) + u(n0 + row), u(4 * bs), u(8 * bs), cp // 8, c)
            if warp + it * warps < strips2:
                if on_s:                  # the new state: one branch, the stores paired
                    lo = u(os) + u(i) * u(bs) + u(j)
                    _write8(sh, lo, lo + u(8 * bs), float32(1.0), float32(1.0), c[:8])
                    _write8(sh, lo + u(16), lo + u(8 * bs + 16), float32(1.0), float32(1.0), c[8:])
                else:
                    second(sh, out, False, t0, hv, col0, i, j, c[0])
                    second(sh, out, False, t0, hv, col0, i, j + 1, c[1])
                    second(sh, out, False, t0, hv, col0, i + 8, j, c[2])
                    second(sh, out, False, t0, hv, col0, i + 8, j + 1, c[3])
                    second(sh, out, False, t0, hv, col0, i, j + 8, c[4])
                    second(sh, out, False, t0, hv, col0, i, j + 9, c[5])
                    second(sh, out, False, t0, hv, col0, i + 8, j + 8, c[6])
                    second(sh, out, False, t0, hv, col0, i + 8, j + 9, c[7])
                    second(sh, out, False, t0, hv, col0, i, j + 16, c[8])
                    second(sh, out, False, t0, hv, col0, i, j + 17, c[9])
                    second(sh, out, False, t0, hv, col0, i + 8, j + 16, c[10])
                    second(sh, out, False, t0, hv, col0, i + 8, j + 17, c[11])
                    second(sh, out, False, t0, hv, col0, i, j + 24, c[12])
                    second(sh, out, False, t0, hv, col0, i, j + 25, c[13])
                    second(sh, out, False, t0, hv, col0, i + 8, j + 24, c[14])
                    second(sh, out, False, t0, hv, col0, i + 8, j + 25, c[15])

    step_first, step_second = (strips_first, strips_second) if variant == "strip" else (tiles_first, tiles_second)

    @jit(launch_bounds=(threads, 1))
    def walk(uw, p, q, k, gam, out):
        hv, col0, tid = cuda.blockIdx.x, cuda.blockIdx.y * cols, cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        row, quad = lane // 4, lane % 4
        n, dv, slots = out.shape[0], out.shape[2], gam.shape[1]
        hkdk = q.size // max(n, 1)                      # q and k flat: [n, key heads, dk] rows
        hk = hv // (out.shape[1] // (hkdk // dk))
        qoff = hk * dk
        wide = dv + dk
        chunks = (n + CHUNK - 1) // CHUNK
        sh = cuda.shared.array(0, float32)
        total = u(og + 2 * cp)
        for idx in range(u(tid), total, u(threads)):
            sh[idx] = float32(0.0)
        cuda.syncthreads()
        stage_wqu(sh, uw, q, hv * slots * CHUNK, 0, min(CHUNK, n), hkdk, qoff, wide, dv, col0, tid)
        copy_commit()
        for c in range(chunks):
            t0 = c * CHUNK
            cr = (hv * slots + c) * CHUNK                 # the chunk's first row in the flat work arrays
            stage_kp(sh, p, k, cr, t0, min(CHUNK, n - t0), hkdk, qoff, tid)   # lands during step (1)
            copy_commit()
            if tid < CHUNK:
                gv = gam[hv, c, tid]
                sh[u(og) + u(tid)] = math.exp(gv)
                sh[u(og + cp) + u(tid)] = math.exp(gam[hv, c, CHUNK - 1] - gv)
            copy_wait_prior()        # W, Q and U of this chunk (staged during the last step (2))
            cuda.syncthreads()
            step_first(sh, warp, row, quad, lane)
            copy_wait()              # K and P
            cuda.syncthreads()
            if c + 1 < chunks:       # the next chunk's W, Q and U land during step (2)
                stage_wqu(sh, uw, q, cr + CHUNK, t0 + CHUNK, min(CHUNK, n - t0 - CHUNK), hkdk, qoff, wide, dv, col0,
                          tid)
            copy_commit()
            decay = math.exp(gam[hv, c, CHUNK - 1])
            step_second(sh, out, t0, hv, col0, warp, row, quad, lane, decay)
            cuda.syncthreads()
    return walk


_prep, _solve, _walk = {}, {}, {}


# --- the batched products --------------------------------------------------------------------------
def _tf32_round(x):
    """Float32 values as the tensor cores read them in TF32: the low 13 mantissa bits dropped."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
    return bits.view(np.float32)


def _cublas_on_host(transa, transb, m, n, k, a, a_off, lda, sa, b, b_off, ldb, sb, c, c_off, ldc, sc, batch,
                    alpha, beta, tf32):
    """gemm.Blas.gemm_batched_f32 (cublasGemmStridedBatchedEx's column-major semantics) on host copies, for
    the simulator, which has no cuBLAS: float64 sums of the (TF32-rounded, when asked) float32 inputs."""
    ha, hb, hc = (x.copy_to_host().reshape(-1) for x in (a, b, c))
    if tf32:
        ha, hb = _tf32_round(ha), _tf32_round(hb)

    def mat(flat, off, ld, rows, cols, trans):
        # column-major rows x cols at flat[off], leading dimension ld; op() applied
        view = np.lib.stride_tricks.as_strided(flat[off:], (cols, rows), (ld * flat.itemsize, flat.itemsize))
        view = view.T.astype(np.float64)
        return view.T if trans else view

    for i in range(batch):
        op_a = mat(ha, a_off + i * sa, lda, k if transa else m, m if transa else k, transa)
        op_b = mat(hb, b_off + i * sb, ldb, n if transb else k, k if transb else n, transb)
        dst = np.lib.stride_tricks.as_strided(hc[c_off + i * sc:], (n, m), (ldc * 4, 4)).T
        dst[...] = (alpha * (op_a @ op_b) + (beta * dst.astype(np.float64) if beta else 0.0)).astype(np.float32)
    c.copy_to_device(hc.reshape(c.shape))


def _product(m, n, k, a, a_off, lda, sa, b, b_off, ldb, sb, c, c_off, ldc, sc, batch, trans_a=False,
             trans_b=False, alpha=1.0, beta=0.0, tf32=True, stream=0):
    """Row-major, batched: C_i = alpha op(A_i) op(B_i) + beta C_i (C_i m x n; op transposes when asked),
    every matrix at `off + i * s` float32 elements into its array with row stride `ld`.

    Row-major X is column-major X^T, so cuBLAS computes C^T = op(B)^T op(A)^T with the operands swapped."""
    args = (OP_T if trans_b else OP_N, OP_T if trans_a else OP_N, n, m, k, b, b_off, ldb, sb, a, a_off, lda, sa,
            c, c_off, ldc, sc, batch)
    if SIMULATED:
        _cublas_on_host(*args, alpha, beta, tf32)
    else:
        blas().gemm_batched_f32(*args, alpha=alpha, beta=beta, stream=stream, tf32=tf32)


# --- the op --------------------------------------------------------------------------------------
# How the per-chunk operands of the walk are made: "fused", one kernel (gdn_setup.chunk_setup), or
# "stages", prep, the gram product, solve and the [U | W] product (four launches, chunk-major copies).
SETUP = "fused"


def workspace_shapes(n, n_hk, n_hv, dk, dv, setup=None):
    """Float32 work arrays of one call, N + 1 chunk slots per head (the staged setup's copies too)."""
    slots = -(-n // CHUNK) + 1
    out = {"uw": (n_hv, slots, CHUNK, dv + dk), "gam": (n_hv, slots, CHUNK), "p": (n_hv, slots, CHUNK, CHUNK)}
    if (setup or SETUP) == "stages":
        out.update({"qk": (n_hk, slots, 2 * CHUNK, dk), "gram": (n_hk, slots, 2 * CHUNK, CHUNK),
                    "rhs": (n_hv, slots, CHUNK, dv + dk), "t": (n_hv, slots, CHUNK, CHUNK)})
    return out


STAGES = ("prep", "gram", "solve", "uw", "walk")
FUSED_STAGES = ("setup", "walk")


def gated_delta_rule_chunked(q, k, v, g, beta, out, work, stream=0, control=None, walk=None, stages=None,
                             setup=None):
    """gdn.gated_delta_rule, CHUNK tokens at a time; `work` holds the arrays of workspace_shapes. The
    products on tensor cores from TF32 inputs (float32 accumulation). walk: (columns, threads) of the
    serial pass, or (columns, threads, "strip") for its register-blocked variant (default WALK). control:
    "decay" (P without its decay factors) or "state" (the output without the entry state's read e^G Q S).
    setup: "fused" or "stages" (default SETUP). stages: run only these of STAGES (staged setup) or
    FUSED_STAGES (to time them one by one)."""
    setup = setup or SETUP
    if setup not in ("fused", "stages"):
        raise ValueError(f"unknown chunk setup {setup!r}")
    stages = stages or (STAGES if setup == "stages" else FUSED_STAGES)
    n, n_hk, dk = q.shape
    n_hv, dv = v.shape[1], v.shape[2]
    cols, threads, variant = walk_variant(walk or WALK)
    if dk % 8 or dk > DK_MAX or cols % 8 or threads % 32 or max(CHUNK, dk) > THREADS or dv % 4 \
            or threads % (dk // 4) or threads % (CHUNK // 4) or threads % (cols // 4) or variant not in VARIANTS \
            or (variant == "strip" and (cols % 32 or threads % 64)):
        raise ValueError(f"chunked delta rule: key dim {dk} must be a multiple of 8 up to {DK_MAX}, the value "
                         f"dim {dv} of 4, and walk {walk} needs columns in eights and whole warps, a multiple "
                         "of a quarter of the key dim, of the chunk and of its columns; a variant of "
                         f"{VARIANTS}, the strip variant columns in 32s and an even number of warps")
    r = n_hv // n_hk
    slots = -(-n // CHUNK) + 1
    w = work
    if r not in _prep:
        _prep[r] = _make_prep(r)
    solve_key, walk_key = (control == "decay", r), (control == "state", cols, threads, dk, variant)
    if solve_key not in _solve:
        _solve[solve_key] = _make_solve(*solve_key)
    if walk_key not in _walk:
        _walk[walk_key] = _make_walk(*walk_key)
    if "setup" in stages:
        from .gdn_setup import chunk_setup         # (it builds on this module's constants)
        chunk_setup(q, k, v, g, beta, w["uw"], w["p"], w["gam"], stream=stream, control=control == "decay")
    if "prep" in stages:
        _prep[r][(n_hv, slots), THREADS, stream](q, k, v, g, beta, w["qk"], w["rhs"], w["gam"])

    def product(*args, **kw):
        _product(*args, tf32=True, stream=stream, **kw)
    C, wide, batch = CHUNK, dv + dk, n_hv * slots
    if "gram" in stages:           # [Q; K] K^T per key head and chunk: Q K^T above, K K^T below
        product(2 * C, C, dk, w["qk"], 0, dk, 2 * C * dk, w["qk"], C * dk, dk, 2 * C * dk, w["gram"], 0, C,
                2 * C * C, n_hk * slots, trans_b=True)
    if "solve" in stages:
        _solve[solve_key][(n_hv, slots), C * PARTS, stream](w["gram"], w["gam"], beta, w["t"], w["p"])
    if "uw" in stages:             # [U | W] = T [beta V | beta e^G K]
        product(C, wide, C, w["t"], 0, C, C * C, w["rhs"], 0, wide, C * wide, w["uw"], 0, wide, C * wide, batch)
    if "walk" in stages:
        args = (w["uw"].reshape(w["uw"].size), w["p"].reshape(w["p"].size), q.reshape(q.size), k.reshape(k.size),
                w["gam"], out)
        nbytes = 4 * walk_layout(cols, dk, variant)[1]
        allow_shared(_walk[walk_key], args, nbytes)
        _walk[walk_key][(n_hv, -(-dv // cols)), threads, stream, nbytes](*args)


def _run(inp, control, kind="decay", setup=None, walk=None):
    arrays = [cuda.to_device(inp[name]) for name in ("q", "k", "v", "g", "beta")]
    n, n_hk, dk = inp["q"].shape
    n_hv, dv = inp["v"].shape[1:]
    work = {name: cuda.device_array(shape, np.float32)
            for name, shape in workspace_shapes(n, n_hk, n_hv, dk, dv, setup).items()}
    out = cuda.device_array(inp["v"].shape, np.float32)
    gated_delta_rule_chunked(*arrays, out, work, control=kind if control else None, setup=setup, walk=walk)
    return out.copy_to_host()


def _make_inputs(rng, size):
    """The recurrence's contract inputs with stronger decays (g down to -3), so that a missing decay
    factor inside a chunk shows at the tiny size too."""
    inp = _make_delta_inputs(rng, size)
    inp["g"] = inp["g"] * np.float32(6.0)
    return inp


def chunked_error_bound(inp):
    """A first-order running bound on |computed - exact| for each output of the chunked form, from the
    float64 chunk algebra on the inputs: every product whose inputs are rounded to TF32 (truncation, 2^-10
    each) and summed in float32 over k terms errs by (2 u + gamma_k) |A| |B|; every float32 scaling by
    e^G or beta by a few float32 roundings (the exponent's own error from the cumulative sum included);
    T = (I + A)^-1 by |T| dA |T| plus the float32 substitution's gamma_C |T| (I + |A|) |T|; errors of
    the inputs of each step propagate through the absolute values of the step's other operands."""
    u32 = gamma(1)
    u = EPS_TF32
    q, k, v, g, beta = (np.asarray(inp[n], np.float64) for n in ("q", "k", "v", "g", "beta"))
    n, n_hk, dk = q.shape
    n_hv, dv = v.shape[1:]
    rep = n_hv // n_hk
    chunks = -(-n // CHUNK)
    pad = chunks * CHUNK - n

    def heads(x, repeat=1):       # [n, H, d] -> [H, n + pad, d], repeated onto value heads
        x = np.repeat(np.transpose(x, (1, 0, 2)), repeat, axis=0)
        return np.concatenate([x, np.zeros((x.shape[0], pad, x.shape[2]))], axis=1)
    qh, kh, vh = heads(q, rep), heads(k, rep), heads(v)
    gh, bh = (np.concatenate([x.T, np.zeros((n_hv, pad))], axis=1) for x in (g, beta))
    mul = lambda a, b: a @ b                                        # noqa: E731
    tr = lambda a: np.swapaxes(a, 1, 2)                             # noqa: E731
    p_dk, p_c = 2 * u + gamma(dk), 2 * u + gamma(CHUNK)
    lower = np.tril(np.ones((CHUNK, CHUNK), bool))
    eye = np.eye(CHUNK)
    s, es = np.zeros((n_hv, dk, dv)), np.zeros((n_hv, dk, dv))
    out = np.zeros((n_hv, chunks * CHUNK, dv))
    for c in range(chunks):
        sl = slice(c * CHUNK, (c + 1) * CHUNK)
        qc, kc, vc, bc = qh[:, sl], kh[:, sl], vh[:, sl], bh[:, sl, None]
        big = np.cumsum(gh[:, sl], axis=1)
        cum = np.cumsum(np.abs(gh[:, sl]), axis=1)                  # what the float32 cumsum rounds
        rel = 4 * u32 + 2 * gamma(CHUNK) * cum                      # of e^G, e^(G_i - G_l), e^(G_n - G)
        decay = np.where(lower, np.exp(np.where(lower, big[:, :, None] - big[:, None, :], 0.0)), 0.0)
        ak, aq = np.abs(kc), np.abs(qc)
        e_kk, e_qk = p_dk * mul(ak, tr(ak)), p_dk * mul(aq, tr(ak))
        strict = lower & ~eye.astype(bool)
        a = np.where(strict, bc * decay * mul(kc, tr(kc)), 0.0)
        ea = np.where(strict, bc * decay * e_kk + (4 * u32 + rel[:, :, None]) * np.abs(a), 0.0)
        pm = np.where(lower, decay * mul(qc, tr(kc)), 0.0)
        ep = np.where(lower, decay * e_qk + (2 * u32 + rel[:, :, None]) * np.abs(pm), 0.0)
        t = np.linalg.inv(eye + a)
        at = np.abs(t)
        et = mul(mul(at, ea), at) + gamma(CHUNK) * mul(mul(at, eye + np.abs(a)), at)
        eg = np.exp(big)[:, :, None]
        rhs = np.concatenate([bc * vc, bc * eg * kc], axis=2)
        erhs = (4 * u32 + rel[:, :, None]) * np.abs(rhs)
        uw = mul(t, rhs)
        euw = p_c * mul(at, np.abs(rhs)) + mul(et, np.abs(rhs)) + mul(at, erhs)
        uu, ww, eu, ew = uw[..., :dv], uw[..., dv:], euw[..., :dv], euw[..., dv:]
        kt = np.exp(big[:, -1:] - big)[:, :, None] * kc
        ekt = (2 * u32 + rel[:, :, None]) * np.abs(kt)
        qg = eg * qc
        eqg = (2 * u32 + rel[:, :, None]) * np.abs(qg)
        delta = uu - mul(ww, s)
        edelta = p_dk * mul(np.abs(ww), np.abs(s)) + eu + mul(ew, np.abs(s)) + mul(np.abs(ww), es) \
            + u32 * np.abs(delta)
        o = mul(qg, s) + mul(pm, delta)
        eo = p_dk * mul(np.abs(qg), np.abs(s)) + p_c * mul(np.abs(pm), np.abs(delta)) + mul(eqg, np.abs(s)) \
            + mul(np.abs(qg), es) + mul(ep, np.abs(delta)) + mul(np.abs(pm), edelta) + u32 * np.abs(o)
        out[:, sl] = eo
        # S <- e^(G_n) S + K~^T D: the decay in float32 (the walk's accumulators start from it), K~^T D on TF32
        gamma_n = np.exp(big[:, -1])[:, None, None]
        s_next = gamma_n * s + mul(tr(kt), delta)
        es = gamma_n * (es + (2 * u32 + rel[:, -1:, None]) * np.abs(s)) + p_c * mul(tr(np.abs(kt)), np.abs(delta)) \
            + mul(tr(ekt), np.abs(delta)) + mul(tr(np.abs(kt)), edelta) + u32 * np.abs(s_next)
        s = s_next
    return np.ascontiguousarray(np.transpose(out[:, :n], (1, 0, 2)))


def _ref_chunked(inp):
    """The float64 recurrence; the gate twice the running bound (first order: the slack covers the
    products of errors it leaves out)."""
    ref, _ = delta_reference_terms(inp)
    return ref, 2 * chunked_error_bound(inp) + 1e-30


CASES = [
    Case("gated_delta_rule_chunked", _make_inputs, _run, _ref_chunked,
         notes="control: the within-chunk read P without its decay factors"),
    Case("gated_delta_rule_chunk_stages", _make_inputs, lambda i, c: _run(i, c, setup="stages"), _ref_chunked,
         notes="the setup as four launches (prep, gram, solve, [U | W]); control: P without its decay factors"),
    Case("gated_delta_rule_chunk_walk", _make_inputs, lambda i, c: _run(i, c, kind="state"), _ref_chunked,
         notes="control: the output without the entry state's read e^G Q S (the walk)"),
    Case("gated_delta_rule_chunk_walk_strip", _make_inputs, lambda i, c: _run(i, c, kind="state", walk=WALK_STRIP),
         _ref_chunked, notes="the strip walk (WALK_STRIP); control: the output without the entry state's read "
                             "e^G Q S"),
]
