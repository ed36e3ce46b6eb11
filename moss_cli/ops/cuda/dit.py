"""The DiT's ops on the GPU (ops.numpy.dit's twins): SiTU-GLU, the fused norm + modulation (+ gated residual),
q/k norm + RoPE on bf16 heads, attention on bf16 heads (cuDNN's fused SDPA, else the flash kernel).

The residual stream is float32 (the official eager chain keeps it bf16: ours is the more accurate one);
every tensor that feeds a product or the attention is bf16 bits, as in the official chain.
"""

import numpy as np
from numba import cuda

from cuda_kernels import dit, flash, sdpa
from cuda_kernels.core import SIMULATED, DeviceView


class DitCudaOps:
    use_cudnn = True           # attention on bf16 heads through cuDNN where it loads (else flash)
    qk_width = None            # bf16 values a word in the q/k norm + RoPE kernel (None: dit.QK_WIDTH)
    qk_group = None            # heads a team there (None: dit.QK_GROUP)

    def situ(self, hidden, gate):
        """SiTU-GLU of bf16 halves (any strides) -> bf16 bits [L, F], the down product's operand."""
        out = self.new(hidden.shape, np.uint16)
        dit.situ(hidden, gate, out, stream=self.stream)
        return out

    def norm_modulate(self, x, w, eps, shift, scale):
        """modulate(rms_norm(x, w), shift, scale) as bf16 bits [L, D]."""
        out = self.new(x.shape, np.uint16)
        dit.norm_modulate(x, w, self._vector(shift), self._vector(scale), out, eps, stream=self.stream)
        return out

    def residual_norm_modulate(self, x, update, gate, w, eps, shift, scale):
        """(x + update gate, modulate(rms_norm(that), shift, scale)): x is updated in place (float32)."""
        out = self.new(x.shape, np.uint16)
        dit.norm_modulate(x, w, self._vector(shift), self._vector(scale), out, eps, u=self._rows(update),
                          gate=self._vector(gate), stream=self.stream)
        return x, out

    def _vector(self, v):
        return v.reshape(v.size)

    def _bf16_norm_rope(self, x, w, cos, sin, eps):
        out = self.new(x.shape, np.uint16)
        dit.qk_norm_rope(x, w, cos, sin, out, eps, stream=self.stream, width=self.qk_width, group=self.qk_group)
        return out

    def qk_norm_rope(self, q, k, wq, wk, cos, sin, eps):
        """(rope(rms_norm(q) wq), rope(rms_norm(k) wk)); bf16 q and k heads side by side in one product's
        output (the fused qkv) take one launch over both, each into its own contiguous [L, H, d] (the layout
        cuDNN's attention was measured with)."""
        L, H, d = q.shape
        item = q.dtype.itemsize
        adjacent = (not SIMULATED and q.dtype == np.uint16 and k.dtype == np.uint16
                    and tuple(q.strides) == tuple(k.strides)
                    and q.strides[1] == d * item and k.shape == q.shape
                    and k.__cuda_array_interface__["data"][0] == q.__cuda_array_interface__["data"][0] + H * d * item)
        if not adjacent:
            return self.rms_norm_rope(q, wq, cos, sin, eps), self.rms_norm_rope(k, wk, cos, sin, eps)
        both = cuda.as_cuda_array(DeviceView(q, (L, 2 * H, d), q.strides), sync=False)
        q_out, k_out = self.new(q.shape, np.uint16), self.new(k.shape, np.uint16)
        dit.qk_norm_rope(both, wq, cos, sin, q_out, eps, w2=wk, out2=k_out, stream=self.stream, width=self.qk_width,
                         group=self.qk_group)
        return q_out, k_out

    def bf16_attention(self, q, k, v, scale):
        """Bidirectional attention of bf16 heads [S, H, D] -> bf16 bits [S, H, D]."""
        out = self.new(q.shape, np.uint16)
        if self.use_cudnn and sdpa.supports(q, k, v, out, scale):
            sdpa.attention(q, k, v, out, scale, stream=self.stream)
            return out
        wide = [self._widen(a) for a in (q, k, v)]
        shapes = flash.workspace_shapes(q.shape[0], q.shape[1], k.shape[1], q.shape[2])
        work = {name: self.new(shape, np.uint32) for name, shape in shapes.items()}
        result = self.new(q.shape)
        flash.flash_attention(*wide, result, scale, False, stream=self.stream, work=work)
        return result

    def _widen(self, bits):
        out = self.new(bits.shape)
        dit.widen_heads(bits, out, stream=self.stream)
        return out
