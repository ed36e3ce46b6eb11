"""Core ops shared by the three graphs: parameters, linear, norms, activations, RoPE, attention."""

import numpy as np

ATTENTION_BLOCK = 1024   # query rows per score block
PARAM_CACHE_BYTES = 4 << 30


class CoreOps:
    dtype: np.dtype

    # --- data movement ---------------------------------------------------------------------
    def param(self, tensors, name):
        """The stored tensor `name` of a component in the compute dtype.

        Converted copies are kept up to PARAM_CACHE_BYTES; past that (the real 5B/9B on a CPU) each use
        converts from the memory-mapped file again instead of holding tens of GB.
        """
        key = (id(tensors), name)
        out = self._params.get(key)
        if out is None:
            out = np.ascontiguousarray(np.asarray(tensors[name]).astype(self.dtype))
            if self._param_bytes + out.nbytes <= PARAM_CACHE_BYTES:
                self._params[key] = out
                self._param_bytes += out.nbytes
        return out

    def array(self, x):
        """A host array in the compute dtype."""
        return np.ascontiguousarray(np.asarray(x, dtype=self.dtype))

    def host(self, x):
        return np.asarray(x)

    # --- shapes ------------------------------------------------------------------------------
    def reshape(self, x, shape):
        return np.reshape(x, shape)

    def transpose(self, x, axes):
        return np.ascontiguousarray(np.transpose(x, axes))

    def concat(self, xs, axis=0):
        return np.concatenate(xs, axis=axis)

    def slice(self, x, axis, start, stop):
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, stop)
        return x[tuple(index)]

    def split(self, x, sizes):
        """Consecutive blocks of the last axis with these sizes (views)."""
        out, start = [], 0
        for n in sizes:
            out.append(x[..., start:start + n])
            start += n
        return out

    def embedding(self, table, ids):
        return np.ascontiguousarray(np.asarray(table)[np.asarray(ids, dtype=np.int64)].astype(self.dtype))

    # --- elementwise -------------------------------------------------------------------------
    def add(self, a, b):
        return a + b

    def sub(self, a, b):
        return a - b

    def mul(self, a, b):
        return a * b

    def div(self, a, b):
        return a / b

    def scale(self, x, s):
        return x * self.dtype.type(s)

    def sigmoid(self, x):
        return 1.0 / (1.0 + np.exp(-x))

    def silu(self, x):
        return x * self.sigmoid(x)

    def tanh(self, x):
        return np.tanh(x)

    def exp(self, x):
        return np.exp(x)

    def softplus(self, x):
        """torch.nn.functional.softplus with beta 1, threshold 20 (x itself above 20)."""
        return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))

    def sigmoid_gate(self, x, g, operand=False):
        """x * sigmoid(g) (the attention output gate); `operand` as in swiglu."""
        return x * self.sigmoid(g)

    def swiglu(self, gate, up, operand=False):
        """silu(gate) * up. `operand=True` says the result only feeds products: a GPU table may return
        it as their bf16 operand; numpy returns the same array either way."""
        return self.silu(gate) * up

    # --- linear algebra ----------------------------------------------------------------------
    def params(self, tensors, names):
        """Several weights read together by `linears` (a GPU table stacks them into one matrix)."""
        return [self.param(tensors, name) for name in names]

    def linear(self, x, w, b=None, residual=None, narrow=False):
        """x @ w.T (+ b) (+ residual), w stored torch-style [out, in]. `narrow` as in linears."""
        y = x @ w.T
        if b is not None:
            y = y + b
        if residual is not None:
            y = y + residual
        return y

    def linears(self, x, ws, narrow=False):
        """[x @ w.T for w in ws]: projections of one input (`ws` from `params`; one product on a GPU).

        `narrow=True` says the projections only feed elementwise kernels: a GPU table may store them in
        bf16 (the model's dtype, as transformers' bf16 forward does); numpy keeps float32 either way."""
        return [self.linear(x, w) for w in ws]

    def rms_norm(self, x, w, eps, offset=0.0, operand=False):
        """x / sqrt(mean(x^2) + eps) * (offset + w) over the last axis (offset 1 = zero-centred).

        `operand=True`: the result only feeds products (see swiglu)."""
        r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.dtype.type(eps))
        return (x * r) * (self.dtype.type(offset) + w)

    def rope(self, x, cos, sin):
        """Rotate-half RoPE on the first 2*r dims of each head: x [L, H, d], cos/sin [L, r].

        Pairs are (j, j + r): out_j = x_j cos_j - x_{j+r} sin_j, out_{j+r} = x_{j+r} cos_j + x_j sin_j.
        """
        r = cos.shape[-1]
        c = cos[:, None, :]
        s = sin[:, None, :]
        a = x[..., :r]
        b = x[..., r:2 * r]
        return np.concatenate([a * c - b * s, b * c + a * s, x[..., 2 * r:]], axis=-1)

    def rms_norm_rope(self, x, w, cos, sin, eps, offset=0.0):
        """rope(rms_norm(x, w, eps, offset), cos, sin): one op, so a GPU table can fuse the two."""
        return self.rope(self.rms_norm(x, w, eps, offset), cos, sin)

    def attention(self, q, k, v, scale, causal=False):
        """softmax(q k^T * scale) v per head; q [L, Hq, d], k [S, Hk, d], v [S, Hk, dv] -> [L, Hq, dv].

        Grouped heads: query head i reads key/value head i // (Hq // Hk). Causal aligns the last query
        with the last key. Queries go in blocks so the score matrix stays small at 16k tokens.
        """
        hq, hk = q.shape[1], k.shape[1]
        group = hq // hk
        kt = np.repeat(np.transpose(k, (1, 2, 0)), group, axis=0)    # [Hq, d, S]
        vv = np.repeat(np.transpose(v, (1, 0, 2)), group, axis=0)    # [Hq, S, dv]
        qq = np.transpose(q, (1, 0, 2))                              # [Hq, L, d]
        L, S = q.shape[0], k.shape[0]
        out = np.empty((hq, L, v.shape[2]), dtype=np.result_type(q, v))
        for start in range(0, L, ATTENTION_BLOCK):
            stop = min(L, start + ATTENTION_BLOCK)
            s = (qq[:, start:stop] @ kt) * self.dtype.type(scale)
            if causal:
                rows = np.arange(start, stop)[:, None] + (S - L)
                s = np.where(np.arange(S)[None, :] <= rows, s, -np.inf)
            s = s - np.max(s, axis=-1, keepdims=True)
            p = np.exp(s)
            p = p / np.sum(p, axis=-1, keepdims=True)
            out[:, start:stop] = p @ vv
        return np.ascontiguousarray(np.transpose(out, (1, 0, 2)))
