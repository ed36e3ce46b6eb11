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
