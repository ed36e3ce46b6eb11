"""The CUDA table's image ops (the numpy table's ops.numpy.conv twins), float32-accurate: convolutions and the
products of the decoder's attention as split fp16 products on tensor cores (cuda_kernels.conv), group norm
in float32, the latents' unpacking and packing and the pixels' rounding on the device.

Images are [C, H, W] float32 device arrays, as in the numpy table, but for two views only conv2d reads: the
nearest-2x upsampling (Upsampled) and silu(group_norm(x)) (Normalized), made where the conv reads them and
never written. A conv runs over chunks of output rows. A k x k conv: the chunk's split image in the taps'
layout (conv.split_image triple), one product a tap against the tap's split weight, summed into one float32
product (conv.tap_product); a 1x1 conv: the chunk's columns (its split image) and one split product. The split
weight is prepared once per weight, from its first call (run a graph's ops eagerly once before capturing
them). The split's scale comes from a device peak: max |x| (conv.absmax), or for silu(group_norm(x)) the
bound its statistics give (no pass over the values). `finish` then writes the chunk's product into the
channels of the output with the scales divided out and the bias (and a residual, the ResNet block's sum) added.
The VAE encoder's stride-2 downsampling conv is the 2x2 conv over its input's 2x2 phases, read through by the
split (conv.split_image down) with the weight rearranged once (conv.down_weight).
"""

import weakref

import numpy as np
from numba import cuda

from cuda_kernels import conv, rope_attention
from cuda_kernels.core import columns


class Upsampled:
    """The nearest-2x upsampling of x [C, H, W], never written: conv2d reads it through x."""

    def __init__(self, x):
        self.x = x
        self.shape = (x.shape[0], 2 * x.shape[1], 2 * x.shape[2])
        self.dtype = x.dtype


class Normalized:
    """silu(group_norm(x)) of x [C, H, W], never written: conv2d makes each value where it reads it (its
    columns), from the group statistics in `partial` (conv.group_stats) and the affine w, b; `peak` bounds its
    values (conv.group_stats' bound, the split's scale)."""

    def __init__(self, x, partial, w, b, groups, eps, peak):
        self.x, self.partial, self.w, self.b, self.groups, self.eps = x, partial, w, b, groups, eps
        self.peak = peak
        self.norm = (partial[0], w, b)
        self.shape = x.shape
        self.dtype = x.dtype


def _source(x):
    """(the array a conv reads, whether through the 2x upsampling, the (stats, w, b) of a group norm + silu made
    on each read, or None, and a device peak of the values read, or None) of a conv's input: an array, an
    Upsampled or a Normalized."""
    up = isinstance(x, Upsampled)
    norm, peak = (x.norm, x.peak) if isinstance(x, Normalized) else (None, None)
    return (x.x if up or norm else x), up, norm, peak


def split_weight_bits(host, form):
    """(bits, peak) of a float32 host weight as the products read it: "matrix" conv.weight_matrix (a linear's,
    a 1x1 conv's), "taps" conv.tap_weights (a k x k conv's tap products), "down" the tap products of a
    stride-2 3x3 conv's 2x2 phase form (conv.down_weight)."""
    if form == "down":
        return conv.tap_weights(conv.down_weight(host))
    return (conv.tap_weights if form == "taps" else conv.weight_matrix)(host)


class ConvCudaOps:
    """Mixed into CudaOps: needs its `new`, `stream`, `transpose` and `_params`."""

    def _split_weight(self, w, form="matrix"):
        """(fp16 bits [product_rows(O), split_width(K, True)], peak [1]) of a float32 device weight (conv
        [O, C, k, k] or linear [O, C]): conv.weight_matrix, on the device, made once per weight and form;
        "taps": the tap products' [k k, product_rows(O), 3 tap_part(C)] (conv.tap_weights); "down": those of
        the downsampling's phase form, [4, product_rows(O), 3 tap_part(4 C)]."""
        key = (form, id(w))
        cached = self._params.get(key)
        if cached is None or cached[0]() is not w:
            bits, peak = self._host_split_weight(w, form)
            cached = self._params[key] = (weakref.ref(w), cuda.to_device(bits),
                                          cuda.to_device(np.array([peak], np.float32)))
        return cached[1], cached[2]

    def _host_split_weight(self, w, form):
        """split_weight_bits of device weight w, from its copy to the host (DecoderOps splits its weights from
        their host tensors instead)."""
        return split_weight_bits(w.copy_to_host(), form)

    def _peak(self, x):
        peak = self.new((1,))
        conv.absmax(x, peak, stream=self.stream)
        return peak

    def conv2d(self, x, w, b=None, padding=0, residual=None):
        """Stride-1 torch.nn.Conv2d of x [C, H, W] (or an Upsampled, or a Normalized) with w [O, C, k, k] (k odd,
        padding k // 2), plus `residual` [O, H, W] (contiguous) when given, added in the same pass as the bias."""
        o, c, taps, wide = w.shape
        if taps != wide or taps % 2 == 0 or padding != taps // 2:
            raise ValueError(f"conv2d takes square odd kernels with 'same' padding, not {w.shape} padding {padding}")
        src, up, norm, peak = _source(x)
        _, h, width = x.shape
        if peak is None:
            peak = self._peak(src)
        if taps > 1:
            return self._tap_conv(src, up, norm, peak, w, b, residual, (o, h, width))
        weight, peak_w = self._split_weight(w, "matrix")
        out = self.new((o, h, width))
        rows = min(h, conv.chunk_rows(c, width))
        cols = self.new((rows * width, conv.split_width(c)), np.uint16)
        d = self.new((rows * width, weight.shape[0]))          # conv.product_rows(o) columns
        flat = out.reshape(o, h * width)
        res = None if residual is None else residual.reshape(o, h * width)
        for r0 in range(0, h, rows):
            n = min(rows, h - r0) * width
            conv.split_image(src, peak, cols[:n], r0, up, norm, stream=self.stream)
            conv.half_product(cols[:n], weight, d[:n], stream=self.stream)
            conv.finish(columns(d[:n], 0, o), peak, peak_w, b, flat, r0 * width, channels=True, residual=res,
                        stream=self.stream)
        return out

    def _tap_conv(self, src, up, norm, peak, w, b, residual, shape, down=False):
        """conv2d of a k x k kernel as tap products over chunks of output rows: the chunk's split image in the
        taps' layout (conv.split_image triple, rows of W + 2 pixels, the padding's zeros in it), one product a
        tap into d (conv.tap_product), then finish from the grid's rows. A chunk's image and d fit
        conv.TAP_BYTES, so the taps after the first find both in L2. down: the stride-2 3x3 conv of
        downsample_conv, as the 2x2 conv over src's phases (its image rows from r0 on, its taps from one pixel
        on: zeros only below and to the right)."""
        o, h, width = shape
        span = width + 2
        weight, peak_w = self._split_weight(w, "down" if down else "taps")
        taps = 2 if down else w.shape[2]
        out = self.new(shape)
        rows = min(h, conv.tap_rows((4 if down else 1) * src.shape[0], o, width))
        image = self.new((conv.image_rows(rows, taps) * span, weight.shape[2]), np.uint16)
        d = self.new((rows * span, weight.shape[1]))
        flat = out.reshape(o, h * width)
        res = None if residual is None else residual.reshape(o, h * width)
        for r0 in range(0, h, rows):
            n = min(rows, h - r0)
            m = n * span - 2                        # the last row's two columns past the image are not computed
            conv.split_image(src, peak, image[:conv.image_rows(n, taps) * span], r0 if down else r0 - taps // 2,
                             up, norm, stream=self.stream, triple=True, down=down)
            conv.tap_product(image, weight, d[:m], span, stream=self.stream, origin=int(down))
            conv.finish(columns(d[:m], 0, o), peak, peak_w, b, flat, r0 * width, channels=True, residual=res,
                        stream=self.stream, span=span)
        return out

    def downsample_conv(self, x, w, b):
        """diffusers' Downsample2D with padding 0 (numpy_conv's): x [C, H, W] (H, W even) padded by a zero row
        below and a zero column to the right, a 3x3 stride-2 conv w [O, C, 3, 3] + b -> [O, H/2, W/2]; as
        tap products over x's 2x2 phases read through (conv.split_image down, conv.down_weight)."""
        c, h, width = x.shape
        if tuple(w.shape[1:]) != (c, 3, 3) or h % 2 or width % 2:
            raise ValueError(f"downsample_conv takes [C, H, W] of even H, W and a [O, C, 3, 3] weight, not "
                             f"{x.shape} and {w.shape}")
        return self._tap_conv(x, False, None, self._peak(x), w, b, None, (w.shape[0], h // 2, width // 2),
                              down=True)

    def group_norm(self, x, groups, w, b, eps):
        """torch.nn.GroupNorm over x [C, H, W] (consecutive channel groups, biased variance, affine w, b)."""
        out = self.new(x.shape)
        conv.group_norm(x, w, b, out, groups, eps, False, self.new((4, groups, conv.GN_PARTS)), stream=self.stream)
        return out

    def group_norm_silu(self, x, groups, w, b, eps):
        """silu(group_norm(x, ...)) as a Normalized that only conv2d reads: the statistics and a bound on the
        values now, each value in the conv's reads (no [C, H, W] written)."""
        partial, peak = self.new((4, groups, conv.GN_PARTS)), self.new((1,))
        conv.group_stats(x, groups, eps, partial, stream=self.stream, peak=peak, w=w, b=b)
        return Normalized(x, partial, w, b, groups, eps, peak)

    def upsample_nearest2x(self, x):
        """out[c, 2i+a, 2j+b] = x[c, i, j], as a view the next conv2d reads through (Upsampled)."""
        return Upsampled(x)

    def unpack_latents(self, latents, std, mean):
        """Packed latents [4C, h, w] -> [C, 2h, 2w]: BN de-normalisation (* std + mean), 2x2 unpatchify."""
        c4, h, w = latents.shape
        out = self.new((c4 // 4, 2 * h, 2 * w))
        conv.unpack_latents(latents, std.reshape(c4) if std.ndim == 1 else std[:, 0, 0],
                            mean.reshape(c4) if mean.ndim == 1 else mean[:, 0, 0], out, stream=self.stream)
        return out

    def pack_latents(self, z, std, mean):
        """[C, 2h, 2w] -> packed latents [4C, h, w]: 2x2 patchify, BN normalisation ((z - mean) / std, as the
        FLUX.2 pipelines' _encode_vae_image): unpack_latents' inverse."""
        c, h2, w2 = z.shape
        out = self.new((4 * c, h2 // 2, w2 // 2))
        conv.pack_latents(z, std.reshape(4 * c) if std.ndim == 1 else std[:, 0, 0],
                          mean.reshape(4 * c) if mean.ndim == 1 else mean[:, 0, 0], out, stream=self.stream)
        return out

    def to_pixels(self, image):
        """uint8 [H, W, 3] of an image [3, H, W] (values past [-1, 1] clamp): vae.to_pixels on the device."""
        _, h, w = image.shape
        out = self.new((h, w, 3), np.uint8)
        conv.to_pixels(image, out, stream=self.stream)
        return out

    # --- float32-accurate products for the decoder's attention -------------------------------
    def _split(self, x, weight=False):
        """(fp16 bits [M, split_width(K, weight)], peak) of a contiguous float32 x [.., K] (rows of the
        product's left operand, or of its right one: weight)."""
        k = x.shape[x.ndim - 1]
        rows = x.reshape(x.size // k, k)
        peak = self._peak(rows)
        out = self.new((rows.shape[0], conv.split_width(k, weight)), np.uint16)
        conv.split_rows(rows, peak, out, weight, stream=self.stream)
        return out, peak

    def _product(self, a, peak_a, w, peak_w, n, bias=None):
        """float32 [M, n] = a . w^T (+ bias) from split operands (w's first n rows: a weight's are padded)."""
        d = self.new((a.shape[0], w.shape[0]))
        conv.half_product(a, w, d, stream=self.stream)
        out = self.new((a.shape[0], n))
        conv.finish(columns(d, 0, n), peak_a, peak_w, bias, out, stream=self.stream)
        return out

    def split_linear(self, x, w, b=None):
        """x @ w.T (+ b) for float32 x [.., in] and a float32 weight [out, in], as split products."""
        a, peak = self._split(x)
        weight, peak_w = self._split_weight(w, "matrix")
        out = self._product(a, peak, weight, peak_w, w.shape[0], b)
        return out.reshape(tuple(x.shape)[:x.ndim - 1] + (w.shape[0],))

    def _drop_kv_split(self, cached):
        if getattr(self, "_kv_split", None) is cached:
            self._kv_split = None

    def split_attention(self, q, k, v, scale):
        """softmax(scale q k^T) v for one head, q [L, 1, d], k, v [S, 1, d] contiguous, as split products; k's
        and v^T's splits are kept for the next call on the same k and v (queries come in row blocks)."""
        cached = getattr(self, "_kv_split", None)
        if cached is None or cached[0]() is not k or cached[1]() is not v:
            s, d = v.shape[0], v.shape[2]
            ks = self._split(k, weight=True)
            vs = self._split(self.transpose(v.reshape(s, d), (1, 0)), weight=True)
            cached = self._kv_split = (weakref.ref(k), weakref.ref(v), ks, vs)
            weakref.finalize(k, self._drop_kv_split, cached)    # the splits go back to the pool with k
        (ks, peak_k), (vs, peak_v) = cached[2], cached[3]
        qs, peak_q = self._split(q)
        scores = self._product(qs, peak_q, ks, peak_k, ks.shape[0])
        rope_attention.softmax(scores.reshape(1, *scores.shape), scale, False, stream=self.stream)
        ps, peak_p = self._split(scores)
        out = self._product(ps, peak_p, vs, peak_v, vs.shape[0])
        return out.reshape(q.shape[0], 1, out.shape[1])
