"""Gated DeltaNet ops (Qwen3.5 linear attention): causal depthwise conv, L2 norm, delta rule, gated norm."""

import numpy as np

# Chunk length of the chunked delta rule (HF's torch_chunk_gated_delta_rule and FLA use 64).
DELTA_CHUNK = 64


class GdnOps:
    dtype: np.dtype

    def causal_conv1d(self, x, w, activate=False):
        """Depthwise causal conv over time: x [L, C], w [C, K] -> [L, C], zero history, silu if `activate`.

        out[t, c] = sum_j w[c, j] * x[t - K + 1 + j, c]; tap K-1 multiplies the current token.
        """
        L, K = x.shape[0], w.shape[1]
        padded = np.concatenate([np.zeros((K - 1, x.shape[1]), dtype=x.dtype), x], axis=0)
        out = np.zeros_like(x)
        for j in range(K):
            out += padded[j:j + L] * w[:, j]
        return self.silu(out) if activate else out

    def l2_norm(self, x, eps, scale=1.0):
        """x / sqrt(sum(x^2) + eps) over the last axis (eps inside the root of the sum, as FLA does), times scale."""
        out = x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + self.dtype.type(eps))
        return out if scale == 1.0 else out * self.dtype.type(scale)

    def gdn_gates(self, a, b, a_log, dt_bias):
        """The delta rule's log-decay g = -exp(A_log) softplus(a + dt_bias) and write strength sigmoid(b), [L, H]."""
        rate = self.scale(self.exp(a_log), -1.0)
        return rate * self.softplus(a + dt_bias), self.sigmoid(b)

    def gdn_inputs(self, mixed, conv_w, a, b, a_log, dt_bias, heads, eps):
        """The delta rule's inputs from the input product: mixed [L, 2 hk dk + hv dv] through the causal conv
        + silu, split into q, k [L, hk, dk] (each head L2-normed, q also times dk^-0.5) and v [L, hv, dv];
        g, beta from a, b (gdn_gates). heads = (hk, dk, hv, dv). One op so that a GPU table can fuse it."""
        hk, dk, hv, dv = heads
        L = mixed.shape[0]
        mixed = self.causal_conv1d(mixed, conv_w, activate=True)
        q, k, v = self.split(mixed, (hk * dk, hk * dk, hv * dv))
        q = self.l2_norm(self.reshape(q, (L, hk, dk)), eps, scale=dk ** -0.5)
        k = self.l2_norm(self.reshape(k, (L, hk, dk)), eps)
        g, beta = self.gdn_gates(a, b, a_log, dt_bias)
        return q, k, self.reshape(v, (L, hv, dv)), g, beta

    def gated_rms_norm(self, x, z, w, eps, operand=False):
        """w * x / sqrt(mean(x^2) + eps) * silu(z) over the last axis: the GDN output norm (plain w, norm then gate).

        `operand=True`: the result only feeds products (see swiglu)."""
        r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.dtype.type(eps))
        return (w * (x * r)) * (z / (1.0 + np.exp(-z)))

    def gated_delta_rule(self, q, k, v, g, beta, form="chunk"):
        """Gated delta rule from a zero state: q, k [L, Hk, dk], v [L, Hv, dv], g, beta [L, Hv] -> [L, Hv, dv].

        Per value head j (reading key head j // (Hv // Hk)), state S [dk, dv], for each token t:
        S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t.
        "recurrent" runs that loop; "chunk" is the same algebra DELTA_CHUNK tokens at a time.
        """
        group = v.shape[1] // k.shape[1]
        # head-major [Hv, L, d], keys and queries repeated onto their value heads
        qh = np.repeat(np.transpose(q, (1, 0, 2)), group, axis=0)
        kh = np.repeat(np.transpose(k, (1, 0, 2)), group, axis=0)
        vh = np.transpose(v, (1, 0, 2))
        gh = np.ascontiguousarray(g.T)
        bh = np.ascontiguousarray(beta.T)
        if form == "recurrent":
            out = _recurrent(qh, kh, vh, gh, bh)
        elif form == "chunk":
            out = _chunked(qh, kh, vh, gh, bh, DELTA_CHUNK)
        else:
            raise ValueError(f"unknown delta rule form {form!r}")
        return np.ascontiguousarray(np.transpose(out, (1, 0, 2)))


def _recurrent(q, k, v, g, beta):
    """The defining loop, all value heads at once: q, k [H, L, dk], v [H, L, dv], g, beta [H, L]."""
    H, L, dk = k.shape
    state = np.zeros((H, dk, v.shape[2]), dtype=v.dtype)
    out = np.empty_like(v)
    for t in range(L):
        state = state * np.exp(g[:, t])[:, None, None]
        predicted = np.einsum("hkv,hk->hv", state, k[:, t])
        delta = beta[:, t, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = np.einsum("hkv,hk->hv", state, q[:, t])
    return out


def _chunked(q, k, v, g, beta, size):
    """The WY/UT chunked form (encoder.md 3.2): within a chunk the writes solve one unit-triangular system.

    With G = cumsum(g) in the chunk and D_ij = exp(G_i - G_j) for j <= i:
    (I + strictly_lower(beta K K^T * D)) delta = beta V - beta exp(G) K S, then
    O = exp(G) Q S + lower(Q K^T * D) delta and S' = exp(G_n) S + (exp(G_n - G) K)^T delta.
    """
    H, L, dk = k.shape
    state = np.zeros((H, dk, v.shape[2]), dtype=v.dtype)
    out = np.empty_like(v)
    for start in range(0, L, size):
        stop = min(start + size, L)
        n = stop - start
        qc, kc, vc = q[:, start:stop], k[:, start:stop], v[:, start:stop]
        bc = beta[:, start:stop, None]
        cum = np.cumsum(g[:, start:stop], axis=1)                      # [H, n]
        lower = np.tril(np.ones((n, n), dtype=bool))
        # exponent masked before exp so the upper triangle (positive exponents) never overflows
        decay = np.exp(np.where(lower, cum[:, :, None] - cum[:, None, :], -np.inf))
        a = np.where(lower & ~np.eye(n, dtype=bool), bc * (kc @ np.swapaxes(kc, 1, 2)) * decay, 0.0)
        system = np.eye(n, dtype=v.dtype) + a
        rhs = np.concatenate([bc * vc, bc * np.exp(cum)[:, :, None] * kc], axis=2)
        solved = np.linalg.solve(system, rhs)
        u, w = solved[..., :vc.shape[2]], solved[..., vc.shape[2]:]
        delta = u - w @ state
        scores = (qc @ np.swapaxes(kc, 1, 2)) * decay
        out[:, start:stop] = np.exp(cum)[:, :, None] * (qc @ state) + scores @ delta
        last = cum[:, -1]
        state = (np.exp(last)[:, None, None] * state
                 + np.swapaxes(np.exp(last[:, None] - cum)[:, :, None] * kc, 1, 2) @ delta)
    return out
