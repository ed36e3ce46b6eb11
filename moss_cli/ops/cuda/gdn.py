"""The Gated DeltaNet's ops on the GPU (ops.numpy.gdn's twins): the causal conv, the q/k L2 norms, the gates, the
fused GDN inputs, the gated RMSNorm and the delta rule (token recurrence or chunked on tensor cores)."""

import numpy as np

from cuda_kernels import gdn, gdn_chunk, gdn_inputs, norms

from ..numpy.gdn import GdnOps


class GdnCudaOps:
    def causal_conv1d(self, x, w, activate=False):
        out = self.new(x.shape)
        gdn.causal_conv1d(x, w, out, activate=activate, stream=self.stream)
        return out

    def l2_norm(self, x, eps, scale=1.0):
        """x [.., H, d] of any strides (heads of a column block) or [R, d]."""
        out = self.new(x.shape)
        x3 = self._heads(x)
        norms.l2_norm(x3, out.reshape(x3.shape), eps, scale, stream=self.stream)
        return out

    def gdn_gates(self, a, b, a_log, dt_bias):
        g, beta = self.new(a.shape), self.new(b.shape)
        gdn.gdn_gates(a, b, a_log, dt_bias, g, beta, stream=self.stream)
        return g, beta

    def gdn_inputs(self, mixed, conv_w, a, b, a_log, dt_bias, heads, eps):
        """As the numpy table's (conv + silu, q/k L2 norms, gates), in one kernel (cuda_kernels.gdn_inputs)
        where heads of dk make a block, else the separate ops."""
        hk, dk, hv, dv = heads
        if not (self.fuse_gdn_inputs and gdn_inputs.fits(dk)):
            return GdnOps.gdn_inputs(self, mixed, conv_w, a, b, a_log, dt_bias, heads, eps)
        L = mixed.shape[0]
        q, k, v = self.new((L, hk * dk)), self.new((L, hk * dk)), self.new((L, hv * dv))
        g, beta = self.new(a.shape), self.new(b.shape)
        gdn_inputs.gdn_inputs(mixed, conv_w, a, b, a_log, dt_bias, q, k, v, g, beta, eps, dk ** -0.5, dk,
                              stream=self.stream)
        return (self.reshape(q, (L, hk, dk)), self.reshape(k, (L, hk, dk)), self.reshape(v, (L, hv, dv)), g, beta)

    def gated_rms_norm(self, x, z, w, eps, operand=False):
        """x, z [L, H, d] (z may be a strided view); bf16 bits when `operand`."""
        out = self.new(x.shape, np.uint16 if operand else np.float32)
        norms.gated_rms_norm(x, z, w, out, eps, stream=self.stream)
        return out

    def gated_delta_rule(self, q, k, v, g, beta, form="chunk"):
        """Form "chunk": the chunked form on TF32 tensor cores (gdn_chunk) from `chunk_from` tokens on, the
        token recurrence (gdn) below; "recurrent": the recurrence.
        Both are the same function (their contract cases hold them to the same float64 recurrence)."""
        if form not in ("chunk", "recurrent"):
            raise ValueError(f"unknown delta rule form {form!r}")
        out = self.new(v.shape)
        n, _, dk = q.shape
        if form == "recurrent" or n < self.chunk_from:
            gdn.gated_delta_rule(q, k, v, g, beta, out, stream=self.stream, geometry=self.delta_geometry)
            return out
        shapes = gdn_chunk.workspace_shapes(n, v.shape[1], dk, v.shape[2])
        work = {name: self.new(shape) for name, shape in shapes.items()}
        gdn_chunk.gated_delta_rule_chunked(q, k, v, g, beta, out, work, stream=self.stream)
        return out
