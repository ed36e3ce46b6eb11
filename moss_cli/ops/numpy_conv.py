"""Image ops for the VAE decoder: conv2d, group norm, nearest upsampling, clamp. Images are [C, H, W]."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# Elements of one im2col block; bounds the scratch memory of a 3x3 conv at 1024x1024.
IM2COL_BUDGET = 1 << 23


class ConvOps:
    def conv2d(self, x, w, b=None, padding=0):
        """Stride-1 cross-correlation as torch.nn.Conv2d: x [C, H, W], w [O, C, kh, kw], b [O] -> [O, H', W'].

        im2col over bands of output rows, one matmul per band against w as [O, C*kh*kw].
        """
        c, h, wd = x.shape
        o, _, kh, kw = w.shape
        if padding:
            x = np.pad(x, ((0, 0), (padding, padding), (padding, padding)))
        ho, wo = h + 2 * padding - kh + 1, wd + 2 * padding - kw + 1
        wm = w.reshape(o, c * kh * kw)
        out = np.empty((o, ho * wo), dtype=self.dtype)
        if kh == kw == 1:
            np.matmul(wm, x.reshape(c, ho * wo), out=out)
        else:
            windows = sliding_window_view(x, (kh, kw), axis=(1, 2))          # [C, H', W', kh, kw]
            rows = max(1, IM2COL_BUDGET // (c * kh * kw * wo))
            for r0 in range(0, ho, rows):
                r1 = min(ho, r0 + rows)
                cols = windows[:, r0:r1].transpose(0, 3, 4, 1, 2).reshape(c * kh * kw, (r1 - r0) * wo)
                np.matmul(wm, cols, out=out[:, r0 * wo:r1 * wo])
        if b is not None:
            out += b[:, None]
        return out.reshape(o, ho, wo)

    def group_norm(self, x, groups, w, b, eps):
        """torch.nn.GroupNorm on x [C, H, W]: consecutive channel groups, biased variance, affine w, b [C].

        Applied as x * s + t per channel with s = w / sqrt(var + eps), t = b - mean * s, as torch's CPU kernel does.
        """
        c = x.shape[0]
        g = x.reshape(groups, -1)
        mean = np.mean(g, axis=1)
        d = g - mean[:, None]
        var = np.mean(d * d, axis=1)
        rstd = 1.0 / np.sqrt(var + self.dtype.type(eps))
        s = w * np.repeat(rstd, c // groups)
        t = b - np.repeat(mean, c // groups) * s
        return x * s[:, None, None] + t[:, None, None]

    def upsample_nearest2x(self, x):
        """Nearest-neighbour x2 (torch interpolate scale_factor=2, mode "nearest"): out[c, 2i+a, 2j+b] = x[c, i, j]."""
        c, h, w = x.shape
        out = np.empty((c, h, 2, w, 2), dtype=x.dtype)
        out[...] = x[:, :, None, :, None]
        return out.reshape(c, 2 * h, 2 * w)

    def clamp(self, x, lo, hi):
        """Elementwise min(max(x, lo), hi)."""
        return np.clip(x, self.dtype.type(lo), self.dtype.type(hi))
