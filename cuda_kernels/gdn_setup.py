"""The chunked delta rule's per-chunk setup (gdn_chunk's operands of the walk) in one kernel.

One block per (value head, chunk), everything in shared memory, the products on TF32 mma.sync:
  G = cumsum(g) in the chunk (parallel scan), e^G;
  P = lower(Q K^T * D) to the walk, A = strictly_lower(beta K K^T * D) (D_il = e^(G_i - G_l));
  T = (I + A)^-1 by blocked forward substitution (float32), diagonal blocks of SUB rows, then block rows;
  [U | W] = T [beta V | beta e^G K] to the walk.
q and k arrive by asynchronous 16-byte copies (mma.copy16) and v through registers, and only U, W, P and G
leave. The shared arrays share three regions (setup_layout), so that two blocks fit on an SM at dk = dv = 128.
"""

import math

import numpy as np
from numba import cuda, float32, uint64

from .core import SIMULATED, allow_shared, jit
from .mma import clock, copy16, copy_commit, copy_wait, mma_tf32

CHUNK = 4 if SIMULATED else 64         # tokens a chunk (gdn_chunk's walk takes the same)
SUB = 2 if SIMULATED else 16           # rows of the triangular solve's diagonal blocks
THREADS = 64 if SIMULATED else 256     # whole warps, at least CHUNK (the scan, the solve's columns)
STRIP = 2 if SIMULATED else 4          # n tiles of 8 columns per warp item of [U | W]: one A fragment each
# The phases a timed kernel stamps (the SM's cycle counter, thread 0 of each block; scripts/gpu_bench_delta.py)
PHASES = ("start", "scan", "staged", "grams", "k_scaled", "diagonal", "block_rows", "v_scaled", "end")


def setup_layout(dk, dv):
    """The padded sizes and the flat shared regions' float offsets, and the float count.

    cp, kp, vp: the chunk, key and value dims padded to whole tiles (zeros); row: T's and A's row stride.
    r1: Q (row stride kp + 4) for the grams, then beta e^G K (kp + 8) for [U | W];
    r2: K (kp + 4) for the grams, then T (row) and the solve's block-row sums;
    r3: A (row) for the solve, then beta V (vp + 8) for [U | W];
    g, b, e: G, beta, e^G. Strides 4 mod 32 serve fragments read along rows, 8 mod 32 down columns."""
    chunk = CHUNK
    cp, wide = -(-chunk // 16) * 16, 8 * STRIP
    kp, vp = -(-dk // wide) * wide, -(-dv // wide) * wide
    row = cp + 4
    r1 = cp * (kp + 8)
    r2 = max(cp * (kp + 4), cp * row + SUB * row)
    r3 = max(cp * row, cp * (vp + 8))
    lay = {"cp": cp, "kp": kp, "vp": vp, "row": row, "r1": 0, "r2": r1, "r3": r1 + r2, "g": r1 + r2 + r3}
    lay["b"], lay["e"] = lay["g"] + cp, lay["g"] + 2 * cp
    return lay, lay["e"] + cp


def _make_setup(control, r, dk, dv, timed=False):
    """The kernel for r value heads per key head and dims dk, dv (control: P without its decay factors;
    timed: thread 0 writes the cycle counter at each of PHASES into stamps[block])."""
    chunk, sub = CHUNK, SUB
    lay, total = setup_layout(dk, dv)
    cp, kp, vp, row = lay["cp"], lay["kp"], lay["vp"], lay["row"]
    o1, o2, o3, og, ob, oe = (lay[x] for x in ("r1", "r2", "r3", "g", "b", "e"))
    pad = chunk % 16 or dk % (8 * STRIP) or dv % (8 * STRIP)
    nt, warps = THREADS, THREADS // 32
    qs, ks, vs = kp + 4, kp + 8, vp + 8           # row strides: Q and K, beta e^G K, beta V
    nb, sq = chunk // sub, sub * sub
    wide = dv + dk
    rbs = cp // 16
    per_m = rbs * (rbs + 1)                       # lower-triangle m16n8 tiles of a cp x cp gram
    items_g, items_u = 2 * per_m, rbs * ((vp + kp) // (8 * STRIP))
    rounds_u = -(-items_u // warps)
    pairs_g = -(-items_g // (2 * warps))          # gram rounds of two tiles a warp (two accumulator chains)
    strips_v = vp // (8 * STRIP)
    strips = strips_v + kp // (8 * STRIP)
    # T is lower triangular, so a row block of [U | W] needs only the tokens up to its own end. Where the
    # warps' items are not whole row blocks' worth each (strips % warps), every item takes every step: the
    # simulator's statement of mma needs each warp of a block to issue the same count
    triangular = not SIMULATED or strips % warps == 0
    strip = STRIP
    nacc = 4 * strip
    gk = dk // 4
    kstep = nt // gk
    vstep = nt // dv                              # rows of v a pass (each thread one value column)
    per_k, per_v = -(-chunk // kstep), -(-chunk // vstep)
    u = uint64

    @jit(device=True, forceinline=True)
    def stamp(stamps, phase):
        if timed and cuda.threadIdx.x == 0:
            stamps[cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x, phase] = clock()

    @jit(device=True, forceinline=True)
    def gram_item(item):
        """(on_a, r0, n0) of gram tile `item`: P's lower-triangle tiles, then A's (row block b has 2 (b + 1))."""
        on_a = item >= per_m
        e = item - per_m if on_a else item
        rb = 0
        while e >= 2 * (rb + 1):
            e -= 2 * (rb + 1)
            rb += 1
        return on_a, 16 * rb, 8 * e

    @jit(device=True, forceinline=True)
    def gram_pair(sh, on_a, r0, n0, on_a2, r2, n2, lane):
        """Two m16n8 tiles of Q K^T (or K K^T when on_a) from the staged rows, k over kp in steps of 8, their
        two accumulator chains interleaved (one tile's mma latency hides behind the other's)."""
        rw, quad = lane // 4, lane % 4
        a = u(o2 if on_a else o1) + u(r0 + rw) * u(qs) + u(quad)
        b = u(o2) + u(n0 + rw) * u(qs) + u(quad)
        a2 = u(o2 if on_a2 else o1) + u(r2 + rw) * u(qs) + u(quad)
        b2 = u(o2) + u(n2 + rw) * u(qs) + u(quad)
        c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = float32(0.0)
        for _ in range(kp // 16):         # two k steps a pass (kp is a multiple of 16): more loads in flight
            c0, c1, c2, c3 = mma_tf32(sh[a], sh[a + u(8 * qs)], sh[a + u(4)], sh[a + u(8 * qs + 4)], sh[b],
                                      sh[b + u(4)], c0, c1, c2, c3)
            d0, d1, d2, d3 = mma_tf32(sh[a2], sh[a2 + u(8 * qs)], sh[a2 + u(4)], sh[a2 + u(8 * qs + 4)], sh[b2],
                                      sh[b2 + u(4)], d0, d1, d2, d3)
            c0, c1, c2, c3 = mma_tf32(sh[a + u(8)], sh[a + u(8 * qs + 8)], sh[a + u(12)], sh[a + u(8 * qs + 12)],
                                      sh[b + u(8)], sh[b + u(12)], c0, c1, c2, c3)
            d0, d1, d2, d3 = mma_tf32(sh[a2 + u(8)], sh[a2 + u(8 * qs + 8)], sh[a2 + u(12)],
                                      sh[a2 + u(8 * qs + 12)], sh[b2 + u(8)], sh[b2 + u(12)], d0, d1, d2, d3)
            a += u(16)
            b += u(16)
            a2 += u(16)
            b2 += u(16)
        return c0, c1, c2, c3, d0, d1, d2, d3

    @jit(device=True, forceinline=True)
    def gram_store(sh, p, pbase, on_a, r0, n0, lane, c0, c1, c2, c3):
        i, j = r0 + lane // 4, n0 + 2 * (lane % 4)
        gram_out(sh, p, pbase, on_a, i, j, c0)
        gram_out(sh, p, pbase, on_a, i, j + 1, c1)
        gram_out(sh, p, pbase, on_a, i + 8, j, c2)
        gram_out(sh, p, pbase, on_a, i + 8, j + 1, c3)

    @jit(device=True, forceinline=True)
    def gram_out(sh, p, pbase, on_a, i, j, x):
        """One gram value: A_ij = beta_i D_ij (K K^T)_ij (j < i) into shared, or P_ij to the walk's P."""
        if i < chunk and j < chunk:
            decay = math.exp(sh[u(og) + u(i)] - sh[u(og) + u(j)]) if j <= i else float32(0.0)
            if on_a:
                sh[u(o3) + u(i) * u(row) + u(j)] = sh[u(ob) + u(i)] * decay * x if j < i else float32(0.0)
            elif control:
                p[pbase + u(i) * u(chunk) + u(j)] = x if j <= i else float32(0.0)
            else:
                p[pbase + u(i) * u(chunk) + u(j)] = decay * x

    @jit(device=True, forceinline=True)
    def uw_out(uw, ubase, i, j, x):
        """One value of [U | W] (column j of the padded [beta V | beta e^G K]) to the walk's array."""
        col = j if j < vp else dv + j - vp
        if i < chunk and (j < dv or (j >= vp and j - vp < dk)):
            uw[ubase + u(i) * u(wide) + u(col)] = x

    @jit(launch_bounds=(nt, 2))
    def setup(q, k, v, g, beta, uw, p, gam, stamps):
        stamp(stamps, 0)
        hv, c, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        rw, quad = lane // 4, lane % 4
        n, slots = v.shape[0], gam.shape[1]
        hkdk = q.size // max(n, 1)                    # q and k flat: [n, key heads, dk] rows
        hk = hv // r
        t0 = c * chunk
        m = max(0, min(chunk, n - t0))
        cr = u(hv * slots + c) * u(chunk)             # the chunk's first row in the walk's arrays
        sh = cuda.shared.array(0, float32)
        if pad:                                       # tiles reach past the data: zeros there
            for idx in range(u(tid), u(total), u(nt)):
                sh[idx] = float32(0.0)
            cuda.syncthreads()
        # q and k rows by asynchronous copies, v's into registers, g and beta: all in flight together
        i0, d = u(tid // gk), u(4 * (tid % gk))
        base = (u(t0) + i0) * u(hkdk) + u(hk * dk) + d
        for j in range(per_k):
            i = i0 + u(j * kstep)
            if i < u(chunk):
                live = i < u(m)
                src = base + u(j * kstep) * u(hkdk) if live else u(0)
                copy16(sh, u(o1) + i * u(qs) + d, q, src, live)
                copy16(sh, u(o2) + i * u(qs) + d, k, src, live)
        copy_commit()
        vr = cuda.local.array(per_v, float32)
        xc = cuda.local.array(sub, float32)
        last = max(n - 1, 0)
        if tid < chunk:
            tt = min(t0 + tid, last)
            gv, bv = g[tt, hv], beta[tt, hv]
            sh[u(og) + u(tid)] = gv if tid < m else float32(0.0)
            sh[u(ob) + u(tid)] = bv if tid < m else float32(0.0)
        cuda.syncthreads()
        step = 1
        while step < chunk:                           # G: inclusive scan, Hillis-Steele
            add = sh[og + tid - step] if tid < chunk and tid >= step else float32(0.0)
            cuda.syncthreads()
            if tid < chunk:
                sh[og + tid] += add
            cuda.syncthreads()
            step *= 2
        if tid < chunk:
            gv = sh[u(og) + u(tid)]
            sh[u(oe) + u(tid)] = math.exp(gv)
            gam[hv, c, tid] = gv
        stamp(stamps, 1)
        copy_wait()
        cuda.syncthreads()
        stamp(stamps, 2)
        # the grams, lower-triangle tiles only: P to the walk, A into r3
        pbase = cr * u(chunk)
        for it in range(pairs_g):         # items warp + (2 it) warps and warp + (2 it + 1) warps
            first, second = warp + 2 * it * warps, warp + (2 * it + 1) * warps
            on_a, r0, n0 = gram_item(min(first, items_g - 1))
            on_a2, r2, n2 = gram_item(min(second, items_g - 1))
            c0, c1, c2, c3, d0, d1, d2, d3 = gram_pair(sh, on_a, r0, n0, on_a2, r2, n2, lane)
            if first < items_g:
                gram_store(sh, p, pbase, on_a, r0, n0, lane, c0, c1, c2, c3)
            if second < items_g:
                gram_store(sh, p, pbase, on_a2, r2, n2, lane, d0, d1, d2, d3)
        for idx in range(tid, chunk * chunk, nt):    # P's tiles above the diagonal blocks: zeros
            i, j = idx // chunk, idx % chunk
            if j >= 16 * (i // 16) + 16:
                p[pbase + u(idx)] = float32(0.0)
        # v's rows for beta V (in flight through the K scaling and the solve), one value column a thread
        vd, vi0 = u(tid % dv), u(tid // dv)
        for j in range(per_v):
            vr[j] = v[min(u(t0) + vi0 + u(j * vstep), u(last)), u(hv), vd]
        cuda.syncthreads()
        stamp(stamps, 3)
        # beta e^G K into r1 (Q is done with), before T takes K's place in r2
        for idx in range(u(tid), u(cp * kp), u(nt)):
            i, dd = idx // u(kp), idx % u(kp)
            live = i < u(chunk) and dd < u(dk)
            x = sh[u(o2) + i * u(qs) + dd] * sh[u(ob) + i] * sh[u(oe) + i] if live else float32(0.0)
            sh[u(o1) + i * u(ks) + dd] = x
        cuda.syncthreads()
        for idx in range(u(tid), u(cp * row), u(nt)):
            sh[u(o2) + idx] = float32(0.0)
        cuda.syncthreads()
        stamp(stamps, 4)
        # T = (I + A)^-1: the diagonal blocks, one thread per column, rows in order; the column's values
        # stay in registers (xc), each row's sum over all earlier rows of the block (the entries above the
        # column's diagonal are zero), every loop constant so that the loads of a row issue together
        ors = u(o2 + cp * row)
        if tid < chunk:
            bse, col = u(tid - tid % sub), u(tid)
            for i in range(sub):
                xc[i] = float32(0.0)
            for i in range(sub):
                ri = bse + u(i)
                s = float32(1.0) if ri == col else float32(0.0)
                arow = u(o3) + ri * u(row) + bse
                for l in range(sub):
                    if l < i:
                        s -= sh[arow + u(l)] * xc[l]
                xc[i] = s
                sh[u(o2) + ri * u(row) + col] = s
        cuda.syncthreads()
        stamp(stamps, 5)
        # block rows below: R_ij = sum_(j<=l<i) A_il T_lj, then T_ij = -T_ii R_ij, for all j < i together
        for bi in range(1, nb):
            top = u(bi * sub)
            for idx in range(tid, bi * sq, nt):
                j, e = idx // sq, idx % sq
                rr, cc = u(e // sub), u(j * sub + e % sub)
                acc = float32(0.0)
                for lb in range(j, bi):           # sub-blocks of the sum, each a constant (unrolled) run
                    l0 = u(lb * sub)
                    arow = u(o3) + (top + rr) * u(row) + l0
                    tcol = u(o2) + l0 * u(row) + cc
                    for l in range(sub):
                        acc += sh[arow + u(l)] * sh[tcol + u(l) * u(row)]
                sh[ors + rr * u(row) + cc] = acc
            cuda.syncthreads()
            for idx in range(tid, bi * sq, nt):
                j, e = idx // sq, idx % sq
                rr, cc = u(e // sub), u(j * sub + e % sub)
                acc = float32(0.0)
                for mm in range(u(sub)):
                    acc -= sh[u(o2) + (top + rr) * u(row) + top + mm] * sh[ors + mm * u(row) + cc]
                sh[u(o2) + (top + rr) * u(row) + cc] = acc
            cuda.syncthreads()
        stamp(stamps, 6)
        # beta V into r3 (A is done with)
        for j in range(per_v):            # (rows past the prompt have beta 0)
            i = vi0 + u(j * vstep)
            if i < u(chunk):
                sh[u(o3) + i * u(vs) + vd] = sh[u(ob) + i] * vr[j]
        cuda.syncthreads()
        stamp(stamps, 7)
        # [U | W] = T [beta V | beta e^G K]: each item a 16-row block by STRIP n tiles, one A fragment a step
        ubase = cr * u(wide)
        acc = cuda.local.array(nacc, float32)
        for it in range(rounds_u):
            item = min(warp + it * warps, items_u - 1)
            rb, s = item // strips, item % strips
            r0 = 16 * rb
            on_k = s >= strips_v
            n0 = 8 * strip * (s - strips_v if on_k else s)
            bst = ks if on_k else vs
            a = u(o2) + u(r0 + rw) * u(row) + u(quad)
            b = u(o1 if on_k else o3) + u(quad) * u(bst) + u(n0 + rw)
            for x in range(nacc):
                acc[x] = float32(0.0)
            steps = 2 * (rb + 1) if triangular else cp // 8
            for _ in range(steps):
                a0, a1, a2, a3 = sh[a], sh[a + u(8 * row)], sh[a + u(4)], sh[a + u(8 * row + 4)]
                for t in range(strip):
                    bt = b + u(8 * t)
                    acc[4 * t], acc[4 * t + 1], acc[4 * t + 2], acc[4 * t + 3] = mma_tf32(
                        a0, a1, a2, a3, sh[bt], sh[bt + u(4 * bst)],
                        acc[4 * t], acc[4 * t + 1], acc[4 * t + 2], acc[4 * t + 3])
                a += u(8)
                b += u(8 * bst)
            if warp + it * warps < items_u:
                i = r0 + rw
                for t in range(strip):
                    j = (vp if on_k else 0) + n0 + 8 * t + 2 * quad
                    uw_out(uw, ubase, i, j, acc[4 * t])
                    uw_out(uw, ubase, i, j + 1, acc[4 * t + 1])
                    uw_out(uw, ubase, i + 8, j, acc[4 * t + 2])
                    uw_out(uw, ubase, i + 8, j + 1, acc[4 * t + 3])
        stamp(stamps, 8)
    return setup


_setup, _no_stamps = {}, []


def chunk_setup(q, k, v, g, beta, uw, p, gam, stream=0, control=False, stamps=None):
    """uw, p and gam of gdn_chunk's workspace (flat uw and p, [heads, slots, CHUNK] gam) for every chunk,
    from q, k [n, key heads, dk] (contiguous), v [n, value heads, dv] (any strides), g, beta [n, value
    heads]. control: P without its decay factors. stamps: an int64 array [blocks, len(PHASES)] for the
    timed kernel's cycle counts (a probe), None for the plain kernel."""
    n, n_hk, dk = q.shape
    n_hv, dv = v.shape[1], v.shape[2]
    if dk % 4 or THREADS % (dk // 4) or THREADS % dv or CHUNK > THREADS or CHUNK % SUB:
        raise ValueError(f"chunk setup: key dim {dk} must be a multiple of 4 dividing 4 x {THREADS}, the value "
                         f"dim {dv} divide {THREADS}, and the chunk {CHUNK} be at most {THREADS} in whole "
                         f"blocks of {SUB}")
    key = (control, n_hv // n_hk, dk, dv, CHUNK, SUB, stamps is not None)
    if key not in _setup:
        _setup[key] = _make_setup(*key[:4], timed=key[6])
    kernel = _setup[key]
    if stamps is None:
        if not _no_stamps:
            _no_stamps.append(cuda.device_array((1, len(PHASES)), np.int64))
        stamps = _no_stamps[0]
    args = (q.reshape(q.size), k.reshape(k.size), v, g, beta, uw.reshape(uw.size), p.reshape(p.size), gam, stamps)
    nbytes = 4 * setup_layout(dk, dv)[1]
    allow_shared(kernel, args, nbytes)
    kernel[(n_hv, -(-n // CHUNK)), THREADS, stream, nbytes](*args)

