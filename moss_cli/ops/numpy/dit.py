"""DiT-specific ops (MOSS-Image joint blocks): SiTU-GLU, adaLN modulation, gated residual."""

import numpy as np


class DitOps:
    def situ(self, hidden, gate):
        """SiTU-GLU: (4 tanh(gate/4) sigmoid(gate)) * (25 tanh(hidden/25)), in torch's evaluation order.

        The nine elementwise steps run as the official eager chain writes them (g/4, tanh, 4*, sigmoid,
        product, h/25, tanh, 25*, product), so a rounding table can round after each one.
        """
        t = self.dtype.type
        with np.errstate(over="ignore"):   # exp(-g) overflows to inf for very negative g: sigmoid -> 0
            a = self.mul(self.scale(self.tanh(gate / t(4)), 4), self.sigmoid(gate))
        b = self.scale(self.tanh(hidden / t(25)), 25)
        return self.mul(a, b)

    def modulate(self, x, shift, scale):
        """adaLN: x * (1 + scale) + shift; shift/scale [1, D] broadcast over the tokens of x [L, D]."""
        return x * (self.dtype.type(1) + scale) + shift

    def gated_residual(self, x, update, gate):
        """x + update * gate; gate [1, D] broadcast over the tokens."""
        return x + update * gate

    def norm_modulate(self, x, w, eps, shift, scale):
        """modulate(rms_norm(x, w), shift, scale): one op, so a GPU table can fuse it (and write bf16)."""
        return self.modulate(self.rms_norm(x, w, eps), shift, scale)

    def residual_norm_modulate(self, x, update, gate, w, eps, shift, scale):
        """(x + update * gate, norm_modulate of that): the block's residual add and the next norm, fused
        on a GPU table (which updates x in place)."""
        x = self.gated_residual(x, update, gate)
        return x, self.norm_modulate(x, w, eps, shift, scale)

    def qk_norm_rope(self, q, k, wq, wk, cos, sin, eps):
        """The attention's q and k heads through rms_norm_rope, each with its weight (one op: a GPU table
        runs both in one launch)."""
        return self.rms_norm_rope(q, wq, cos, sin, eps), self.rms_norm_rope(k, wk, cos, sin, eps)
