"""Image ops for the VAE: conv2d, the encoder's stride-2 downsampling conv, group norm, nearest upsampling, clamp.
Images are [C, H, W]."""

import numpy as np
from numpy.lib.stride_tricks import as_strided

# Elements of one im2col block; bounds the scratch memory of a 3x3 conv at 1024x1024.
IM2COL_BUDGET = 1 << 23


class ConvOps:
    def conv2d(self, x, w, b=None, padding=0, residual=None):
        """Stride-1 cross-correlation as torch.nn.Conv2d: x [C, H, W], w [O, C, kh, kw], b [O] -> [O, H', W'],
        plus `residual` [O, H', W'] when given (added last, after the bias).

        im2col over bands of output rows, one matmul per band against w as [O, C*kh*kw]. Columns run over
        the padded width, so each (channel, tap) row of the band is one contiguous run of the flat padded
        image; the kw - 1 columns past each output row are computed and dropped.
        """
        c, h, wd = x.shape
        o, _, kh, kw = w.shape
        ho, wo = h + 2 * padding - kh + 1, wd + 2 * padding - kw + 1
        wm = w.reshape(o, c * kh * kw)
        if kh == kw == 1 and padding == 0:
            out = np.matmul(wm, x.reshape(c, h * wd)).reshape(o, ho, wo)
        else:
            # one spare zero row keeps the last band's overhanging taps inside the array
            xp = np.pad(x, ((0, 0), (padding, padding + 1), (padding, padding)))
            wp = xp.shape[2]
            sc, sr, sx = xp.strides
            out = np.empty((o, ho, wo), dtype=self.dtype)
            rows = max(1, IM2COL_BUDGET // (c * kh * kw * wp))
            for r0 in range(0, ho, rows):
                r1 = min(ho, r0 + rows)
                n = (r1 - r0) * wp
                cols = as_strided(xp[:, r0:], (c, kh, kw, n), (sc, sr, sx, sx)).reshape(c * kh * kw, n)
                out[:, r0:r1] = np.matmul(wm, cols).reshape(o, r1 - r0, wp)[:, :, :wo]
        if b is not None:
            out += b[:, None, None]
        if residual is not None:
            out += residual
        return out

    def downsample_conv(self, x, w, b):
        """diffusers' Downsample2D with padding 0: x [C, H, W] zero-padded by one row at the bottom and one column
        at the right, then a 3x3 stride-2 Conv2d w [O, C, 3, 3], b [O] -> [O, H/2, W/2] (H, W even).

        im2col over bands of output rows, the taps read through strides of two rows and two columns."""
        c, h, wd = x.shape
        o, _, kh, kw = w.shape
        xp = np.pad(x, ((0, 0), (0, 1), (0, 1)))
        ho, wo = (h + 1 - kh) // 2 + 1, (wd + 1 - kw) // 2 + 1
        wm = w.reshape(o, c * kh * kw)
        sc, sr, sx = xp.strides
        out = np.empty((o, ho, wo), dtype=self.dtype)
        rows = max(1, IM2COL_BUDGET // (c * kh * kw * wo))
        for r0 in range(0, ho, rows):
            r1 = min(ho, r0 + rows)
            cols = as_strided(xp[:, 2 * r0:], (c, kh, kw, r1 - r0, wo), (sc, sr, sx, 2 * sr, 2 * sx))
            out[:, r0:r1] = np.matmul(wm, cols.reshape(c * kh * kw, (r1 - r0) * wo)).reshape(o, r1 - r0, wo)
        out += b[:, None, None]
        return out

    def group_norm(self, x, groups, w, b, eps):
        """torch.nn.GroupNorm on x [C, H, W]: consecutive channel groups, biased variance, affine w, b [C].

        Applied as x * s + t per channel with s = w / sqrt(var + eps), t = b - mean * s, as torch's CPU kernel does.
        """
        c = x.shape[0]
        g = x.reshape(groups, -1)
        mean = np.mean(g, axis=1)
        d = g - mean[:, None]
        var = np.einsum("ij,ij->i", d, d) / self.dtype.type(g.shape[1])
        rstd = 1.0 / np.sqrt(var + self.dtype.type(eps))
        s = w * np.repeat(rstd, c // groups)
        t = b - np.repeat(mean, c // groups) * s
        y = np.multiply(x, s[:, None, None], out=d.reshape(x.shape))
        y += t[:, None, None]
        return y

    def group_norm_silu(self, x, groups, w, b, eps):
        """silu(group_norm(x, ...)): one op, so a table may fuse the two (the GPU's is one kernel)."""
        return self.silu(self.group_norm(x, groups, w, b, eps))

    def upsample_nearest2x(self, x):
        """Nearest-neighbour x2 (torch interpolate scale_factor=2, mode "nearest"): out[c, 2i+a, 2j+b] = x[c, i, j]."""
        c, h, w = x.shape
        out = np.empty((c, h, 2, w, 2), dtype=x.dtype)
        out[...] = x[:, :, None, :, None]
        return out.reshape(c, 2 * h, 2 * w)

    def clamp(self, x, lo, hi):
        """Elementwise min(max(x, lo), hi)."""
        return np.clip(x, self.dtype.type(lo), self.dtype.type(hi))
