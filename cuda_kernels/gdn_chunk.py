"""The gated delta rule in chunks of CHUNK tokens (encoder.md 3.2), its products on tensor cores.

The same function as gdn.gated_delta_rule; the serial dependence is cut from one step per token to one
small product per chunk. Per value head and chunk, with G = cumsum(g) in the chunk and D_il = e^(G_i - G_l):
  A = strictly_lower(beta K K^T * D),  T = (I + A)^-1,  P = lower(Q K^T * D),  [U | W] = T [beta V | beta e^G K],
all of it in parallel over chunks, in one kernel (gdn_setup). Then the walk, serial over chunks, one block per
(value head, block of WALK columns of the state), its operands staged in shared memory, its products on TF32
mma.sync:
  D = U - W S,  O = e^G (Q S) + P D,  S <- e^(G_n) S + K^T (e^(G_n - G) D).
Buffers hold N + 1 chunk slots per head, the last one zero (the earlier chunk-map form's state walk needed it;
kept, unmeasured without it).
"""

import math

import numpy as np
from numba import cuda, float32, uint64

from .core import SIMULATED, Case, allow_shared, gamma, jit
from .gdn import _make_delta_inputs, delta_reference_terms
from .gdn_setup import CHUNK, chunk_setup
from .gemm import EPS_TF32
from .mma import copy16, copy_commit, copy_wait, copy_wait_prior, mma_tf32

# The walk: (state columns per block, a multiple of 32; threads per block, an even number of warps), each warp
# taking 16 x 32 strips (_strip). One block per SM at the GPU default (its staged operands take ~180 KB of
# shared memory at dk = 128): 32 value heads x 4 column blocks fill the H200's 132 SMs once.
WALK = (32, 64) if SIMULATED else (32, 512)
DK_MAX = 16 if SIMULATED else 128


# --- kernels -------------------------------------------------------------------------------------
@jit(device=True, forceinline=True)
def _strip(sh, a, a8, a4, ak, b, b4, bk, steps, c):
    """C + A B for a 16 x 32 strip, four m16n8 tiles side by side, A and B read from the flat shared array
    `sh` (mma.py's TF32 fragment layout): the lane's a0 at offset a (a1 eight rows on at a + a8, a2 four k on
    at a + a4), n tile t's b0 at b + 8 t (b1 four k on at b + b4); each of the `steps` k steps of 8 moves a
    by ak and b by bk. Each k step reads the A fragment once for four mma (12 shared loads per 4 mma).
    c and the result: the 16 accumulators, tile by tile (c[4 t : 4 t + 4] an m16n8 tile's c0..c3), written
    out by name (a tuple indexed at run time would become compare chains)."""
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


def walk_layout(cols, dk):
    """The walk's flat shared arrays: {name: (offset, row stride)} and the float count. Rows are padded to
    whole 16-row tiles (zeros), and each row stride is chosen for conflict-free fragment reads: 4 mod 32
    for A read along rows (W, Q, P), 8 mod 32 for A read down columns (K) and for every B operand. "x",
    after the rest (not zeroed): the two k halves' exchange of step (1), 512 floats per 16 x 32 strip (two
    halves of 8 values x 32 lanes, lane-linear: conflict-free)."""
    cp, kp = -(-CHUNK // 16) * 16, -(-dk // 16) * 16
    rows = {"w": (cp, kp + 4), "q": (cp, kp + 4), "k": (cp, kp + 8), "p": (cp, cp + 4), "u": (cp, cols + 8),
            "d": (cp, cols + 8), "e": (cp, cols + 8), "o": (cp, cols + 8), "s": (kp, cols + 8), "g": (2, cp),
            "x": (2 * (cp // 16) * (cols // 32) * 16, 32)}
    out, at = {}, 0
    for name, (n, stride) in rows.items():
        out[name] = (at, stride)
        at += n * stride
    return out, at


def _make_walk(control, cols, threads, dk):
    """The serial pass over chunks for one (value head, block of `cols` state columns) per block, key dim
    dk, everything it multiplies staged in shared memory (walk_layout). Each chunk:
      (1) D = U - W S, E = e^(G_n - G) D and O = e^G (Q S);
      (2) O + P D to the output, S <- e^(G_n) S + K^T E.
    Each warp takes 16 x 32 strips, four n tiles on one A fragment (_strip: 3 shared loads per mma); step
    (1)'s strips (4 of D, 4 of O at the GPU's dk = 128) have their k range in two halves, one warp each (16
    items for 16 warps), the halves' partial sums exchanged through shared memory (a barrier) and added in a
    fixed order; step (2)'s 12 strips (4 of O + P D, 8 of the state) take whole k. Warps past the last item
    compute one and store nothing, so every warp issues the same mma count (the simulator's statement of the
    instruction synchronises the block). The operands come in by asynchronous 16-byte copies (mma.copy16)
    of coalesced rows, each stage one commit group that lands while a step computes: K and P of chunk c
    during step (1) of chunk c, W, Q and U of chunk c + 1 during step (2); no registers hold them on the way.
    q and k come straight from the op's inputs, scaled by e^G in the products' epilogues.
    control: the output without the entry state's read e^G Q S."""
    lay, _ = walk_layout(cols, dk)
    cp, kp = -(-CHUNK // 16) * 16, -(-dk // 16) * 16
    warps = threads // 32
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
    def store(out, t0, hv, col0, i, j, x):
        """One output value of step (2), where it is inside the output."""
        if i < CHUNK and t0 + i < out.shape[0] and col0 + j < out.shape[2]:
            out[t0 + i, hv, col0 + j] = x

    # 16 x 32 strips (_strip). Step (1): each strip of D (the first strips1 / 2) or O has its k range in two
    # halves, items 2 s and 2 s + 1 (the same round: warps is even); half h finishes n tiles 2 h and 2 h + 1,
    # its partner's partial sums for them through "x". Step (2): a strip of O + P D (the first cp / 16 nst) or
    # of the state, whole k.
    nst = cols // 32
    strips1, strips2 = 2 * (cp // 16) * nst, (cp // 16 + kp // 16) * nst
    items1s = 2 * strips1
    srounds1, srounds2 = -(-items1s // warps), -(-strips2 // warps)
    khalf = kp // 2                                       # a multiple of 8
    ox = lay["x"][0]

    @jit(device=True, forceinline=True)
    def strips_first(sh, warp, row, quad, lane):
        """Step (1): D = U - W S and E = e^(G_n - G) D, or e^G (Q S)."""
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
        """Step (2): O + P D to the output, or the new state e^(G_n) S + K^T E."""
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
                    store(out, t0, hv, col0, i, j, c[0])
                    store(out, t0, hv, col0, i, j + 1, c[1])
                    store(out, t0, hv, col0, i + 8, j, c[2])
                    store(out, t0, hv, col0, i + 8, j + 1, c[3])
                    store(out, t0, hv, col0, i, j + 8, c[4])
                    store(out, t0, hv, col0, i, j + 9, c[5])
                    store(out, t0, hv, col0, i + 8, j + 8, c[6])
                    store(out, t0, hv, col0, i + 8, j + 9, c[7])
                    store(out, t0, hv, col0, i, j + 16, c[8])
                    store(out, t0, hv, col0, i, j + 17, c[9])
                    store(out, t0, hv, col0, i + 8, j + 16, c[10])
                    store(out, t0, hv, col0, i + 8, j + 17, c[11])
                    store(out, t0, hv, col0, i, j + 24, c[12])
                    store(out, t0, hv, col0, i, j + 25, c[13])
                    store(out, t0, hv, col0, i + 8, j + 24, c[14])
                    store(out, t0, hv, col0, i + 8, j + 25, c[15])

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
            strips_first(sh, warp, row, quad, lane)
            copy_wait()              # K and P
            cuda.syncthreads()
            if c + 1 < chunks:       # the next chunk's W, Q and U land during step (2)
                stage_wqu(sh, uw, q, cr + CHUNK, t0 + CHUNK, min(CHUNK, n - t0 - CHUNK), hkdk, qoff, wide, dv, col0,
                          tid)
            copy_commit()
            decay = math.exp(gam[hv, c, CHUNK - 1])
            strips_second(sh, out, t0, hv, col0, warp, row, quad, lane, decay)
            cuda.syncthreads()
    return walk


_walk = {}


# --- the op --------------------------------------------------------------------------------------
def workspace_shapes(n, n_hv, dk, dv):
    """Float32 work arrays of one call, N + 1 chunk slots per head: the setup's outputs, the walk's operands."""
    slots = -(-n // CHUNK) + 1
    return {"uw": (n_hv, slots, CHUNK, dv + dk), "gam": (n_hv, slots, CHUNK), "p": (n_hv, slots, CHUNK, CHUNK)}


STAGES = ("setup", "walk")


def gated_delta_rule_chunked(q, k, v, g, beta, out, work, stream=0, control=None, stages=STAGES):
    """gdn.gated_delta_rule, CHUNK tokens at a time; `work` holds the arrays of workspace_shapes. The
    products on tensor cores from TF32 inputs (float32 accumulation). control: "decay" (P without its decay
    factors) or "state" (the output without the entry state's read e^G Q S). stages: run only these of
    STAGES (to time them one by one)."""
    dk = q.shape[2]
    n_hv, dv = v.shape[1], v.shape[2]
    cols, threads = WALK
    if dk % 8 or dk > DK_MAX or dv % 4 or cols % 32 or threads % 64 or threads % (dk // 4) \
            or threads % (CHUNK // 4) or threads % (cols // 4):
        raise ValueError(f"chunked delta rule: key dim {dk} must be a multiple of 8 up to {DK_MAX} and the value "
                         f"dim {dv} of 4; walk {WALK} needs columns in 32s and an even number of warps, a multiple "
                         "of a quarter of the key dim, of the chunk and of its columns")
    walk_key = (control == "state", cols, threads, dk)
    if walk_key not in _walk:
        _walk[walk_key] = _make_walk(*walk_key)
    if "setup" in stages:
        chunk_setup(q, k, v, g, beta, work["uw"], work["p"], work["gam"], stream=stream, control=control == "decay")
    if "walk" in stages:
        args = (work["uw"].reshape(work["uw"].size), work["p"].reshape(work["p"].size), q.reshape(q.size),
                k.reshape(k.size), work["gam"], out)
        nbytes = 4 * walk_layout(cols, dk)[1]
        allow_shared(_walk[walk_key], args, nbytes)
        _walk[walk_key][(n_hv, -(-dv // cols)), threads, stream, nbytes](*args)


def _run(inp, control, kind="decay"):
    arrays = [cuda.to_device(inp[name]) for name in ("q", "k", "v", "g", "beta")]
    n, _, dk = inp["q"].shape
    n_hv, dv = inp["v"].shape[1:]
    work = {name: cuda.device_array(shape, np.float32) for name, shape in workspace_shapes(n, n_hv, dk, dv).items()}
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
         notes="control: the within-chunk read P without its decay factors (the setup)"),
    Case("gated_delta_rule_chunk_walk", _make_inputs, lambda i, c: _run(i, c, kind="state"), _ref_chunked,
         notes="control: the output without the entry state's read e^G Q S (the walk)"),
]
