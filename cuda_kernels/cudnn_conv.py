"""The decoder's split convolutions through cuDNN's implicit-GEMM convolution (the frontend's Python graph API),
from raw device pointers on the caller's stream: no columns through memory.

The split image of a conv's input is what conv.split_image writes: [pixels, 2 P] fp16 bits, channels
[hi | 0 | lo | 0] with P = conv.part(C), i.e. an NHWC image of 2 P channels (the pads are zero). The product
hi.w_hi + lo.w_hi + hi.w_lo is a sum of convolutions over channel windows of that image (`plan_convs`), each
of K = taps^2 channels <= conv.SLICE_K like the split product's slices (the tensor cores' float32 accumulator
drifts with K), each added to the last in float32 by a pointwise add fused after the convolution (Y = conv + Z,
two buffers in turn). Where hi and lo fit in one window together (the decoder's 96-channel convs at full size,
the 1x1 convs) one convolution takes both, [hi | 0 | lo | 0] with [w_hi | 0 | w_hi | 0]. Rows come in
chunks: a chunk's image holds its rows and a zero or neighbour row above and below, the convolution pads only
left and right.

Each plan is run once as it is built on pseudo-random operands and sampled against float64 (`check`), with
noise in its workspace; a plan that passes only with a zeroed workspace gets a memset of it before each run
(`_state["zeroed"]` lists them), one that fails raises, and the decoder's conv2d takes the columns for that
geometry. FIRST picks the form of a sum's first convolution (alone, times a device 1, or plus zeros), each a
different set of cuDNN engines.
"""

import numpy as np

from . import conv
from .core import SIMULATED
from .conv import PART, host_scale, host_split, part, product_rows
from .gemm import pointer, stream_handle
from .sdpa import _state, available, build


def plan_convs(c, taps):
    """The convolutions of a split product of C input channels: (first image channel, channels, weight part)
    each, part 0 w_hi and 1 w_lo; image channel j of a window meets the weights' channel j mod P. Windows are
    PART channels at multiples of PART, or the whole pixel [hi | 0 | lo | 0] (2 P, packed) with [w_hi | 0 |
    w_hi | 0] where its nonzero columns, taps^2 2 C, are within SLICE_K (zero columns add nothing to the
    accumulator)."""
    p = part(c)
    if (p == PART or taps == 1) and taps * taps * 2 * c <= conv.SLICE_K:
        return [(0, 2 * p, 0), (0, p, 1)]
    hi = [(s, PART, 0) for s in range(0, p, PART)]
    return hi + [(p + s, n, 0) for s, n, _ in hi] + [(s, n, 1) for s, n, _ in hi]


def weight_windows(w):
    """A conv weight [O, C, k, k] float32 as the fp16 weights of plan_convs' convolutions, each KRSC [O8, k, k,
    channels] (O8 = product_rows(O); zeros past C and O), one after another in one flat uint16 array; and the
    peak |w|."""
    w = np.asarray(w, np.float32)
    o, c, k, _ = w.shape
    peak = float(np.abs(w).max()) if w.size else 0.0
    p, o8 = part(c), product_rows(o)
    parts = []
    for bits in host_split(w, host_scale(peak)):
        padded = np.zeros((o8, p, k, k), np.uint16)
        padded[:o, :c] = bits
        parts.append(padded.transpose(0, 2, 3, 1))                      # [O8, k, k, P]
    out = [parts[which][..., np.arange(first, first + n) % p].ravel() for first, n, which in plan_convs(c, taps=k)]
    return np.concatenate(out), np.float32(peak)


class _Plan:
    """One built graph: Y [1, O8, rows, W] float32 NHWC = conv(X window [1, n, rows + 2 pad, W]) (+ Z)."""

    def __init__(self, rows, width, p, o8, taps, n, add, first=None):
        import cudnn
        f16, f32 = cudnn.data_type.HALF, cudnn.data_type.FLOAT
        pad = taps // 2
        g = cudnn.pygraph(io_data_type=f16, intermediate_data_type=f32, compute_data_type=f32,
                          handle=_state["handle"])
        h_in = conv.image_rows(rows, taps)
        self.x = g.tensor(name="X", dim=[1, n, h_in, width], stride=[h_in * width * 2 * p, 1, width * 2 * p, 2 * p],
                          data_type=f16)
        self.w = g.tensor(name="W", dim=[o8, n, taps, taps], stride=[taps * taps * n, 1, taps * n, n],
                          data_type=f16)
        y = g.conv_fprop(image=self.x, weight=self.w, pre_padding=[0, pad], post_padding=[0, pad], stride=[1, 1],
                         dilation=[1, 1], compute_data_type=f32, name="conv")
        out = [1, o8, rows, width], [rows * width * o8, 1, width * o8, o8]
        self.z = self.one = None
        if first == "scale":                 # the first convolution as conv * 1: a pointwise-fused engine
            self.one = g.tensor(name="one", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
            y = g.mul(a=y, b=self.one, compute_data_type=f32, name="once")
        if add:
            self.z = g.tensor(name="Z", dim=out[0], stride=out[1], data_type=f32)
            y = g.add(a=y, b=self.z, compute_data_type=f32, name="sum")
        y.set_output(True).set_dim(out[0]).set_stride(out[1]).set_data_type(f32)
        self.y = y
        self.graph = g
        self.zero_workspace = False         # set when its check passes only with a zeroed workspace
        self.workspace_bytes = build(g)


# zero image rows after each chunk's image (what an engine reading past its image meets; the simulator's
# chunks are a row or two: one), then rows of noise after those in check's image (an engine reading further fails)
TAIL = 1 if SIMULATED else 8
GARBAGE = 2 if SIMULATED else 8
FIRST = "plain"       # the first convolution of a sum: "plain", "scale" (conv * 1) or "zero" (conv + zeros)


def _plan(rows, width, p, o8, taps, n, add):
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    first = None if add else FIRST
    if first == "zero":
        add, first = True, None
    key = ("conv", rows, width, p, o8, taps, n, add, first)
    plans = _state.setdefault("plans", {})
    if key not in plans:
        plan = _Plan(rows, width, p, o8, taps, n, add, first)
        worst = check(plan, rows, width, p, o8, taps, n)
        if not worst <= 1 and plan.workspace_bytes:             # NaN fails too
            plan.zero_workspace = check(plan, rows, width, p, o8, taps, n, workspace=0) <= 1
        _state.setdefault("checked", {})[key[1:]] = worst       # each plan's margin, for the record
        if plan.zero_workspace:
            _state.setdefault("zeroed", []).append(key[1:])
        elif not worst <= 1:
            raise RuntimeError(f"the cuDNN plan for {key[1:]} failed its check: error {worst:.3g} x its bound")
        plans[key] = plan
    return plans[key]


GUARD = 1 << 16         # bytes of noise check keeps after the workspace, and after the output (whole pixels)
SENTINEL = 0x7FC0DEAD   # the float32 NaN check fills the output with: an engine that reads it before writing fails


def check(plan, rows, width, p, o8, taps, n, seed=0, workspace=None):
    """Run a freshly built plan once on pseudo-random operands (an image of distinct rows with GARBAGE rows of
    noise before it, then TAIL zero rows as conv2d leaves after each chunk's image and GARBAGE rows of noise;
    weights of the split parts' magnitude, sums past fp16's range, an added Z of the sums' size) and hold
    sampled outputs (the first two and last two rows, random ones; the edge columns and a random one; every
    output channel) against float64 on the host. Returns the worst |error| / bound, the bound K 2^-22 sum
    |terms| (float32 sums of exact fp16 products, at their worst): an engine that reads the wrong rows or
    channels (before its image, or more than TAIL rows past it), drops the add or overflows an fp16
    intermediate fails it; one that only rounds worse may not. The output starts as NaN (an engine that reads
    it first fails), and the workspace holds noise (workspace=None) or that byte: a graph's workspace is a pool
    block that other buffers used before, so an engine that needs it zeroed fails with noise and passes with 0.
    Raises RuntimeError for an engine that writes past its output or its workspace (GUARD bytes after each
    are compared before and after the run): in a graph those bytes belong to other buffers."""
    from numba import cuda
    from .layout import random_bf16
    pad = taps // 2
    rng = np.random.default_rng(seed)
    before, live, extra = GARBAGE * width, conv.image_rows(rows, taps) * width, (TAIL + GARBAGE) * width
    if SIMULATED:                       # the simulator's threads are slow: the host's numbers
        bits = rng.uniform(-4, 4, (before + live + extra, 2 * p)).astype(np.float16).view(np.uint16)
        bits[before + live:before + live + TAIL * width] = 0
        whole = cuda.to_device(bits)
    else:
        whole = cuda.device_array((before + live + extra, 2 * p), np.uint16)
        random_bf16(whole.reshape(whole.size), seed + 1)        # as fp16 bits: +-[0.25, 4), each its own
        whole[before + live:before + live + TAIL * width].copy_to_device(np.zeros((TAIL * width, 2 * p), np.uint16))
    image = whole[before:]
    w = (rng.standard_normal((o8, taps, taps, n)) * 2.0 ** 13).astype(np.float16)
    weights = cuda.to_device(w.view(np.uint16))
    guard_px = -(-GUARD // (4 * o8))
    y_all = cuda.to_device(np.full((rows * width + guard_px, o8), SENTINEL, np.uint32))
    y = y_all[:rows * width]
    z = None
    pack = {plan.x: pointer(image), plan.y: pointer(y), plan.w: pointer(weights)}
    if plan.z is not None:
        if SIMULATED:   # z: the bits of float32 [rows W, O8]
            z = cuda.to_device((rng.standard_normal((rows * width, o8)) * 2.0 ** 20).astype(np.float32).view(np.uint16))
        else:
            z = cuda.device_array((rows * width, 2 * o8), np.uint16)
            random_bf16(z.reshape(z.size), seed + 2, 2.0 ** 20)  # bf16 pairs read as float32: finite, ~1e6
        pack[plan.z] = pointer(z)
    cuda.synchronize()                  # the fills done before cuDNN runs on its handle's stream
    if plan.one is not None:
        pack[plan.one] = pointer(_constant(1.0, 1))
    size = max(1, plan.workspace_bytes)
    space_bytes = np.full(size, workspace, np.uint8) if workspace is not None else rng.integers(0, 256, size, np.uint8)
    guard = rng.integers(0, 256, GUARD, np.uint8)
    space = cuda.to_device(np.concatenate([space_bytes, guard]))
    plan.graph.execute(pack, pointer(space), handle=_state["handle"])
    cuda.synchronize()
    if not np.array_equal(space.copy_to_host()[size:], guard):
        raise RuntimeError(f"the cuDNN plan writes past its workspace of {plan.workspace_bytes} bytes")
    if not np.all(y_all.copy_to_host()[rows * width:] == SENTINEL):
        raise RuntimeError("the cuDNN plan writes past its output")
    x = image.copy_to_host()[:live].view(np.float16).astype(np.float64)
    x = x.reshape(conv.image_rows(rows, taps), width, 2 * p)[..., :n]
    x = np.pad(x, ((0, 0), (pad, pad), (0, 0)))                # the convolution's left and right padding
    got = y.copy_to_host().view(np.float32).reshape(rows, width, o8)
    extra = 0 * got if z is None else z.copy_to_host().view(np.float32).astype(np.float64).reshape(rows, width, o8)
    picks = sorted({0, min(1, rows - 1), max(rows - 2, 0), rows - 1, *rng.integers(0, rows, 8).tolist()})
    cols = sorted({0, width - 1, int(rng.integers(0, width))})
    w64 = w.astype(np.float64)
    worst = 0.0
    for r in picks:
        for c in cols:
            patch = x[r:r + taps, c:c + taps]                     # [taps, taps, n]
            ref = np.einsum("ijc,oijc->o", patch, w64) + extra[r, c]
            terms = np.einsum("ijc,oijc->o", np.abs(patch), np.abs(w64)) + np.abs(extra[r, c])
            bound = taps * taps * n * 2.0 ** -22 * terms + 1e-30
            err = float(np.max(np.abs(got[r, c] - ref) / bound))
            if np.isnan(err):
                return err                                      # max() would drop it
            worst = max(worst, err)
    return worst


def _constant(value, n):
    """A device float32 array of n values `value`, made once (before a capture: the eager pass makes it)."""
    from numba import cuda
    key = ("constant", value, n)
    if key not in _state:
        _state[key] = cuda.to_device(np.full(n, value, np.float32))
    return _state[key]


def _zero(a, size, stream):
    """size bytes of device array a set to 0 on the stream (a memset node when the stream is capturing)."""
    if SIMULATED:
        a[:size] = 0
        return
    from cuda.bindings import driver
    err, = driver.cuMemsetD8Async(pointer(a), 0, size, stream_handle(stream))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemsetD8Async: {err}")


def convolve(image, weights, ys, rows, width, c, taps, workspace, stream=0):
    """The split product of one chunk: image [(rows + 2 pad) W, 2 P] fp16 bits (conv.split_image) of a
    conv of C input channels, weights from weight_windows (on the device), ys two float32 [rows W, O8] buffers;
    returns the one holding the sum (the product still scaled, as conv.half_product leaves it for
    conv.finish). workspace: a uint8 device array of at least workspace_bytes(...)."""
    import cudnn
    p, o8 = image.shape[1] // 2, ys[0].shape[1]
    handle = _state["handle"]
    cudnn.set_stream(handle, stream_handle(stream))
    z, offset = None, 0
    for i, (first, n, _) in enumerate(plan_convs(c, taps)):
        plan = _plan(rows, width, p, o8, taps, n, z is not None)
        y = ys[i % 2]
        pack = {plan.x: pointer(image) + 2 * first, plan.y: pointer(y), plan.w: pointer(weights) + 2 * offset}
        if plan.z is not None:
            pack[plan.z] = pointer(z if z is not None else _constant(0.0, ys[0].size))
        if plan.one is not None:
            pack[plan.one] = pointer(_constant(1.0, 1))
        if plan.zero_workspace:
            _zero(workspace, plan.workspace_bytes, stream)
        plan.graph.execute(pack, pointer(workspace), handle=handle)
        z, offset = y, offset + o8 * taps * taps * n
    return z


def workspace_bytes(rows, width, c, o8, taps):
    p, convs = part(c), plan_convs(c, taps)
    return max(_plan(rows, width, p, o8, taps, n, i > 0).workspace_bytes for i, (_, n, _) in enumerate(convs))
