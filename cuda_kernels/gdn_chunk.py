"""The gated delta rule in chunks (encoder.md 3.2): the same function as gdn.gated_delta_rule, with the
serial dependence cut from one per token to one per CHUNK tokens. Correct (its contract passes at real
shapes) but, as written here in float32 SIMT, slower than the token recurrence on the H200, so the op
table does not use it yet (BENCHMARKS.md).

prep, parallel over (value head, chunk): G = cumsum(g) in the chunk, D_ij = e^(G_i - G_j) (j <= i),
  A = strictly_lower(beta K K^T * D), P = lower(Q K^T * D), and by forward substitution on (I + A)
  U = (I + A)^-1 beta V, W = (I + A)^-1 beta e^G K.
scan, sequential over chunks with the state columns in registers (as in gdn):
  V' = U - W S;  O = e^G Q S + P V';  S <- e^(G_n) S + (e^(G_n - G) K)^T V'.
"""

import math

import numpy as np
from numba import cuda, float32

from .core import SIMULATED, Case, jit
from .gdn import PARTS, THREADS, _make_delta_inputs, _ref_delta

CHUNK = 4 if SIMULATED else 32
PREP_THREADS = 32 if SIMULATED else 256


def _make_prep(control, dk):
    row = dk + 1        # padded rows: the K K^T loop reads a column of kc across the warp

    @jit
    def prep(q, k, v, g, beta, gam, u, w, p):
        hv, c, tid, nt = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x, cuda.blockDim.x
        n, n_hk = q.shape[0], q.shape[1]
        n_hv, dv = v.shape[1], v.shape[2]
        hk = hv // (n_hv // n_hk)
        t0 = c * CHUNK
        m = min(CHUNK, n - t0)
        kc = cuda.shared.array((CHUNK, row), float32)
        qc = cuda.shared.array((CHUNK, row), float32)
        a = cuda.shared.array((CHUNK, CHUNK), float32)
        gs = cuda.shared.array(CHUNK, float32)
        bs = cuda.shared.array(CHUNK, float32)
        for idx in range(tid, CHUNK * dk, nt):
            r, d = idx // dk, idx % dk
            kc[r, d] = k[t0 + r, hk, d] if r < m else float32(0.0)
            qc[r, d] = q[t0 + r, hk, d] if r < m else float32(0.0)
        if tid == 0:
            acc = float32(0.0)
            for r in range(CHUNK):
                if r < m:
                    acc += g[t0 + r, hv]
                gs[r] = acc
                bs[r] = beta[t0 + r, hv] if r < m else float32(0.0)
        cuda.syncthreads()
        for r in range(tid, m, nt):
            gam[t0 + r, hv] = gs[r]
        for idx in range(tid, CHUNK * CHUNK, nt):
            i, j = idx // CHUNK, idx % CHUNK
            kk = float32(0.0)
            qk = float32(0.0)
            for d in range(dk):
                kk += kc[i, d] * kc[j, d]
                qk += qc[i, d] * kc[j, d]
            decay = math.exp(gs[i] - gs[j]) if j <= i else float32(0.0)
            a[i, j] = bs[i] * kk * decay if j < i else float32(0.0)
            p[hv, c, i, j] = qk * (float32(1.0) if control else decay)
        cuda.syncthreads()
        # forward substitution, one column of [beta V | beta e^G K] per thread; rows already solved are
        # read back from this thread's own writes
        for col in range(tid, dv + dk, nt):
            for i in range(CHUNK):
                if col < dv:
                    acc = bs[i] * (v[t0 + i, hv, col] if i < m else float32(0.0))
                else:
                    acc = bs[i] * math.exp(gs[i]) * kc[i, col - dv]
                for j in range(i):
                    acc -= a[i, j] * (u[hv, c, j, col] if col < dv else w[hv, c, j, col - dv])
                if col < dv:
                    u[hv, c, i, col] = acc
                else:
                    w[hv, c, i, col - dv] = acc
    return prep


def _make_scan(per, parts, dk):
    columns = THREADS // parts

    @jit(device=True)
    def column_sum(red, tid, first, value):
        if SIMULATED:
            red[tid] = value
            cuda.syncthreads()
            total = float32(0.0)
            for p in range(parts):
                total += red[first + p]
            cuda.syncthreads()
            return total
        step = 1
        while step < parts:
            value += cuda.shfl_xor_sync(0xFFFFFFFF, value, step)
            step *= 2
        return value

    @jit
    def scan(q, k, gam, u, w, p, out):
        hv, tid = cuda.blockIdx.x, cuda.threadIdx.x
        part, slot = tid % parts, tid // parts
        col = cuda.blockIdx.y * columns + slot
        n, n_hk = q.shape[0], q.shape[1]
        n_hv, dv = u.shape[0], u.shape[3]
        hk = hv // (n_hv // n_hk)
        first = tid - part
        active = col < dv
        cv = col if active else 0
        red = cuda.shared.array(THREADS, float32)
        buf = cuda.shared.array((CHUNK, dk), float32)
        pc = cuda.shared.array((CHUNK, CHUNK), float32)
        vn = cuda.shared.array((CHUNK, columns), float32)
        gs = cuda.shared.array(CHUNK, float32)
        state = cuda.local.array(per, float32)
        for i in range(per):
            state[i] = float32(0.0)
        for c in range((n + CHUNK - 1) // CHUNK):
            t0 = c * CHUNK
            m = min(CHUNK, n - t0)
            cuda.syncthreads()
            for idx in range(tid, CHUNK * dk, THREADS):
                r, d = idx // dk, idx % dk
                buf[r, d] = w[hv, c, r, d]
            for idx in range(tid, CHUNK * CHUNK, THREADS):
                r, j = idx // CHUNK, idx % CHUNK
                pc[r, j] = p[hv, c, r, j]
            for r in range(tid, CHUNK, THREADS):
                gs[r] = gam[t0 + min(r, m - 1), hv]
            cuda.syncthreads()
            # V' = U - W S with the entry state
            for r in range(CHUNK):
                s = float32(0.0)
                for i in range(per):
                    s += buf[r, i * parts + part] * state[i]
                s = column_sum(red, tid, first, s)
                if part == 0:
                    vn[r, slot] = u[hv, c, r, cv] - s
            cuda.syncthreads()
            for idx in range(tid, CHUNK * dk, THREADS):
                r, d = idx // dk, idx % dk
                buf[r, d] = math.exp(gs[r]) * q[t0 + r, hk, d] if r < m else float32(0.0)
            cuda.syncthreads()
            # O = e^G Q S + P V'
            for r in range(CHUNK):
                s = float32(0.0)
                for i in range(per):
                    s += buf[r, i * parts + part] * state[i]
                for j in range(part, r + 1, parts):
                    s += pc[r, j] * vn[j, slot]
                s = column_sum(red, tid, first, s)
                if part == 0 and active and r < m:
                    out[t0 + r, hv, col] = s
            cuda.syncthreads()
            last = gs[CHUNK - 1]
            for idx in range(tid, CHUNK * dk, THREADS):
                r, d = idx // dk, idx % dk
                buf[r, d] = math.exp(last - gs[r]) * k[t0 + r, hk, d] if r < m else float32(0.0)
            cuda.syncthreads()
            # S <- e^(G_n) S + (e^(G_n - G) K)^T V'
            decay = math.exp(last)
            for i in range(per):
                s = decay * state[i]
                for r in range(CHUNK):
                    s += buf[r, i * parts + part] * vn[r, slot]
                state[i] = s
    return scan


_prep, _scan = {}, {}


def workspace_shapes(n, n_hv, dk, dv):
    """Float32 work arrays the chunked rule needs: G [L, Hv], U, W, P per (head, chunk)."""
    chunks = (n + CHUNK - 1) // CHUNK
    return {"gam": (n, n_hv), "u": (n_hv, chunks, CHUNK, dv), "w": (n_hv, chunks, CHUNK, dk),
            "p": (n_hv, chunks, CHUNK, CHUNK)}


def gated_delta_rule_chunked(q, k, v, g, beta, out, work, stream=0, control=False):
    """gdn.gated_delta_rule, CHUNK tokens at a time; `work` holds the arrays of workspace_shapes."""
    n, dk, n_hv, dv = q.shape[0], q.shape[2], v.shape[1], v.shape[2]
    parts = next((p for p in PARTS if dk % p == 0), None)
    if parts is None:
        raise ValueError(f"gated_delta_rule: key head dim {dk} must be a multiple of one of {PARTS}")
    chunks = (n + CHUNK - 1) // CHUNK
    key = (control, dk)
    if key not in _prep:
        _prep[key] = _make_prep(control, dk)
    _prep[key][(n_hv, chunks), PREP_THREADS, stream](q, k, v, g, beta, work["gam"], work["u"], work["w"],
                                                      work["p"])
    skey = (dk // parts, parts, dk)
    if skey not in _scan:
        _scan[skey] = _make_scan(*skey)
    columns = THREADS // parts
    _scan[skey][(n_hv, (dv + columns - 1) // columns), THREADS, stream](q, k, work["gam"], work["u"], work["w"],
                                                                         work["p"], out)


def _run(inp, control):
    arrays = [cuda.to_device(inp[name]) for name in ("q", "k", "v", "g", "beta")]
    n, _, dk = inp["q"].shape
    n_hv, dv = inp["v"].shape[1:]
    work = {name: cuda.device_array(shape, np.float32) for name, shape in workspace_shapes(n, n_hv, dk, dv).items()}
    out = cuda.device_array(inp["v"].shape, np.float32)
    gated_delta_rule_chunked(*arrays, out, work, control=control)
    return out.copy_to_host()


# the reference and its gate are the recurrent rule's: both forms compute the same function
CASES = [Case("gated_delta_rule_chunked", _make_delta_inputs, _run, _ref_delta,
              notes="control: the within-chunk read P without its decay factors")]
