"""The Gated DeltaNet's inputs in one kernel: the causal depthwise conv + silu over the [q | k | v] channels,
the L2 norm of every q and k head (q's also scaled), and the decay / write-strength gates.

The same arithmetic as gdn.causal_conv1d, norms.l2_norm and gdn.gdn_gates in sequence (encoder.md 2.5),
in one launch instead of four: for a short prompt each of those is a few microseconds of mostly launch
and ramp. A block holds one head's dk channels (a thread each) over TOKENS tokens; a q or k head's block
sums each token's squares across its threads (all tokens' sums reduced together). Blocks past the
channels compute the gates for their tokens.
"""

import functools
import math

import numpy as np
from numba import cuda, float32, uint64

from .core import EPS32, SIMULATED, Case, gamma, jit, team_sum
from .gdn import (CONV_TOKENS, causal_conv1d_bound, causal_conv1d_reference, conv_steps, gates_at, gdn_gates_bound,
                  gdn_gates_reference)
from .norms import l2_norm_reference

TOKENS = CONV_TOKENS


def fits(dk):
    """Whether heads of dk channels make a block: whole warps on the GPU, at least a thread a token (the
    per-token scales)."""
    return TOKENS <= dk <= 1024 and (SIMULATED or dk % 32 == 0)


@functools.cache
def _make(control, width, dk, qk_heads):
    """Kernel for conv width `width`, dk channels per head, the first qk_heads heads of channels normalised
    (q then k, half each). control: k gets q's scale instead of q.

    Indices are unsigned (numba wraps negative signed ones, a dozen 64-bit integer instructions an access),
    a block whose tokens all lie in the prompt stores without per-token checks, and each token's scale
    1 / |y| is computed once a block (by thread j for token j) rather than by every thread: with per-token
    checks and signed indices Nsight Compute found the kernel bound by issue, half of its instructions
    integer ones (scripts/gpu_ncu_kernels.py)."""
    span, load, output = conv_steps(width)
    warps = max(1, dk // 32)
    shared = dk if SIMULATED else TOKENS * warps     # the simulator's team_sum needs a float per thread

    @jit(device=True, forceinline=True)
    def store(out, col, vals, t0, n):
        """vals[j] into out[t0 + j, col] for the tokens in the prompt."""
        ucol = uint64(col)
        if t0 + TOKENS <= n:
            for j in range(TOKENS):
                out[uint64(t0 + j), ucol] = vals[j]
        else:
            for j in range(TOKENS):
                if t0 + j < n:
                    out[uint64(t0 + j), ucol] = vals[j]

    @jit
    def gdn_inputs(x, w, a, b, a_log, dt_bias, q, k, v, g, beta, eps, q_scale):
        n, channels = x.shape[0], x.shape[1]
        tid, group = cuda.threadIdx.x, cuda.blockIdx.x
        t0 = cuda.blockIdx.y * TOKENS
        if group >= (channels + dk - 1) // dk:          # the gates' block for these tokens
            for h in range(tid, g.shape[1], dk):
                rate = -math.exp(a_log[h])
                bias = dt_bias[h]
                for j in range(TOKENS):
                    t = t0 + j
                    if t < n:
                        g[t, h], beta[t, h] = gates_at(a, b, t, h, rate, bias)
            return
        ch = group * dk + tid
        chc = min(ch, channels - 1)
        taps = cuda.local.array(width, float32)
        window = cuda.local.array(span, float32)
        vals = cuda.local.array(TOKENS, float32)
        sums = cuda.local.array(TOKENS, float32)
        sh = cuda.shared.array(shared, float32)
        inv = cuda.shared.array(TOKENS, float32)
        load(x, w, chc, t0, taps, window, False)
        for j in range(TOKENS):
            acc = output(taps, window, j)
            acc = acc / (float32(1.0) + math.exp(-acc))
            vals[j] = acc if ch < channels else float32(0.0)
        if group < qk_heads:                            # the whole block takes this branch
            for j in range(TOKENS):
                sums[j] = vals[j] * vals[j]
            first = (group < qk_heads // 2) != control
            scale = q_scale if first else float32(1.0)
            if SIMULATED:
                for j in range(TOKENS):
                    total = team_sum(sh, sums[j], dk)
                    if tid == j:
                        inv[j] = scale / math.sqrt(total + eps)
            else:                                       # all tokens' sums through the shuffles together
                for step in (16, 8, 4, 2, 1):
                    for j in range(TOKENS):
                        sums[j] += cuda.shfl_xor_sync(0xFFFFFFFF, sums[j], step)
                if tid % 32 == 0:
                    for j in range(TOKENS):
                        sh[j * warps + tid // 32] = sums[j]
                cuda.syncthreads()
                if tid < TOKENS:
                    total = float32(0.0)
                    for i in range(warps):
                        total += sh[tid * warps + i]
                    inv[tid] = scale / math.sqrt(total + eps)
            cuda.syncthreads()
            for j in range(TOKENS):
                vals[j] = vals[j] * inv[j]
        if ch >= channels:
            return
        half = qk_heads // 2 * dk
        if ch < half:
            store(q, ch, vals, t0, n)
        elif ch < 2 * half:
            store(k, ch - half, vals, t0, n)
        else:
            store(v, ch - 2 * half, vals, t0, n)
    return gdn_inputs


def gdn_inputs(x, w, a, b, a_log, dt_bias, q, k, v, g, beta, eps, q_scale, dk, stream=0, control=False):
    """From the input product's column blocks (any strides): x [L, C] the [q | k | v] channels (C = 2 hk dk +
    hv dv), w [C, width] the conv taps, a, b [L, H]. Writes q, k [L, hk dk] = l2_norm(silu(conv(x))) per head
    of dk channels (eps inside the root of the sum; q times q_scale), v [L, hv dv] = silu(conv(x)), and g,
    beta [L, H] as gdn.gdn_gates. control: k scaled instead of q."""
    if not fits(dk):
        raise ValueError(f"gdn_inputs: heads of {dk} channels do not make a block")
    qk_heads = 2 * q.shape[1] // dk
    grid = (-(-x.shape[1] // dk) + 1, -(-x.shape[0] // TOKENS))
    _make(control, w.shape[1], dk, qk_heads)[grid, dk, stream](x, w, a, b, a_log, dt_bias, q, k, v, g, beta,
                                                               np.float32(eps), np.float32(q_scale))


def gdn_inputs_reference(x, w, a, b, a_log, dt_bias, hk, dk, eps, q_scale):
    """(q [L, hk, dk], k, v [L, C - 2 hk dk], g, beta) in float64, from the separate ops' references."""
    y = causal_conv1d_reference(x, w)
    n, half = x.shape[0], hk * dk
    q = l2_norm_reference(y[:, :half].reshape(n, hk, dk), eps, q_scale)
    k = l2_norm_reference(y[:, half:2 * half].reshape(n, hk, dk), eps, 1.0)
    g, beta = gdn_gates_reference(a, b, a_log, dt_bias)
    return q, k, y[:, 2 * half:], g, beta


# --- contract --------------------------------------------------------------------------------------
def _sizes(size):
    """(tokens, hk, dk, hv, dv): tiny, or the 9B encoder's at 1000 tokens."""
    return (5, 2, 8, 2, 8) if size == "tiny" else (1000, 16, 128, 32, 128)


def _make_inputs(rng, size):
    n, hk, dk, hv, dv = _sizes(size)
    channels = 2 * hk * dk + hv * dv
    wide = rng.standard_normal((n, channels + 2 * hv + 3)).astype(np.float32)
    wide[:, channels:channels + hv] *= 8            # a: softplus's argument over its whole range
    wide[1, :dk] *= np.float32(1e-3)                # a small q head, where eps matters
    return {"wide": wide, "w": (rng.standard_normal((channels, 4)) * 0.5).astype(np.float32),
            "a_log": np.log(rng.uniform(1, 16, hv)).astype(np.float32),
            "dt_bias": rng.uniform(0.5, 1.5, hv).astype(np.float32), "eps": 1e-6}


def _split(inp):
    n, hk, dk, hv, dv = _sizes("tiny" if inp["wide"].shape[0] == 5 else "real")
    channels = 2 * hk * dk + hv * dv
    return n, hk, dk, hv, channels


def _run(inp, control):
    n, hk, dk, hv, channels = _split(inp)
    wide = cuda.to_device(inp["wide"])
    x, a, b = wide[:, :channels], wide[:, channels:channels + hv], wide[:, channels + hv:channels + 2 * hv]
    q, k = cuda.device_array((n, hk * dk), np.float32), cuda.device_array((n, hk * dk), np.float32)
    v = cuda.device_array((n, channels - 2 * hk * dk), np.float32)
    g, beta = cuda.device_array((n, hv), np.float32), cuda.device_array((n, hv), np.float32)
    gdn_inputs(x, cuda.to_device(inp["w"]), a, b, cuda.to_device(inp["a_log"]), cuda.to_device(inp["dt_bias"]),
               q, k, v, g, beta, inp["eps"], dk ** -0.5, dk, control=control)
    return np.concatenate([o.copy_to_host().ravel() for o in (q, k, v, g, beta)])


def _ref(inp):
    n, hk, dk, hv, channels = _split(inp)
    wide = inp["wide"]
    x, a, b = wide[:, :channels], wide[:, channels:channels + hv], wide[:, channels + hv:channels + 2 * hv]
    q, k, v, g, beta = gdn_inputs_reference(x, inp["w"], a, b, inp["a_log"], inp["dt_bias"], hk, dk, inp["eps"],
                                            dk ** -0.5)
    y = causal_conv1d_reference(x, inp["w"])
    conv = causal_conv1d_bound(x, inp["w"], y)          # per channel, as the conv's own contract
    bounds = []
    for head, scale in ((slice(0, hk * dk), dk ** -0.5), (slice(hk * dk, 2 * hk * dk), 1.0)):
        yh, ch = y[:, head].reshape(n, hk, dk), conv[:, head].reshape(n, hk, dk)
        norm = np.sqrt(np.sum(yh * yh, axis=-1, keepdims=True) + inp["eps"])
        dnorm = np.sqrt(np.sum(ch * ch, axis=-1, keepdims=True))
        out = scale * yh / norm
        # an input error d moves y / |y| by at most |d_i| / |y| + |y_i| |d| / |y|^2; then the norm's own
        # roundings (gamma_dk of the sum of squares, half of it through the root, a few more)
        bounds.append(scale * (ch + np.abs(yh) * dnorm / norm) / norm + (0.5 * gamma(dk) + 5 * EPS32) * np.abs(out))
    bounds.append(conv[:, 2 * hk * dk:])
    bounds.extend(gdn_gates_bound(a, inp["a_log"], inp["dt_bias"], g, beta))
    ref = np.concatenate([o.ravel() for o in (q, k, v, g, beta)])
    return ref, np.concatenate([o.ravel() for o in bounds]) + 1e-30


CASES = [Case("gdn_inputs", _make_inputs, _run, _ref,
              notes="conv + silu, q/k L2 norms, gates in one launch; control: k gets q's scale instead of q")]
