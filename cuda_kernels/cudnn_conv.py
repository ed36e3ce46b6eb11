"""The decoder's split convolutions through cuDNN's implicit-GEMM convolution (the frontend's Python graph API),
from raw device pointers on the caller's stream: no columns through memory.

The split image of a conv's input is what conv.im2col writes for one tap: [pixels, 2 P] fp16 bits, channels
[hi | 0 | lo | 0] with P = conv.part(C) (a multiple of 128), i.e. an NHWC image of 2 P channels. The product
hi.w_hi + lo.w_hi + hi.w_lo is a sum of convolutions over WINDOW-channel windows of that image (hi windows
with w_hi, lo windows with w_hi, hi windows with w_lo), each K = taps^2 WINDOW <= 2048 like the split
product's slices, each added to the last in float32 by a pointwise add fused after the convolution (Y = conv
+ Z, two buffers in turn). Rows come in chunks: a chunk's image holds its rows and a zero or neighbour row
above and below, the convolution pads only left and right.

Experimental: CudaDecoder(..., convs="cudnn") takes it; the columns stay the default until the H200 says
whether cuDNN takes fp16 operands with float32 output here and how fast (scripts/probe_cudnn_conv.py).
"""

import numpy as np

from .conv import PART, host_scale, host_split, part, product_rows
from .gemm import pointer, stream_handle
from .sdpa import _state, available, build

WINDOW = PART           # channels of one window: K = 9 * 128 = 1152


def windows(p):
    """(image channel, weight part, weight channel) of each convolution of a split product over an image of
    2 P channels: hi windows with w_hi, lo windows with w_hi, hi windows with w_lo."""
    n = p // WINDOW
    hi = [(i * WINDOW, 0, i * WINDOW) for i in range(n)]
    lo = [(p + i * WINDOW, 0, i * WINDOW) for i in range(n)]
    hi_lo = [(i * WINDOW, 1, i * WINDOW) for i in range(n)]
    return hi + lo + hi_lo


def weight_windows(w):
    """A conv weight [O, C, k, k] float32 as the windows' fp16 weights, KRSC: bits [2, P / WINDOW, O8, k, k,
    WINDOW] (part 0 w_hi, part 1 w_lo; O8 = product_rows(O); zeros past C and O), and the peak |w|."""
    w = np.asarray(w, np.float32)
    o, c, k, _ = w.shape
    peak = float(np.abs(w).max()) if w.size else 0.0
    hi, lo = host_split(w, host_scale(peak))
    p = part(c)
    out = np.zeros((2, p // WINDOW, product_rows(o), k, k, WINDOW), np.uint16)
    for j, bits in enumerate((hi, lo)):
        padded = np.zeros((product_rows(o), p, k, k), np.uint16)
        padded[:o, :c] = bits
        out[j] = padded.reshape(product_rows(o), p // WINDOW, WINDOW, k, k).transpose(1, 0, 3, 4, 2)
    return out, np.float32(peak)


class _Plan:
    """One built graph: Y [1, O8, rows, W] float32 NHWC = conv(X window [1, WINDOW, rows + 2 pad, W]) (+ Z)."""

    def __init__(self, rows, width, p, o8, taps, add):
        import cudnn
        f16, f32 = cudnn.data_type.HALF, cudnn.data_type.FLOAT
        pad = taps // 2
        g = cudnn.pygraph(io_data_type=f16, intermediate_data_type=f32, compute_data_type=f32,
                          handle=_state["handle"])
        h_in = rows + 2 * pad
        self.x = g.tensor(name="X", dim=[1, WINDOW, h_in, width], stride=[h_in * width * 2 * p, 1, width * 2 * p, 2 * p],
                          data_type=f16)
        self.w = g.tensor(name="W", dim=[o8, WINDOW, taps, taps], stride=[taps * taps * WINDOW, 1, taps * WINDOW, WINDOW],
                          data_type=f16)
        y = g.conv_fprop(image=self.x, weight=self.w, pre_padding=[0, pad], post_padding=[0, pad], stride=[1, 1],
                         dilation=[1, 1], compute_data_type=f32, name="conv")
        out = [1, o8, rows, width], [rows * width * o8, 1, width * o8, o8]
        self.z = None
        if add:
            self.z = g.tensor(name="Z", dim=out[0], stride=out[1], data_type=f32)
            y = g.add(a=y, b=self.z, compute_data_type=f32, name="sum")
        y.set_output(True).set_dim(out[0]).set_stride(out[1]).set_data_type(f32)
        self.y = y
        self.graph = g
        self.workspace_bytes = build(g)


def _plan(rows, width, p, o8, taps, add):
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    key = ("conv", rows, width, p, o8, taps, add)
    plans = _state.setdefault("plans", {})
    if key not in plans:
        plans[key] = _Plan(rows, width, p, o8, taps, add)
    return plans[key]


def convolve(image, weights, ys, rows, width, taps, workspace, stream=0):
    """The split product of one chunk: image [(rows + 2 pad) W, 2 P] fp16 bits (conv.im2col, one tap), weights
    from weight_windows (on the device), ys two float32 [rows W, O8] buffers; returns the one holding the sum
    (the product still scaled, as conv.half_product leaves it for conv.finish). workspace: a uint8 device
    array of at least workspace_bytes(...)."""
    import cudnn
    p, o8 = image.shape[1] // 2, weights.shape[2]
    handle = _state["handle"]
    cudnn.set_stream(handle, stream_handle(stream))
    first, later = _plan(rows, width, p, o8, taps, False), _plan(rows, width, p, o8, taps, True)
    per_window = weights[0, 0].size
    z = None
    for i, (channel, which, wchannel) in enumerate(windows(p)):
        plan = first if z is None else later
        y = ys[i % 2]
        pack = {plan.x: pointer(image) + 2 * channel, plan.y: pointer(y),
                plan.w: pointer(weights) + 2 * per_window * (which * (p // WINDOW) + wchannel // WINDOW)}
        if z is not None:
            pack[plan.z] = pointer(z)
        plan.graph.execute(pack, pointer(workspace), handle=handle)
        z = y
    return z


def workspace_bytes(rows, width, p, o8, taps):
    return max(_plan(rows, width, p, o8, taps, add).workspace_bytes for add in (False, True))
