"""Gated DeltaNet: the causal depthwise conv (+ silu) and the gated delta rule with a float32 state.

The delta rule runs the recurrence (encoder.md 2.5 step 6) a few tokens at a time. Each column c of a
value head's state S [dk, dv] evolves on its own, so a few threads share one column, each holding
dk / parts rows of it in registers; the dot products with S are summed across the parts.
"""

import math

import numpy as np
from numba import cuda, float32

from .core import EPS32, SIMULATED, Case, gamma, jit

# threads per state column, the first that divides dk (8 measured faster than 32 on the H200)
PARTS = (8, 4, 2, 1)
THREADS = 32 if SIMULATED else 128   # threads per block (whole warps: the shuffles need all lanes)
TILE = 4 if SIMULATED else 32        # tokens staged in shared memory at a time
GROUP = 2 if SIMULATED else 8        # tokens whose reads of the state are resolved together
CONV_TOKENS = 2 if SIMULATED else 16  # tokens per thread in the conv


def _make_conv(control, width):
    """The conv for kernel width `width` (unrolled): each thread runs one channel over CONV_TOKENS
    consecutive tokens, keeping the taps and the last `width` inputs in registers."""
    @jit
    def causal_conv1d(x, w, out, activate):
        n, n_ch = x.shape[0], x.shape[1]
        ch = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if ch >= n_ch:
            return
        taps = cuda.local.array(width, float32)
        window = cuda.local.array(width, float32)
        for j in range(width):
            taps[j] = w[ch, width - 1 - j] if control else w[ch, j]
        t0 = cuda.blockIdx.y * CONV_TOKENS
        for j in range(width - 1):          # the inputs before t0, zero before the sequence
            src = t0 - (width - 1) + j
            window[j] = x[src, ch] if src >= 0 else float32(0.0)
        for t in range(t0, min(t0 + CONV_TOKENS, n)):
            window[width - 1] = x[t, ch]
            acc = float32(0.0)
            for j in range(width):
                acc += taps[j] * window[j]
            if activate:
                acc = acc / (float32(1.0) + math.exp(-acc))
            out[t, ch] = acc
            for j in range(width - 1):
                window[j] = window[j + 1]
    return causal_conv1d


def _make_delta_rule(control, per, parts):
    """The kernel for dk = per * parts: each thread keeps `per` state rows (rows part, part + parts, ...)
    of one column in registers. Tokens go GROUP at a time: with S the state before the group and G the
    cumulative log decay inside it, token j's read of the state is e^G_j S^T k_j plus the earlier writes
    of the group, sum_(l<j) e^(G_j - G_l) (k_l . k_j) delta_l, so the group needs 2 GROUP dot products
    with S (summed across the parts together) and a GROUP-step scalar substitution, not GROUP serial
    reductions. TILE tokens of k, q, v, g, beta and the groups' k.k and k.q coefficients sit in shared
    memory. On the GPU the parts of one column sit in one warp and sum by shuffles; the simulator (no
    shuffles) sums through shared memory. control: a token's output leaves out its own write.
    """
    dk, columns = per * parts, THREADS // parts
    row = dk + 1                 # padded rows: the coefficient loop walks a column of ks across threads
    groups = TILE // GROUP

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
    def gated_delta_rule(q, k, v, g, beta, out):
        hv, tid = cuda.blockIdx.x, cuda.threadIdx.x
        part, slot = tid % parts, tid // parts
        col0 = cuda.blockIdx.y * columns
        col = col0 + slot
        n, n_hk = q.shape[0], q.shape[1]
        n_hv, dv = v.shape[1], v.shape[2]
        hk = hv // (n_hv // n_hk)
        first = tid - part
        red = cuda.shared.array(THREADS, float32)
        ks = cuda.shared.array((TILE, row), float32)
        qs = cuda.shared.array((TILE, row), float32)
        vs = cuda.shared.array((TILE, columns), float32)
        cum = cuda.shared.array(TILE, float32)       # G inside each group
        bs = cuda.shared.array(TILE, float32)
        eg = cuda.shared.array(TILE, float32)        # e^G
        ew = cuda.shared.array(TILE, float32)        # e^(G_last - G): a write's decay to the group's end
        ckk = cuda.shared.array((TILE, GROUP), float32)   # beta_j e^(G_j - G_l) k_l . k_j, l < j
        cqk = cuda.shared.array((TILE, GROUP), float32)   # e^(G_j - G_l) k_l . q_j, l <= j
        state = cuda.local.array(per, float32)
        a = cuda.local.array(GROUP, float32)
        b = cuda.local.array(GROUP, float32)
        delta = cuda.local.array(GROUP, float32)
        for i in range(per):
            state[i] = float32(0.0)
        for t0 in range(0, n, TILE):
            cuda.syncthreads()              # every thread is done with the previous tile
            for idx in range(tid, TILE * dk, THREADS):
                r, c = idx // dk, idx % dk
                ks[r, c] = k[t0 + r, hk, c] if t0 + r < n else float32(0.0)
                qs[r, c] = q[t0 + r, hk, c] if t0 + r < n else float32(0.0)
            for idx in range(tid, TILE * columns, THREADS):
                r, c = idx // columns, idx % columns
                vs[r, c] = v[t0 + r, hv, col0 + c] if t0 + r < n and col0 + c < dv else float32(0.0)
            for r in range(tid, TILE, THREADS):
                cum[r] = g[t0 + r, hv] if t0 + r < n else float32(0.0)
                bs[r] = beta[t0 + r, hv] if t0 + r < n else float32(0.0)
            cuda.syncthreads()
            for grp in range(tid, groups, THREADS):
                j0 = grp * GROUP
                for j in range(1, GROUP):
                    cum[j0 + j] += cum[j0 + j - 1]
            cuda.syncthreads()
            for r in range(tid, TILE, THREADS):
                eg[r] = math.exp(cum[r])
                ew[r] = math.exp(cum[r - r % GROUP + GROUP - 1] - cum[r])
            for idx in range(tid, TILE * GROUP, THREADS):
                r, l = idx // GROUP, idx % GROUP
                j = r % GROUP
                src = r - j + l
                kk = float32(0.0)
                qk = float32(0.0)
                for d in range(dk):
                    kk += ks[src, d] * ks[r, d]
                    qk += ks[src, d] * qs[r, d]
                decay = math.exp(cum[r] - cum[src]) if l <= j else float32(0.0)
                ckk[r, l] = bs[r] * decay * kk if l < j else float32(0.0)
                cqk[r, l] = decay * qk if (l < j if control else l <= j) else float32(0.0)
            cuda.syncthreads()
            for grp in range(groups):
                j0 = grp * GROUP
                for j in range(GROUP):
                    a[j] = float32(0.0)
                    b[j] = float32(0.0)
                for i in range(per):
                    s = state[i]
                    for j in range(GROUP):
                        a[j] += s * ks[j0 + j, i * parts + part]
                        b[j] += s * qs[j0 + j, i * parts + part]
                for j in range(GROUP):
                    a[j] = column_sum(red, tid, first, a[j])
                    b[j] = column_sum(red, tid, first, b[j])
                for j in range(GROUP):
                    d = bs[j0 + j] * (vs[j0 + j, slot] - eg[j0 + j] * a[j])
                    for l in range(j):
                        d -= ckk[j0 + j, l] * delta[l]
                    delta[j] = d
                for j in range(GROUP):
                    o = eg[j0 + j] * b[j]
                    for l in range(GROUP):
                        o += cqk[j0 + j, l] * delta[l]
                    if part == 0 and col < dv and t0 + j0 + j < n:
                        out[t0 + j0 + j, hv, col] = o
                decay = eg[j0 + GROUP - 1]
                for l in range(GROUP):
                    delta[l] *= ew[j0 + l]
                for i in range(per):
                    s = decay * state[i]
                    for l in range(GROUP):
                        s += ks[j0 + l, i * parts + part] * delta[l]
                    state[i] = s
    return gated_delta_rule


def _make_gates(control):
    @jit
    def gdn_gates(a, b, a_log, dt_bias, g, beta):
        h = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if h >= g.shape[1]:
            return
        rate = -math.exp(a_log[h])
        bias = float32(0.0) if control else dt_bias[h]
        for t in range(cuda.blockIdx.y, g.shape[0], cuda.gridDim.y):
            s = a[t, h] + bias
            g[t, h] = rate * (s if s > float32(20.0) else math.log1p(math.exp(s)))
            beta[t, h] = float32(1.0) / (float32(1.0) + math.exp(-b[t, h]))
    return gdn_gates


_gates = {c: _make_gates(c) for c in (False, True)}
_conv = {}
_delta = {}


def gdn_gates(a, b, a_log, dt_bias, g, beta, stream=0, control=False):
    """g = -exp(A_log) softplus(a + dt_bias) (torch's softplus: x itself above 20), beta = sigmoid(b);
    a, b [L, H] of any strides (column blocks of the input product), A_log, dt_bias [H]; g, beta [L, H]."""
    n, heads = g.shape
    threads = 32 if heads <= 32 else 128
    grid = ((heads + threads - 1) // threads, max(1, min(n, 2 if SIMULATED else 65535)))
    _gates[control][grid, threads, stream](a, b, a_log, dt_bias, g, beta)


def causal_conv1d(x, w, out, activate=True, stream=0, control=False):
    """out[t, c] = (silu of) sum_j w[c, j] x[t - K + 1 + j, c], zero history; x [L, C], w [C, K]."""
    key = (control, w.shape[1])
    if key not in _conv:
        _conv[key] = _make_conv(*key)
    threads = 32 if SIMULATED else 256
    grid = ((x.shape[1] + threads - 1) // threads, (x.shape[0] + CONV_TOKENS - 1) // CONV_TOKENS)
    _conv[key][grid, threads, stream](x, w, out, bool(activate))


def gated_delta_rule(q, k, v, g, beta, out, stream=0, control=False):
    """out [L, Hv, dv] from q, k [L, Hk, dk] (normed, scaled), v [L, Hv, dv], log-decay g and beta [L, Hv].

    Per value head j (reading q/k head j // (Hv / Hk)), S_0 = 0, float32 throughout:
    S <- e^g S;  S <- S + k beta (v - S^T k);  o = S^T q (the updated state).
    """
    dk, dv = q.shape[2], v.shape[2]
    parts = next((p for p in PARTS if dk % p == 0), None)
    if parts is None:
        raise ValueError(f"gated_delta_rule: key head dim {dk} must be a multiple of one of {PARTS}")
    key = (control, dk // parts, parts)
    if key not in _delta:
        _delta[key] = _make_delta_rule(*key)
    columns = THREADS // parts
    grid = (v.shape[1], (dv + columns - 1) // columns)   # value heads x column groups
    _delta[key][grid, THREADS, stream](q, k, v, g, beta, out)


# --- float64 references --------------------------------------------------------------------------
def causal_conv1d_reference(x, w, activate=True):
    x, w = x.astype(np.float64), w.astype(np.float64)
    n, width = x.shape[0], w.shape[1]
    pad = np.concatenate([np.zeros((width - 1, x.shape[1])), x])
    y = sum(w[:, j] * pad[j:j + n] for j in range(width))
    return y / (1 + np.exp(-y)) if activate else y


def gdn_gates_reference(a, b, a_log, dt_bias):
    a, b, a_log, dt_bias = (x.astype(np.float64) for x in (a, b, a_log, dt_bias))
    s = a + dt_bias
    return -np.exp(a_log) * np.where(s > 20, s, np.log1p(np.exp(np.minimum(s, 20)))), 1 / (1 + np.exp(-b))


def gated_delta_rule_reference(q, k, v, g, beta):
    """The recurrence itself; also returns sum_i |S_t[i, c] q_i| per output, the size of its terms."""
    q, k, v, g, beta = (a.astype(np.float64) for a in (q, k, v, g, beta))
    n, n_hk, dk = q.shape
    n_hv, dv = v.shape[1:]
    out, mag = np.zeros((n, n_hv, dv)), np.zeros((n, n_hv, dv))
    for j in range(n_hv):
        h = j // (n_hv // n_hk)
        s = np.zeros((dk, dv))
        for t in range(n):
            s = np.exp(g[t, j]) * s
            s = s + np.outer(k[t, h], beta[t, j] * (v[t, j] - s.T @ k[t, h]))
            out[t, j] = s.T @ q[t, h]
            mag[t, j] = np.abs(s).T @ np.abs(q[t, h])
    return out, mag


# --- contract ------------------------------------------------------------------------------------
def _make_conv_inputs(rng, size):
    n, ch = (5, 12) if size == "tiny" else (1000, 8192)
    return {"x": rng.standard_normal((n, ch)).astype(np.float32),
            "w": (rng.standard_normal((ch, 4)) * 0.5).astype(np.float32)}


def _run_conv(inp, control):
    x, w = cuda.to_device(inp["x"]), cuda.to_device(inp["w"])
    out = cuda.device_array(inp["x"].shape, np.float32)
    causal_conv1d(x, w, out, control=control)
    return out.copy_to_host()


def _ref_conv(inp):
    ref = causal_conv1d_reference(inp["x"], inp["w"])
    terms = causal_conv1d_reference(np.abs(inp["x"]), np.abs(inp["w"]), activate=False)
    # the K-term sum carries gamma_K of its terms; silu's slope is below 1.1; exp, division: 4 roundings
    return ref, 1.1 * gamma(inp["w"].shape[1]) * terms + 8 * EPS32 * np.abs(ref) + 1e-30


def _make_delta_inputs(rng, size):
    n, hk, hv, dk, dv = (6, 2, 4, 8, 4) if size == "tiny" else (1000, 16, 32, 128, 128)

    def unit(a):
        return a / np.linalg.norm(a, axis=-1, keepdims=True)
    return {"q": (unit(rng.standard_normal((n, hk, dk))) * dk ** -0.5).astype(np.float32),
            "k": unit(rng.standard_normal((n, hk, dk))).astype(np.float32),
            "v": rng.standard_normal((n, hv, dv)).astype(np.float32),
            "g": -rng.uniform(0.0, 0.5, (n, hv)).astype(np.float32),
            "beta": rng.uniform(0.0, 1.0, (n, hv)).astype(np.float32)}


def _run_delta(inp, control):
    arrays = [cuda.to_device(inp[name]) for name in ("q", "k", "v", "g", "beta")]
    out = cuda.device_array(inp["v"].shape, np.float32)
    gated_delta_rule(*arrays, out, control=control)
    return out.copy_to_host()


def delta_reference_terms(inp):
    """The float64 recurrence and the size of each output's terms: sum |S q| plus what a write of |v|
    can put through q."""
    ref, mag = gated_delta_rule_reference(*(inp[n] for n in ("q", "k", "v", "g", "beta")))
    return ref, mag + np.abs(inp["v"]).max() * np.abs(inp["q"]).sum(-1).max()


def _ref_delta(inp):
    ref, terms = delta_reference_terms(inp)
    n, dk = inp["q"].shape[0], inp["q"].shape[2]
    # each step rounds every state entry a few times (terms up to |S| and |v|) and the step map
    # e^g (I - beta k k^T) does not expand, so the error grows at most linearly: gamma_(t + dk), x4 slack
    steps = np.arange(1, n + 1)[:, None, None] + dk
    return ref, 4 * gamma(steps) * terms + 1e-30


def _make_gates_inputs(rng, size):
    n, h = (5, 4) if size == "tiny" else (1000, 32)
    return {"ab": (rng.standard_normal((n, 2 * h + 3)) * 8).astype(np.float32),
            "a_log": np.log(rng.uniform(1, 16, h)).astype(np.float32),
            "dt_bias": rng.uniform(0.5, 1.5, h).astype(np.float32)}


def _run_gates(inp, control):
    """a and b as column blocks of a wider product output, as the fused input projection leaves them."""
    h = inp["a_log"].size
    ab = cuda.to_device(inp["ab"])
    g = cuda.device_array((ab.shape[0], h), np.float32)
    beta = cuda.device_array((ab.shape[0], h), np.float32)
    gdn_gates(ab[:, 3:3 + h], ab[:, 3 + h:], cuda.to_device(inp["a_log"]), cuda.to_device(inp["dt_bias"]),
              g, beta, control=control)
    return np.concatenate([g.copy_to_host(), beta.copy_to_host()], axis=1)


def _ref_gates(inp):
    h = inp["a_log"].size
    g, beta = gdn_gates_reference(inp["ab"][:, 3:3 + h], inp["ab"][:, 3 + h:], inp["a_log"], inp["dt_bias"])
    ref = np.concatenate([g, beta], axis=1)
    # exp, log1p, a sum, a product, a division: each a float32 rounding or within 2 ulp; softplus's
    # argument carries one rounding of |a| + |dt_bias| (its slope is below 1)
    s = np.abs(inp["ab"][:, 3:3 + h].astype(np.float64)) + np.abs(inp["dt_bias"])
    arg = np.concatenate([EPS32 * s * np.exp(inp["a_log"].astype(np.float64)), 0 * s], axis=1)
    return ref, 10 * EPS32 * np.abs(ref) + arg + 1e-30


CASES = [
    Case("gdn_gates", _make_gates_inputs, _run_gates, _ref_gates, notes="control: dt_bias left out"),
    Case("causal_conv1d_silu", _make_conv_inputs, _run_conv, _ref_conv,
         notes="control: the taps reversed (correlation instead of the causal convolution)"),
    Case("gated_delta_rule", _make_delta_inputs, _run_delta, _ref_delta,
         notes="control: reads the output with the state before the delta write"),
]
