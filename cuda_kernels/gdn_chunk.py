"""The gated delta rule in chunks of CHUNK tokens (encoder.md 3.2), its products on tensor cores.

The same function as gdn.gated_delta_rule; the serial dependence is cut from one step per token to one
small product per chunk. Per value head and chunk, with G = cumsum(g) in the chunk and D_il = e^(G_i - G_l):
  A = strictly_lower(beta K K^T * D),  T = (I + A)^-1,  P = lower(Q K^T * D),
  [U | W] = T [beta V | beta e^G K],   K~ = e^(G_n - G) K,
all of it in parallel over chunks (two kernels, prep and solve, and two strided-batched cuBLAS products on
TF32 tensor cores). Then the walk, serial over chunks, one block per (value head, block of
WALK columns of the state), the state's columns in shared memory, its products on TF32 mma.sync:
  D = U - W S,  O = e^G Q S + P D,  S <- e^(G_n) S + K~^T D.
Buffers hold N + 1 chunk slots per head, the last one zero (the earlier chunk-map form's state walk needed it;
kept, unmeasured without it), so every batched product walks its operands with one stride.
"""

import math

import numpy as np
from numba import cuda, float32, uint64

from .core import SIMULATED, Case, gamma, jit
from .gdn import _make_delta_inputs, delta_reference_terms
from .gemm import EPS_TF32, OP_N, OP_T, blas
from .mma import mma_tf32, prefetch_l2

CHUNK = 4 if SIMULATED else 64
ROW = CHUNK + 1                          # padded shared rows: a column walk then hits distinct banks
AREA = CHUNK * ROW
PARTS = 4                                # threads per column of T in the triangular solve
THREADS = 32 if SIMULATED else 256       # prep (at most one thread per key dim)
REDUCE = CHUNK * PARTS                   # the solve's threads (its simulator reduction slots)
SUB = 2 if SIMULATED else 16             # rows of T solved serially at a time
SPAN = 8                                 # tokens of a chunk per prep block
# The walk: (state columns per block, a multiple of 16; threads per block, whole warps). Its shared state
# holds up to DK_MAX key rows; rows of cols + 4 floats put a fragment's 32 loads in 32 banks.
WALK = (16, 64) if SIMULATED else (16, 256)
DK_MAX = 16 if SIMULATED else 128


def walk_name(walk):
    """A walk geometry as the benchmarks label it: "walk16x256", "walk16x256_prefetch"."""
    return "walk{}x{}".format(*walk) + ("_prefetch" if walk[2:] and walk[2] else "")


# --- kernels -------------------------------------------------------------------------------------
def _make_prep(r):
    """Chunk-major operands per (value head, chunk, SPAN tokens), one thread per key dim; heads whose index
    is a multiple of r (the value heads per key head) also write their key head's [Q; K] rows."""
    @jit
    def prep(q, k, v, g, beta, qk, rhs, kt, qg, gam):
        hv, c, tid, nt = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x, cuda.blockDim.x
        n, dk, dv = q.shape[0], q.shape[2], v.shape[2]
        hk = hv // r
        t0 = c * CHUNK
        m = max(0, min(CHUNK, n - t0))
        gs = cuda.shared.array(CHUNK, float32)
        bs = cuda.shared.array(CHUNK, float32)      # beta
        eg = cuda.shared.array(CHUNK, float32)      # e^G
        ek = cuda.shared.array(CHUNK, float32)      # e^(G_n - G)
        for i in range(tid, CHUNK, nt):
            gs[i] = g[t0 + i, hv] if i < m else float32(0.0)
            bs[i] = beta[t0 + i, hv] if i < m else float32(0.0)
        cuda.syncthreads()
        if tid == 0:
            for i in range(1, CHUNK):
                gs[i] += gs[i - 1]
        cuda.syncthreads()
        last = gs[CHUNK - 1]
        for i in range(tid, CHUNK, nt):
            eg[i] = math.exp(gs[i])
            ek[i] = math.exp(last - gs[i])
            if cuda.blockIdx.z == 0:
                gam[hv, c, i] = gs[i]
        cuda.syncthreads()
        # this block's SPAN tokens of the chunk (a thread walks them serially: a store may alias the next
        # load, so each token waits out one load latency; more blocks, fewer tokens each)
        i_lo = cuda.blockIdx.z * SPAN
        i_hi = min(i_lo + SPAN, CHUNK)
        for d in range(tid, dk, nt):
            for i in range(i_lo, i_hi):
                kv = k[t0 + i, hk, d] if i < m else float32(0.0)
                qv = q[t0 + i, hk, d] if i < m else float32(0.0)
                rhs[hv, c, i, dv + d] = bs[i] * eg[i] * kv
                kt[hv, c, i, d] = ek[i] * kv
                qg[hv, c, i, d] = eg[i] * qv
                if hv % r == 0:
                    qk[hk, c, i, d] = qv
                    qk[hk, c, CHUNK + i, d] = kv
        for d in range(tid, dv, nt):
            for i in range(i_lo, i_hi):
                rhs[hv, c, i, d] = bs[i] * v[t0 + i, hv, d] if i < m else float32(0.0)
    return prep


def _make_prep_rows(r):
    """prep with one block per (value head, chunk): the cumulative decays by a parallel scan, then each
    thread one key (value) dim of ROWS rows at a time, the rows' loads issued together before any store
    (a store may alias a later load, so loads written after a store wait for it)."""
    @jit(device=True, forceinline=True)
    def key_row(q, k, qk, rhs, kt, qg, bs, eg, ek, hv, hk, c, t0, m, dv, i, d, kv, qv):
        if i < CHUNK:
            rhs[hv, c, i, dv + d] = bs[i] * eg[i] * kv
            kt[hv, c, i, d] = ek[i] * kv
            qg[hv, c, i, d] = eg[i] * qv
            if hv % r == 0:
                qk[hk, c, i, d] = qv
                qk[hk, c, CHUNK + i, d] = kv

    @jit
    def prep(q, k, v, g, beta, qk, rhs, kt, qg, gam):
        hv, c, tid, nt = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x, cuda.blockDim.x
        n, dk, dv = q.shape[0], q.shape[2], v.shape[2]
        hk = hv // r
        t0 = c * CHUNK
        m = max(0, min(CHUNK, n - t0))
        gs = cuda.shared.array(CHUNK, float32)
        bs = cuda.shared.array(CHUNK, float32)
        eg = cuda.shared.array(CHUNK, float32)
        ek = cuda.shared.array(CHUNK, float32)
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
            ek[tid] = math.exp(gs[CHUNK - 1] - gs[tid])
            gam[hv, c, tid] = gs[tid]
        cuda.syncthreads()
        f0 = float32(0.0)
        rs = nt // dk
        if tid < rs * dk:
            d, i = tid % dk, tid // dk
            while i < CHUNK:
                i1, i2, i3 = i + rs, i + 2 * rs, i + 3 * rs
                k0 = k[t0 + i, hk, d] if i < m else f0
                k1 = k[t0 + i1, hk, d] if i1 < m else f0
                k2 = k[t0 + i2, hk, d] if i2 < m else f0
                k3 = k[t0 + i3, hk, d] if i3 < m else f0
                q0 = q[t0 + i, hk, d] if i < m else f0
                q1 = q[t0 + i1, hk, d] if i1 < m else f0
                q2 = q[t0 + i2, hk, d] if i2 < m else f0
                q3 = q[t0 + i3, hk, d] if i3 < m else f0
                key_row(q, k, qk, rhs, kt, qg, bs, eg, ek, hv, hk, c, t0, m, dv, i, d, k0, q0)
                key_row(q, k, qk, rhs, kt, qg, bs, eg, ek, hv, hk, c, t0, m, dv, i1, d, k1, q1)
                key_row(q, k, qk, rhs, kt, qg, bs, eg, ek, hv, hk, c, t0, m, dv, i2, d, k2, q2)
                key_row(q, k, qk, rhs, kt, qg, bs, eg, ek, hv, hk, c, t0, m, dv, i3, d, k3, q3)
                i += 4 * rs
        rs = nt // dv
        if tid < rs * dv:
            d, i = tid % dv, tid // dv
            while i < CHUNK:
                i1, i2, i3 = i + rs, i + 2 * rs, i + 3 * rs
                v0 = v[t0 + i, hv, d] if i < m else f0
                v1 = v[t0 + i1, hv, d] if i1 < m else f0
                v2 = v[t0 + i2, hv, d] if i2 < m else f0
                v3 = v[t0 + i3, hv, d] if i3 < m else f0
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
    """T = (I + A)^-1 by blocked forward substitution, and the decayed P (control: P without its decay
    factors). Rows go in blocks of SUB: the rows above a block enter as one product all threads share,
    only the rows inside it are serial, PARTS threads per column of T summing their terms."""
    @jit(device=True)
    def parts_sum(red, tid, value):
        if SIMULATED:               # no shuffles in the simulator: through shared memory
            red[tid] = value
            cuda.syncthreads()
            total = float32(0.0)
            first = tid - tid % PARTS
            for p in range(PARTS):
                total += red[first + p]
            cuda.syncthreads()
            return total
        step = 1
        while step < PARTS:
            value += cuda.shfl_xor_sync(0xFFFFFFFF, value, step)
            step *= 2
        return value

    @jit
    def solve(gram, gam, beta, t_out, p_out):
        hv, c, tid, nt = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x, cuda.blockDim.x
        n = beta.shape[0]
        hk = hv // r
        t0 = c * CHUNK
        m = max(0, min(CHUNK, n - t0))
        a = cuda.shared.array(AREA, float32)       # CHUNK rows of ROW floats
        x = cuda.shared.array(AREA, float32)
        gs = cuda.shared.array(CHUNK, float32)
        bs = cuda.shared.array(CHUNK, float32)
        red = cuda.shared.array(REDUCE, float32)
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
            x[i * ROW + l] = float32(1.0) if i == l else float32(0.0)
        cuda.syncthreads()
        col, part = tid // PARTS, tid % PARTS
        for r0 in range(0, CHUNK, SUB):
            # rows r0..r0+SUB-1 less the rows above the block (already final), all threads
            # (unsigned offsets: no negative-index fix-ups in the inner loop)
            for idx in range(tid, SUB * CHUNK, nt):
                i, j = r0 + idx // CHUNK, idx % CHUNK
                ai, xj = uint64(i * ROW), uint64(j)
                s = float32(0.0)
                for l in range(uint64(r0)):
                    s += a[ai + l] * x[l * uint64(ROW) + xj]
                x[i * ROW + j] -= s
            cuda.syncthreads()
            # inside the block: row i less its rows r0..i-1, serial over i
            for i in range(r0 + 1, r0 + SUB):
                s = float32(0.0)
                for l in range(r0 + part, i, PARTS):
                    s += a[i * ROW + l] * x[l * ROW + col]
                s = parts_sum(red, tid, s)
                if part == 0:
                    x[i * ROW + col] -= s
                if SIMULATED:
                    cuda.syncthreads()
                else:
                    cuda.syncwarp()     # a column's PARTS threads share one warp
            cuda.syncthreads()
        for idx in range(tid, CHUNK * CHUNK, nt):
            i, l = idx // CHUNK, idx % CHUNK
            t_out[hv, c, i, l] = x[i * ROW + l]
    return solve


@jit(device=True, forceinline=True)
def _pair(a0, a1, a2, a3, b, k, k1, n0, row, c):
    """Two 16 x 8 tiles side by side (columns n0 and n0 + 8 of the shared B, rows k and k1) on one A
    fragment."""
    d0, d1, d2, d3 = mma_tf32(a0, a1, a2, a3, b[k, n0 + row], b[k1, n0 + row], c[0], c[1], c[2], c[3])
    d4, d5, d6, d7 = mma_tf32(a0, a1, a2, a3, b[k, n0 + 8 + row], b[k1, n0 + 8 + row], c[4], c[5], c[6], c[7])
    return d0, d1, d2, d3, d4, d5, d6, d7


@jit(device=True, forceinline=True)
def _fetch(src, cr, ra, lim, ld, off, k, kmax, transposed):
    """The A fragment of one k step (mma.py's TF32 layout, k slots 2 quad and 2 quad + 1) at the lane's rows
    ra and ra + 8 of a chunk whose first row is flat row cr of `src` (row length ld): A[r, k] =
    src[(cr + r) ld + off + k], or src[(cr + k) ld + r] when `transposed`; zero at rows >= lim and k >= kmax
    (the reads clamped inside the chunk)."""
    ca, cb = min(ra, lim - 1), min(ra + 8, lim - 1)
    kc, kd = min(k, kmax - 1), min(k + 1, kmax - 1)
    if transposed:
        a0, a1 = src[(cr + kc) * ld + ca], src[(cr + kc) * ld + cb]
        a2, a3 = src[(cr + kd) * ld + ca], src[(cr + kd) * ld + cb]
    else:
        a0, a1 = src[(cr + ca) * ld + off + kc], src[(cr + cb) * ld + off + kc]
        a2, a3 = src[(cr + ca) * ld + off + kd], src[(cr + cb) * ld + off + kd]
    f0 = float32(0.0)
    return (a0 if ra < lim and k < kmax else f0, a1 if ra + 8 < lim and k < kmax else f0,
            a2 if ra < lim and k + 1 < kmax else f0, a3 if ra + 8 < lim and k + 1 < kmax else f0)


@jit(device=True, forceinline=True)
def _frag(src, at, ks, rs):
    """An exact fragment from its first element's flat offset: a0 at `at`, a1 a row tile (8 rows, rs) on,
    a2 and a3 the next k (ks) on."""
    return src[at], src[at + rs], src[at + ks], src[at + rs + ks]


@jit(device=True, forceinline=True)
def _times(src, cr, ra, lim, ld, off, b, kmax, n0, quad, row, steps, acc, transposed, exact):
    """acc + A B for the 16 x 16 item at the lane's rows ra, ra + 8 and shared columns n0: A as _fetch
    reads it, B = b[k, n0:n0 + 16]. `exact` (the chunk's and the state's rows whole tiles, a constant where
    this is inlined): unsigned offsets, no clamps, and eight k steps at a time, their 32 global loads out
    together before their 16 mma. Otherwise (the simulator's small shapes) step by step, clamped."""
    if not exact:
        for g in range(steps):
            kk = 8 * g + 2 * quad
            x = _fetch(src, cr, ra, lim, ld, off, kk, kmax, transposed)
            acc = _pair(x[0], x[1], x[2], x[3], b, min(kk, kmax - 1), min(kk + 1, kmax - 1), n0, row, acc)
        return acc
    uq, un0, urow = uint64(2 * quad), uint64(n0), uint64(row)
    if transposed:
        at, ks, rs = (uint64(cr) + uq) * uint64(ld) + uint64(ra), uint64(ld), uint64(8)
    else:
        at, ks, rs = (uint64(cr) + uint64(ra)) * uint64(ld) + uint64(off) + uq, uint64(1), uint64(8 * ld)
    if steps % 8:
        for g in range(steps):
            x = _frag(src, at + uint64(8 * g) * ks, ks, rs)
            kk = uint64(8 * g) + uq
            acc = _pair(x[0], x[1], x[2], x[3], b, kk, kk + uint64(1), un0, urow, acc)
        return acc
    for g in range(0, steps, 8):
        x0 = _frag(src, at, ks, rs)
        x1 = _frag(src, at + uint64(8) * ks, ks, rs)
        x2 = _frag(src, at + uint64(16) * ks, ks, rs)
        x3 = _frag(src, at + uint64(24) * ks, ks, rs)
        x4 = _frag(src, at + uint64(32) * ks, ks, rs)
        x5 = _frag(src, at + uint64(40) * ks, ks, rs)
        x6 = _frag(src, at + uint64(48) * ks, ks, rs)
        x7 = _frag(src, at + uint64(56) * ks, ks, rs)
        at += uint64(64) * ks
        kk = uint64(8 * g) + uq        # written out: a loop over the tuples would select among them at run time
        acc = _pair(x0[0], x0[1], x0[2], x0[3], b, kk, kk + uint64(1), un0, urow, acc)
        acc = _pair(x1[0], x1[1], x1[2], x1[3], b, kk + uint64(8), kk + uint64(9), un0, urow, acc)
        acc = _pair(x2[0], x2[1], x2[2], x2[3], b, kk + uint64(16), kk + uint64(17), un0, urow, acc)
        acc = _pair(x3[0], x3[1], x3[2], x3[3], b, kk + uint64(24), kk + uint64(25), un0, urow, acc)
        acc = _pair(x4[0], x4[1], x4[2], x4[3], b, kk + uint64(32), kk + uint64(33), un0, urow, acc)
        acc = _pair(x5[0], x5[1], x5[2], x5[3], b, kk + uint64(40), kk + uint64(41), un0, urow, acc)
        acc = _pair(x6[0], x6[1], x6[2], x6[3], b, kk + uint64(48), kk + uint64(49), un0, urow, acc)
        acc = _pair(x7[0], x7[1], x7[2], x7[3], b, kk + uint64(56), kk + uint64(57), un0, urow, acc)
    return acc


def _make_walk(control, cols, threads, dk, prefetch=False, parts=3):
    """The serial pass over chunks for one (value head, block of `cols` state columns) per block, key dim
    dk. Each chunk: (1) W S and e^G Q S on tensor cores, D = U - W S and e^G Q S into shared memory;
    (2) O = e^G Q S + P D to the output, and S <- e^(G_n) S + K~^T D. A warp takes one 16 x 16 item (two
    mma tiles on one A fragment) at a time (_times); warps past the last item compute it and write
    nothing, so every warp issues the same mma count (the simulator's statement of the instruction
    synchronises the block). The k index of each 8-wide step is laid out as 2 quad, 2 quad + 1 in both
    operands (mma.py): a lane's A loads are neighbours in memory. uw, qg, kt and p come flat (1-D views).
    prefetch (whole tiles and dk % 32 == 0 only): at each chunk's start the block asks L2 for the next
    chunk's lines, its share of W, e^G Q, K~ and P (the column blocks of a head split them) and its own
    columns of U. control: the output without the entry state's read e^G Q S. parts (timing probes only):
    1 runs step (1) alone, 2 step (2) alone, 3 both."""
    srow = cols + 4
    warps = threads // 32
    ct = (CHUNK + 15) // 16              # row tiles of a chunk
    dt = (dk + 15) // 16                 # row tiles of the state
    npair = cols // 16                   # 16-column items of the block
    ksteps, csteps = dk // 8, (CHUNK + 7) // 8
    exact = CHUNK % 16 == 0 and dk % 16 == 0
    fetch_next = prefetch and exact and dk % 32 == 0
    per_row = dk // 32                   # 128-byte lines in a row of W, e^G Q or K~
    w_lines, q_lines, p_lines = CHUNK * per_row, CHUNK * per_row, CHUNK * CHUNK // 32
    all_lines = w_lines + 2 * q_lines + p_lines

    @jit(device=True, forceinline=True)
    def first(o, d, uw, cr, wide, col0, dv, on_q, i, j, x):
        """One value of a step (1) item: e^G Q S into o, or D = U - W S into d (zero past dv)."""
        if i < CHUNK:
            if on_q:
                o[i, j] = float32(0.0) if control else x
            elif col0 + j < dv:
                d[i, j] = uw[(cr + i) * wide + col0 + j] - x
            else:
                d[i, j] = float32(0.0)

    @jit(device=True, forceinline=True)
    def second(s, out, on_s, lim, t0, hv, col0, i, j, x):
        """One value of a step (2) item: the new state, or the output (rows and columns inside it)."""
        if i < lim:
            if on_s:
                s[i, j] = x
            elif t0 + i < out.shape[0] and col0 + j < out.shape[2]:
                out[t0 + i, hv, col0 + j] = x

    @jit
    def walk(uw, qg, kt, p, gam, out):
        hv, col0 = cuda.blockIdx.x, cuda.blockIdx.y * cols
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        row, quad = lane // 4, lane % 4
        n, dv, slots = out.shape[0], out.shape[2], gam.shape[1]
        wide = dv + dk
        chunks = (n + CHUNK - 1) // CHUNK
        s = cuda.shared.array((DK_MAX, srow), float32)
        d = cuda.shared.array((CHUNK, srow), float32)
        o = cuda.shared.array((CHUNK, srow), float32)
        for idx in range(tid, DK_MAX * srow, threads):
            s[idx // srow, idx % srow] = float32(0.0)
        cuda.syncthreads()
        f0 = float32(0.0)
        zero = (f0, f0, f0, f0, f0, f0, f0, f0)
        for c in range(chunks):
            cr = (hv * slots + c) * CHUNK            # the chunk's first row in the flat work arrays
            if fetch_next and c + 1 < chunks:
                nr = uint64(cr + CHUNK)
                for ln in range(cuda.blockIdx.y * threads + tid, all_lines, cuda.gridDim.y * threads):
                    if ln < w_lines:
                        prefetch_l2(uw, (nr + uint64(ln // per_row)) * uint64(wide) + uint64(dv + 32 * (ln % per_row)))
                    elif ln < w_lines + q_lines:
                        prefetch_l2(qg, nr * uint64(dk) + uint64(32 * (ln - w_lines)))
                    elif ln < w_lines + 2 * q_lines:
                        prefetch_l2(kt, nr * uint64(dk) + uint64(32 * (ln - w_lines - q_lines)))
                    else:
                        prefetch_l2(p, nr * uint64(CHUNK) + uint64(32 * (ln - w_lines - 2 * q_lines)))
                for r in range(tid, CHUNK, threads):
                    prefetch_l2(uw, (nr + uint64(r)) * uint64(wide) + uint64(col0))
            # (1) D = U - W S (items below ct * npair), e^G Q S (the rest)
            for it in range((2 * ct * npair + warps - 1) // warps if parts & 1 else 0):
                item = min(warp + it * warps, 2 * ct * npair - 1)
                live = warp + it * warps < 2 * ct * npair
                on_q = item >= ct * npair
                part = item - ct * npair if on_q else item
                r0, n0 = 16 * (part // npair), 16 * (part % npair)
                ra = r0 + row
                if on_q:
                    acc = _times(qg, cr, ra, CHUNK, dk, 0, s, dk, n0, quad, row, ksteps, zero, False, exact)
                else:
                    acc = _times(uw, cr, ra, CHUNK, wide, dv, s, dk, n0, quad, row, ksteps, zero, False, exact)
                if live:                # the item's eight values, written out (acc[e] in a loop would select)
                    j0 = n0 + 2 * quad
                    first(o, d, uw, cr, wide, col0, dv, on_q, ra, j0, acc[0])
                    first(o, d, uw, cr, wide, col0, dv, on_q, ra, j0 + 1, acc[1])
                    first(o, d, uw, cr, wide, col0, dv, on_q, ra + 8, j0, acc[2])
                    first(o, d, uw, cr, wide, col0, dv, on_q, ra + 8, j0 + 1, acc[3])
                    first(o, d, uw, cr, wide, col0, dv, on_q, ra, j0 + 8, acc[4])
                    first(o, d, uw, cr, wide, col0, dv, on_q, ra, j0 + 9, acc[5])
                    first(o, d, uw, cr, wide, col0, dv, on_q, ra + 8, j0 + 8, acc[6])
                    first(o, d, uw, cr, wide, col0, dv, on_q, ra + 8, j0 + 9, acc[7])
            cuda.syncthreads()
            # (2) O = e^G Q S + P D to the output (items below ct * npair), S <- e^(G_n) S + K~^T D (the rest)
            decay = math.exp(gam[hv, c, CHUNK - 1])
            for it in range(((ct + dt) * npair + warps - 1) // warps if parts & 2 else 0):
                item = min(warp + it * warps, (ct + dt) * npair - 1)
                live = warp + it * warps < (ct + dt) * npair
                on_s = item >= ct * npair
                part = item - ct * npair if on_s else item
                r0, n0 = 16 * (part // npair), 16 * (part % npair)
                ra = r0 + row
                lim = dk if on_s else CHUNK
                ca, cb = min(ra, lim - 1), min(ra + 8, lim - 1)
                j0 = n0 + 2 * quad
                if on_s:
                    acc = (decay * s[ca, j0], decay * s[ca, j0 + 1], decay * s[cb, j0], decay * s[cb, j0 + 1],
                           decay * s[ca, j0 + 8], decay * s[ca, j0 + 9], decay * s[cb, j0 + 8], decay * s[cb, j0 + 9])
                    acc = _times(kt, cr, ra, dk, dk, 0, d, CHUNK, n0, quad, row, csteps, acc, True, exact)
                else:
                    acc = (o[ca, j0], o[ca, j0 + 1], o[cb, j0], o[cb, j0 + 1],
                           o[ca, j0 + 8], o[ca, j0 + 9], o[cb, j0 + 8], o[cb, j0 + 9])
                    acc = _times(p, cr, ra, CHUNK, CHUNK, 0, d, CHUNK, n0, quad, row, csteps, acc, False, exact)
                if live:
                    t0 = c * CHUNK
                    second(s, out, on_s, lim, t0, hv, col0, ra, j0, acc[0])
                    second(s, out, on_s, lim, t0, hv, col0, ra, j0 + 1, acc[1])
                    second(s, out, on_s, lim, t0, hv, col0, ra + 8, j0, acc[2])
                    second(s, out, on_s, lim, t0, hv, col0, ra + 8, j0 + 1, acc[3])
                    second(s, out, on_s, lim, t0, hv, col0, ra, j0 + 8, acc[4])
                    second(s, out, on_s, lim, t0, hv, col0, ra, j0 + 9, acc[5])
                    second(s, out, on_s, lim, t0, hv, col0, ra + 8, j0 + 8, acc[6])
                    second(s, out, on_s, lim, t0, hv, col0, ra + 8, j0 + 9, acc[7])
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
def workspace_shapes(n, n_hk, n_hv, dk, dv):
    """Float32 work arrays of one call, N + 1 chunk slots per head."""
    slots = -(-n // CHUNK) + 1
    return {"qk": (n_hk, slots, 2 * CHUNK, dk), "gram": (n_hk, slots, 2 * CHUNK, CHUNK),
            "rhs": (n_hv, slots, CHUNK, dv + dk), "uw": (n_hv, slots, CHUNK, dv + dk),
            "kt": (n_hv, slots, CHUNK, dk), "qg": (n_hv, slots, CHUNK, dk), "gam": (n_hv, slots, CHUNK),
            "t": (n_hv, slots, CHUNK, CHUNK), "p": (n_hv, slots, CHUNK, CHUNK)}


STAGES = ("prep", "gram", "solve", "uw", "walk")


def gated_delta_rule_chunked(q, k, v, g, beta, out, work, stream=0, control=None, walk=None, stages=STAGES):
    """gdn.gated_delta_rule, CHUNK tokens at a time; `work` holds the arrays of workspace_shapes. The
    products on tensor cores from TF32 inputs (float32 accumulation). walk: (columns, threads) of the
    serial pass (default WALK), or (columns, threads, True) to prefetch each next chunk into L2.
    control: "decay" (P without its decay factors) or "state" (the output without the entry state's read
    e^G Q S). stages: run only these of STAGES (to time them one by one)."""
    n, n_hk, dk = q.shape
    n_hv, dv = v.shape[1], v.shape[2]
    cols, threads, *rest = walk or WALK
    prefetch = bool(rest and rest[0])
    if dk % 8 or dk > DK_MAX or cols % 16 or threads % 32:
        raise ValueError(f"chunked delta rule: key dim {dk} must be a multiple of 8 up to {DK_MAX}, walk {walk} "
                         "needs columns in sixteens and whole warps")
    r = n_hv // n_hk
    slots = -(-n // CHUNK) + 1
    w = work
    if r not in _prep:
        _prep[r] = _make_prep(r)
    solve_key, walk_key = (control == "decay", r), (control == "state", cols, threads, dk, prefetch)
    if solve_key not in _solve:
        _solve[solve_key] = _make_solve(*solve_key)
    if walk_key not in _walk:
        _walk[walk_key] = _make_walk(*walk_key)
    if "prep" in stages:
        _prep[r][(n_hv, slots, -(-CHUNK // SPAN)), min(dk, THREADS), stream](q, k, v, g, beta, w["qk"], w["rhs"],
                                                                         w["kt"], w["qg"], w["gam"])

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
        flat = [w[name].reshape(w[name].size) for name in ("uw", "qg", "kt", "p")]
        _walk[walk_key][(n_hv, -(-dv // cols)), threads, stream](*flat, w["gam"], out)


def _run(inp, control, kind="decay"):
    arrays = [cuda.to_device(inp[name]) for name in ("q", "k", "v", "g", "beta")]
    n, n_hk, dk = inp["q"].shape
    n_hv, dv = inp["v"].shape[1:]
    work = {name: cuda.device_array(shape, np.float32)
            for name, shape in workspace_shapes(n, n_hk, n_hv, dk, dv).items()}
    out = cuda.device_array(inp["v"].shape, np.float32)
    gated_delta_rule_chunked(*arrays, out, work, control=kind if control else None)
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
    Case("gated_delta_rule_chunk_walk", _make_inputs, lambda i, c: _run(i, c, kind="state"), _ref_chunked,
         notes="control: the output without the entry state's read e^G Q S (the walk)"),
]
