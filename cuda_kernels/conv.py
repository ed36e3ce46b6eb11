"""The VAE's image ops: split fp16 images of a conv, the split products, group norm, latents in and out, pixels out.

A float32 operand x is written as two fp16 parts, hi = fp16(x s), lo = fp16(x s - hi), s a power of two that puts
max |x| just under 2^15 (fp16's range; the scale comes from a device-side max, so nothing waits for the host).
hi + lo holds 22 bits of x s; a product takes the three terms hi*hi + lo*hi + hi*lo of its two operands on
tensor cores with float32 accumulation: the left operand is stored once as [a_hi | a_lo], the right one as
[w_hi | w_hi | w_lo], each part K rounded up to 128 columns (zeros past K), and the product sums two fp16
products, [a_hi | a_lo] . [w_hi | w_hi] and a_hi . w_lo; `finish` then divides the scales out and adds the
bias. bf16 parts (16 bits) are too coarse for float32-level pixels; TF32 parts run at half the rate.

A k x k conv needs no columns: its input is split once into an image whose rows carry a zero pixel each side
(the padding) and whose pixels are [hi | lo | hi] (split_image triple), so tap (dy, dx) of every output pixel
is the image row dy (W + 2) + dx further on; one product a tap with the weight's [w_hi | w_hi | w_lo] of that
tap (tap_weights) reads the image in place, and cuBLAS sums the taps into one float32 product (tap_product).
The encoder's stride-2 3x3 conv (bottom and right padding) is a 2x2 one over its input's 2x2 phases, which the
split reads through (split_image down, down_weight), its taps from one pixel on (tap_product's origin).
"""

import functools
import math

import numpy as np
from numba import cuda, float32, int32, int64, uint16, uint32, uint64

from .core import BLOCK, EPS32, SIMULATED, Case, as_float32, float32_bits, gamma, jit, ptx_op
from .dit import fast_sigmoid

U = uint64                    # an index known >= 0: no wraparound code for negative indices
R_16F, R_32F = 2, 0           # cudaDataType
TOP = 14                      # a scaled operand's max lies in [2^14, 2^15)
TILE = 32                     # finish's transpose tile
TILE_PAD = TILE + 1           # its shared rows, padded against bank conflicts
ROWS = 8                      # thread rows of a finish / split_image block
PART = 128                    # a split part's columns are a multiple of this (256-byte aligned parts and slices)
SPLIT_PX = 4 if SIMULATED else 32      # pixels (of one image row) of a split_image block
SPLIT_CH = 16 if SIMULATED else 64     # channels of a split_image block (divides PART)
DEVICE_GN_PARTS = 64                    # blocks per group in the group norm's sums
GN_PARTS = 2 if SIMULATED else DEVICE_GN_PARTS
DEVICE_COLUMN_BYTES = 192 << 20         # the columns of one chunk of pixel rows of a 1x1 conv
DEVICE_TAP_BYTES = 32 << 20             # a tap conv chunk's split image and product (24, 32, 40, 48 MB: 112.2, 103.1,
                                        # 102.1, 115.0 ms a 1024 decode, results/h100/decoder-b06418a.json)
TAP_BYTES = 2048 if SIMULATED else DEVICE_TAP_BYTES                  # two-row chunks of the simulator's images
COLUMN_BYTES = 4 << 20 if SIMULATED else DEVICE_COLUMN_BYTES


def _blocks(n):
    return max(1, min(-(-n // BLOCK), 2 if SIMULATED else 8192))


# --- fp16 bits <-> float32 ------------------------------------------------------------------
@jit(device=True)
def to_half_stated(x):
    """float32 -> fp16 bits, round to nearest even, subnormals kept, overflow to inf (NaN not special-cased):
    the statement of cvt.rn.f16.f32, which `to_half` is on the GPU."""
    b = float32_bits(x)
    sign = (b >> uint32(16)) & uint32(0x8000)
    e = int32((b >> uint32(23)) & uint32(0xFF)) - 112          # fp16 exponent field
    m = b & uint32(0x7FFFFF)
    if e >= 31:
        return uint16(sign | uint32(0x7C00))
    if e <= 0:
        if e < -10:
            return uint16(sign)
        m = m | uint32(0x800000)
        shift = uint32(14 - e)
        r = m >> shift
        rem = m & ((uint32(1) << shift) - uint32(1))
        half = uint32(1) << (shift - uint32(1))
        if rem > half or (rem == half and (r & uint32(1)) == uint32(1)):
            r += uint32(1)
        return uint16(sign | r)
    r = (uint32(e) << uint32(10)) | (m >> uint32(13))
    rem = m & uint32(0x1FFF)
    if rem > uint32(0x1000) or (rem == uint32(0x1000) and (r & uint32(1)) == uint32(1)):
        r += uint32(1)                                           # a carry into the exponent is right
    return uint16(sign | r)


@jit(device=True)
def from_half_stated(h):
    """fp16 bits -> float32, exact (finite values): the statement of cvt.f32.f16, which `from_half` is on the GPU."""
    h = uint32(h)
    e = (h >> uint32(10)) & uint32(0x1F)
    m = h & uint32(0x3FF)
    if e == uint32(0):
        v = float32(m) * float32(2.0 ** -24)
        return -v if (h & uint32(0x8000)) != uint32(0) else v
    return as_float32(((h & uint32(0x8000)) << uint32(16)) | ((e + uint32(112)) << uint32(23)) | (m << uint32(13)))


if SIMULATED:            # the simulator cannot run inline PTX: the statements above
    to_half, from_half = to_half_stated, from_half_stated
else:
    from numba import types as _types
    _to_half_ptx = ptx_op("cvt.rn.f16.f32 $0, $1;", _types.uint16, _types.float32, "=h,f",
                          "float32 -> fp16 bits, round to nearest even: one conversion")
    _from_half_ptx = ptx_op("cvt.f32.f16 $0, $1;", _types.float32, _types.uint16, "=f,h",
                            "fp16 bits -> float32, exact: one conversion")

    @jit(device=True, forceinline=True)
    def to_half(x):
        """float32 -> fp16 bits, round to nearest even (to_half_stated)."""
        return _to_half_ptx(x)

    @jit(device=True, forceinline=True)
    def from_half(h):
        """fp16 bits -> float32, exact (from_half_stated)."""
        return _from_half_ptx(h)


@jit(device=True)
def scale_of(peak):
    """The power of two s with peak * s in [2^TOP, 2^(TOP + 1)) (1 for a zero peak)."""
    e = int32((float32_bits(peak) >> uint32(23)) & uint32(0xFF)) - 127
    if peak <= float32(0.0):
        e = TOP
    e = min(max(TOP - e, -120), 120)
    return as_float32(uint32(e + 127) << uint32(23))


# --- host-side twins (weights are split once on the host; references) ----------------------
def host_scale(peak):
    """scale_of on the host."""
    if peak <= 0:
        return 1.0
    e = int(np.frexp(np.float32(peak))[1]) - 1
    return float(2.0 ** min(max(TOP - e, -120), 120))


def host_split(x, scale):
    """(hi, lo) fp16 bits of float32 x * scale, as the kernels write them."""
    xs = np.asarray(x, np.float32) * np.float32(scale)
    hi = xs.astype(np.float16)
    lo = (xs - hi.astype(np.float32)).astype(np.float16)
    return hi.view(np.uint16), lo.view(np.uint16)


def half_value(bits):
    return np.asarray(bits, np.uint16).view(np.float16).astype(np.float64)


def part(k):
    """The columns of one split part of K columns: K rounded up to a multiple of PART."""
    return -(-k // PART) * PART


def split_width(k, weight=False):
    """Columns of a split operand of K columns: [hi | lo] (left), [hi | hi | lo] (weight, the right one)."""
    return (3 if weight else 2) * part(k)


def product_rows(o):
    """A weight's rows in the product: O rounded up to a multiple of 8, so each row of the float32 product is
    a multiple of 32 bytes (with O = 3, the decoder's last conv, cuBLASLt takes its slow sm_75 kernels)."""
    return -(-o // 8) * 8


def weight_matrix(w):
    """A conv weight [O, C, kh, kw] (or a linear's [O, C]) as the product's right operand: fp16 bits
    [product_rows(O), 3 P] = [w_hi | w_hi | w_lo], P = part(K), in column order k = tap C + c, zeros past K in
    each part and in the rows past O; and its peak |w| (the scale's source)."""
    w = np.asarray(w, np.float32)
    o = w.shape[0]
    m = w.reshape(o, w.shape[1], -1).transpose(0, 2, 1).reshape(o, -1) if w.ndim == 4 else w
    peak = float(np.abs(m).max()) if m.size else 0.0
    hi, lo = host_split(m, host_scale(peak))
    k, p = m.shape[1], part(m.shape[1])
    out = np.zeros((product_rows(o), 3 * p), np.uint16)
    for i, bits in enumerate((hi, hi, lo)):
        out[:o, i * p:i * p + k] = bits
    return out, np.float32(peak)


# --- kernels ------------------------------------------------------------------------------
@jit(device=True, forceinline=True)
def divmod32(a, b):
    """(a // b, a % b) for 0 <= a < 2^32 and 0 < b < 2^32, as int64, from a 32-bit unsigned division (numba
    types integer division 64-bit and signed, a much longer instruction sequence)."""
    q = uint32(a) // uint32(b)
    return int64(q), int64(uint32(a) - uint32(q) * uint32(b))


@jit(device=True, forceinline=True)
def _gn_affine(v, c, stats, w, b):
    """(v - mean) (w[c] rstd) + b[c] for a value v of channel c, its group's (mean, rstd) in stats [G, 2+]
    (consecutive channel groups). The one formula of the group norm's output wherever it is made."""
    return _gn_affine_of(v, c, c // (w.shape[0] // stats.shape[0]), stats, w, b)


@jit(device=True, forceinline=True)
def _gn_affine_of(v, c, g, stats, w, b):
    """_gn_affine with the channel's group g given."""
    return (v - stats[g, 0]) * (w[c] * stats[g, 1]) + b[c]


@jit(device=True, forceinline=True)
def _gn_silu(v, c, stats, w, b):
    """silu of _gn_affine."""
    return _gn_silu_of(v, c, c // (w.shape[0] // stats.shape[0]), stats, w, b)


@jit(device=True, forceinline=True)
def _silu(y):
    """y sigmoid(y) through the special-function unit (dit.fast_sigmoid: 2^x and 1 / x within 2^-22 each, the
    argument's rounding |y| 2^-24); the sigmoid's argument stops at -80 (below it silu is within 2^-110 |y| of
    0, and the simulator's exp would overflow)."""
    return y * fast_sigmoid(max(y, float32(-80.0)))


@jit(device=True, forceinline=True)
def _gn_silu_of(v, c, g, stats, w, b):
    """silu of _gn_affine_of."""
    return _silu(_gn_affine_of(v, c, g, stats, w, b))


def _make_zero():
    @jit
    def zero(peak):
        if cuda.grid(1) == 0:
            peak[0] = float32(0.0)
    return zero


def _make_absmax(control):
    @jit
    def absmax(x, peak):
        """peak[0] = max(peak[0], max |x|) over x [rows, plane] (peak zeroed before): blocks of blockIdx.y's rows,
        blockIdx.x's share of each row."""
        sh = cuda.shared.array(BLOCK, float32)
        tid = cuda.threadIdx.x
        plane = int32(x.shape[1])
        first = int32(cuda.blockIdx.x * BLOCK + tid)
        step = int32(cuda.gridDim.x * BLOCK)
        m = float32(0.0)
        for r in range(cuda.blockIdx.y, x.shape[0], cuda.gridDim.y):
            for j in range(first, plane, step):
                v = x[r, j]
                m = max(m, v if control else abs(v))
        sh[tid] = m
        cuda.syncthreads()
        half = BLOCK // 2
        while half > 0:
            if tid < half:
                sh[tid] = max(sh[tid], sh[tid + half])
            cuda.syncthreads()
            half //= 2
        if tid == 0:
            cuda.atomic.max(peak, 0, sh[0])
    return absmax


def _make_split_rows(control):
    @jit
    def split_rows(x, peak, out, weight):
        """x [M, K] -> out fp16 bits of x * scale_of(peak), parts of P = part(K) columns, zeros past K: [M, 2P]
        [hi | lo], or (weight) [M, 3P] [hi | hi | lo]."""
        s = scale_of(peak[0])
        k = x.shape[1]
        p = out.shape[1] // (3 if weight else 2)
        for i in range(cuda.grid(1), x.shape[0] * p, cuda.gridsize(1)):
            r, c = i // p, i % p
            v = x[r, c] * s if c < k else float32(0.0)
            hi = to_half(v)
            lo = to_half(v - from_half(hi)) if not control else uint16(0)
            out[r, c] = hi
            out[r, p + c] = hi if weight else lo
            if weight:
                out[r, 2 * p + c] = lo
    return split_rows


@functools.cache
def _make_split_image(control, up, norm=False, triple=False, down=False):
    """The split image of a conv's input (conv.split_image): up: the input is the nearest-2x upsampling of x
    (read through, never written); norm: it is silu(group_norm(x)) of the group statistics in stats; triple:
    each pixel holds [hi | lo | hi] (the taps' layout), else [hi | lo]; down: the input is the 2x2 phases of x
    [C, H, W], [4C, H/2, W/2] with channel (2a + b) C + c at (y, x) = x[c, 2y + a, 2x + b] (read through: a
    stride-2 conv's input as a stride-1 conv's, down_weight); its control reads the phases (a, b) swapped.

    A block takes a tile of SPLIT_PX pixels of one image row and SPLIT_CH channels: it reads the tile along
    the row (coalesced), makes each value (norm), scales and splits it once into a (hi, lo) word in shared
    memory, then writes the tile's pixels along their channels, two channels a 4-byte word (coalesced); the
    blocks of the last channel tile also write the zero channels up to P."""
    tile_shape = (SPLIT_CH, SPLIT_PX + 1)       # a tile's words, rows padded against bank conflicts
    PER_THREAD = SPLIT_CH // ROWS               # channels a thread reads (blockDim.y = ROWS)
    PX_STEPS = -(-SPLIT_PX // ROWS)             # pixels a thread writes

    @jit(launch_bounds=(SPLIT_PX * ROWS, 4))    # four blocks an SM (at most 64 registers)
    def split_image(x, flat, peak, words, rows, width, r0, half, stats, gw, gb, pad):
        """words = the image [rows (W + 2 pad), parts P] fp16 bits as 4-byte words: pixel q's words [0, half)
        hold hi of channels (2 j, 2 j + 1), words [half, 2 half) their lo (half = P / 2), and with triple words
        [2 half, 3 half) hi again; image row i is input row r0 + i, its pixel j input column j - pad; zero
        outside x; channels past C are zero. flat: x as one row (the loads' addresses: one add a value)."""
        sh = cuda.shared.array(tile_shape, uint32)
        aff = cuda.shared.array((3, SPLIT_CH), float32)     # norm: each channel's (mean, w rstd, b)
        got = cuda.local.array(PER_THREAD, float32)
        s = scale_of(peak[0])
        c_x, plane = x.shape[0], x.shape[1] * x.shape[2]
        c_in = 4 * c_x if down else c_x
        h = 2 * x.shape[1] if up else (x.shape[1] // 2 if down else x.shape[1])
        span_px = width + 2 * pad                    # pixels of an image row
        pixel_words = 3 * half if triple else 2 * half
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        c0 = cuda.blockIdx.y * SPLIT_CH
        per_row = (span_px + SPLIT_PX - 1) // SPLIT_PX
        pairs = SPLIT_CH // 2
        # word pairs a pixel's row gets from this block: its tile's, and the last block the zeros up to P
        span = half - c0 // 2 if cuda.blockIdx.y == cuda.gridDim.y - 1 else pairs
        if norm:       # the affine of the block's channels, _gn_affine_of's terms, made once a block
            t = ty * SPLIT_PX + tx
            if t < SPLIT_CH and c0 + t < c_in:
                c = c0 + t
                g = c // (gw.shape[0] // stats.shape[0])
                aff[0, t], aff[1, t], aff[2, t] = stats[g, 0], gw[c] * stats[g, 1], gb[c]
            cuda.syncthreads()
        for tile in range(cuda.blockIdx.x, rows * per_row, cuda.gridDim.x):
            i, x0 = divmod32(tile, per_row)
            x0 *= SPLIT_PX
            y, xx = r0 + i, x0 + tx - pad
            live = 0 <= y < h and 0 <= xx < width
            at_x = 0
            if live and not down:
                at_x = (c0 + ty) * plane + ((y // 2) * x.shape[2] + xx // 2 if up else y * x.shape[2] + xx)
            for j in range(PER_THREAD):                  # every load issued before the first is used
                c = c0 + ty + j * ROWS
                got[j] = float32(0.0)
                if live and c < c_in:
                    if down:                             # channel c: phase (a, b) of input channel cc
                        phase, cc = divmod32(c, c_x)
                        pa, pb = (phase % 2, phase // 2) if control else (phase // 2, phase % 2)
                        got[j] = flat[U(cc * plane + (2 * y + pa) * x.shape[2] + 2 * xx + pb)]
                    else:
                        got[j] = flat[U(at_x + j * ROWS * plane)]
            cuda.syncthreads()                           # the previous tile's reads of sh are done
            for j in range(PER_THREAD):
                c = c0 + ty + j * ROWS
                word = uint32(0)                         # zero rows, columns and channels: no conversions
                if live and c < c_in:
                    v = got[j]
                    if norm:               # _gn_silu_of, its terms from the block's table
                        at = ty + j * ROWS
                        v = _silu((v - aff[0, at]) * aff[1, at] + aff[2, at])
                    v *= s
                    hi = to_half(v)
                    lo = to_half(v - from_half(hi)) if down or not control else uint16(0)
                    word = uint32(hi) | (uint32(lo) << uint32(16))
                sh[U(ty + j * ROWS), U(tx)] = word
            cuda.syncthreads()
            # a warp writes one pixel's word pairs (tx along them), the block's rows the tile's pixels
            for pp in range(PX_STEPS):                  # a fixed count: unrolled, the stores issued together
                px = ty + pp * ROWS
                if px < SPLIT_PX and x0 + px < span_px:
                    at = (i * span_px + x0 + px) * pixel_words + c0 // 2
                    for pr in range(tx, span, SPLIT_PX):
                        lo_pair, hi_pair = uint32(0), uint32(0)
                        if pr < pairs:
                            a, b = sh[U(2 * pr), U(px)], sh[U(2 * pr + 1), U(px)]
                            hi_pair = (a & uint32(0xFFFF)) | (b << uint32(16))
                            lo_pair = (a >> uint32(16)) | (b & uint32(0xFFFF0000))
                        words[U(at + pr)] = hi_pair
                        words[U(at + half + pr)] = lo_pair
                        if triple:
                            words[U(at + 2 * half + pr)] = hi_pair
    return split_image


def _make_finish(control):
    @jit
    def finish(d, peak_a, peak_w, bias, res, out, offset, channels, span):
        """out = d / (scale_a scale_w) + bias (+ res) over d [M, N]: channels: out is [N, total] (out[n, offset +
        m], a transpose through a shared tile), else out [M, N] (out[m, n]); bias [N] or empty; res shaped as
        out, or empty (added last). span > 0 (channels only): d's rows are the taps' grid, rows of span = W + 2
        pixels of which the last two are not the image's: row m is pixel (m // span) W + m % span, or none."""
        sh = cuda.shared.array((TILE, TILE_PAD), float32)
        inv = float32(1.0) / (scale_of(peak_a[0]) * scale_of(peak_w[0]))
        m0, n0 = cuda.blockIdx.x * TILE, cuda.blockIdx.y * TILE
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        for jj in range(TILE // ROWS):          # fixed counts: unrolled, the loads issued together
            j = ty + jj * ROWS
            m, n = m0 + j, n0 + tx
            if m < d.shape[0] and n < d.shape[1]:
                v = d[U(m), U(n)] * inv
                if bias.size > 0:
                    v += bias[U(n)] if not control else bias[0]
                sh[U(j), U(tx)] = v
        cuda.syncthreads()
        m, q, live = m0 + tx, m0 + tx, True      # channels: this thread's product row and its pixel q
        if channels and span > 0:
            # grid row m = (row, column) of the taps' grid: one 32-bit division (of the block's m0), then steps
            row, col = divmod32(m0, span)
            col += tx
            while col >= span:
                col -= span
                row += 1
            q, live = row * (span - 2) + col, col < span - 2
        for jj in range(TILE // ROWS):
            j = ty + jj * ROWS
            if channels:
                n = n0 + j
                if m < d.shape[0] and n < d.shape[1] and live:
                    v = sh[U(tx), U(j)]
                    if res.size > 0:
                        v += res[U(n), U(offset + q)]
                    out[U(n), U(offset + q)] = v
            else:
                m, n = m0 + j, n0 + tx
                if m < d.shape[0] and n < d.shape[1]:
                    v = sh[U(j), U(tx)]
                    if res.size > 0:
                        v += res[U(m), U(n)]
                    out[U(m), U(n)] = v
    return finish


def _make_gn_sums(control):
    @jit
    def gn_sums(x, means, squares, extremes):
        """One pass over block b's share of group g (x [G, n]; the elements i = b BLOCK + t + k GN step,
        step = blocks BLOCK): with K the mean of min(BLOCK, n) values spread over the group (the same in every
        block), S1 = sum (x - K) and S2 = sum (x - K)^2 over the share; means[g, b] = K + S1 / n_b and
        squares[g, b] = S2 - S1^2 / n_b (its sum of squares about its own mean; both 0 / K for an empty share).
        extremes [2, G, blocks] (or empty): the share's min and max of x."""
        sh = cuda.shared.array(BLOCK, float32)
        sq = cuda.shared.array(BLOCK, float32)
        low = cuda.shared.array(BLOCK, float32)
        high = cuda.shared.array(BLOCK, float32)
        g, b, tid = cuda.blockIdx.y, cuda.blockIdx.x, cuda.threadIdx.x
        n = x.shape[1]
        ends = extremes.size > 0
        taken = min(BLOCK, n)                 # the shift: a mean of values spread over the group
        sh[tid] = x[g, U(tid * (n // taken))] if tid < taken else float32(0.0)
        cuda.syncthreads()
        half = BLOCK // 2
        while half > 0:
            if tid < half:
                sh[tid] += sh[tid + half]
            cuda.syncthreads()
            half //= 2
        shift = sh[0] / float32(taken)
        cuda.syncthreads()                    # every thread has read sh[0] before it is written again
        acc = cuda.local.array(4, float32)    # four sums of each kind a thread, four loads in flight
        acc2 = cuda.local.array(4, float32)
        for u in range(4):
            acc[u], acc2[u] = float32(0.0), float32(0.0)
        lo, hi = float32(math.inf), float32(-math.inf)
        step = cuda.gridDim.x * BLOCK
        i = b * BLOCK + tid
        while i < n:
            for u in range(4):
                if i + u * step < n:
                    v = x[g, U(i + u * step)]
                    d = v - shift
                    acc[u] += d
                    acc2[u] += d if control else d * d
                    if ends:
                        lo, hi = min(lo, v), max(hi, v)
            i += 4 * step
        sh[tid], sq[tid] = (acc[0] + acc[1]) + (acc[2] + acc[3]), (acc2[0] + acc2[1]) + (acc2[2] + acc2[3])
        low[tid], high[tid] = lo, hi
        cuda.syncthreads()
        half = BLOCK // 2
        while half > 0:
            if tid < half:
                sh[tid] += sh[tid + half]
                sq[tid] += sq[tid + half]
                if ends:
                    low[tid], high[tid] = min(low[tid], low[tid + half]), max(high[tid], high[tid + half])
            cuda.syncthreads()
            half //= 2
        if tid == 0:
            count = _share_count(n, b, cuda.gridDim.x)
            mean, m2 = shift, float32(0.0)
            if count > 0:
                s1 = sh[0]
                mean = shift + s1 / float32(count)
                m2 = sq[0] - s1 * (s1 / float32(count))
            means[g, b], squares[g, b] = mean, m2
            if ends:
                extremes[0, g, b], extremes[1, g, b] = low[0], high[0]
    return gn_sums


@jit(device=True, forceinline=True)
def _share_count(n, b, blocks):
    """Elements of a group of n that block b of `blocks` takes in gn_sums (b BLOCK + t + k blocks BLOCK)."""
    step = blocks * BLOCK
    full = n // step
    return full * BLOCK + min(max(n - full * step - b * BLOCK, 0), BLOCK)


SILU_LOW = 0.2785    # max |silu(y)| over y < 0 (at y = -1.2785: 0.27846...), rounded up


def _make_gn_stats(control):
    @jit
    def gn_stats(partial, n, eps, w, b, peak):
        """partial[0, g, :2] = (mean, 1 / sqrt(var + eps)) of group g (n values) from its blocks' shares: their
        means partial[0, g, :] and sums of squares about them partial[1, g, :] (gn_sums): the mean as the
        first share's plus the counted differences, the squares as the shares' plus each count times its
        mean's squared distance from the group's (one thread a group, one block). With w, b and peak [1] (else
        empty): peak[0] = a bound on max |silu(group_norm(x))| from each group's extremes partial[2:4, g, :]: the
        affine y of a channel c is monotone in x, so over the group's [min, max] it spans [y_lo, y_hi] and
        |silu(y)| <= max(y_hi, 0) above zero and <= min(SILU_LOW, |y_lo| / 2) below it."""
        sh = cuda.shared.array(1024, float32)
        g = cuda.threadIdx.x
        groups = partial.shape[1]
        bound = float32(0.0)
        if g < groups:
            lo, hi = float32(math.inf), float32(-math.inf)
            ends = peak.size > 0
            parts = partial.shape[2]
            first, moved = partial[0, g, 0], float32(0.0)
            for j in range(parts):
                moved += float32(_share_count(n, j, parts)) * (partial[0, g, j] - first)
                if ends:
                    lo, hi = min(lo, partial[2, g, j]), max(hi, partial[3, g, j])
            mean = first + moved / float32(n)
            m2 = float32(0.0)
            for j in range(parts):
                d = partial[0, g, j] - mean
                m2 += partial[1, g, j] + float32(_share_count(n, j, parts)) * (d * d)
            rstd = float32(1.0) / math.sqrt(max(m2 / float32(n), float32(0.0)) + eps)
            partial[0, g, 0] = mean
            partial[0, g, 1] = rstd
            if ends:
                per = w.shape[0] // groups
                shift = float32(0.0) if control else mean
                for c in range(g * per, (g + 1) * per):
                    k = w[c] * rstd
                    y0, y1 = (lo - shift) * k + b[c], (hi - shift) * k + b[c]
                    top, bottom = max(y0, y1), min(y0, y1)
                    bound = max(bound, max(top, float32(0.0)),
                                min(float32(SILU_LOW), float32(0.5) * max(-bottom, float32(0.0))))
        sh[g] = bound
        cuda.syncthreads()
        if g == 0 and peak.size > 0:
            for j in range(1, groups):
                bound = max(bound, sh[j])
            peak[0] = bound * float32(1.0 + 2.0 ** -10)     # past the float32 roundings of y and silu
    return gn_stats


def _make_gn_apply():
    @jit
    def gn_apply(x, stats, w, b, out, silu):
        """out = (x - mean) * (w[c] rstd) + b[c] (then silu) over x [C, P] of consecutive channel groups, stats
        [G, 2+] their (mean, rstd)."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            c, p = i // x.shape[1], i % x.shape[1]
            out[c, p] = _gn_silu(x[c, p], c, stats, w, b) if silu else _gn_affine(x[c, p], c, stats, w, b)
    return gn_apply


def _make_unpack(control):
    @jit
    def unpack(lat, std, mean, out):
        """out[c, 2i + a, 2j + b] = lat[4c + 2a + b, i, j] * std[k] + mean[k] (BN de-normalisation, 2x2 unpatchify)."""
        h, w = lat.shape[1], lat.shape[2]
        for idx in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            c = idx // (4 * h * w)
            y = (idx // (2 * w)) % (2 * h)
            xx = idx % (2 * w)
            k = 4 * c + 2 * (y % 2) + xx % 2
            if control:
                k = 4 * c + 2 * (xx % 2) + y % 2
            v = lat[k, y // 2, xx // 2] * std[k]
            out[c, y, xx] = v + mean[k]
    return unpack


def _make_pack(control):
    @jit
    def pack(z, std, mean, out):
        """out[4c + 2a + b, i, j] = (z[c, 2i + a, 2j + b] - mean[k]) / std[k] (2x2 patchify, BN normalisation)."""
        h, w = out.shape[1], out.shape[2]
        for idx in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            k = idx // (h * w)
            i = (idx // w) % h
            j = idx % w
            a, b = (k % 4) // 2, k % 2
            if control:
                a, b = b, a
            v = z[k // 4, 2 * i + a, 2 * j + b] - mean[k]
            out[k, i, j] = v / std[k]
    return pack


def _make_pixels(control):
    @jit
    def pixels(image, out):
        """out[y, x, c] = diffusers' uint8 of image[c, y, x]: x*0.5+0.5 clamped to [0, 1], *255, half to even."""
        h, w = image.shape[1], image.shape[2]
        for idx in range(cuda.grid(1), image.size, cuda.gridsize(1)):
            c, y, xx = idx // (h * w), (idx // w) % h, idx % w
            v = image[c, y, xx] * float32(0.5)
            v = min(max(v + float32(0.5), float32(0.0)), float32(1.0)) * float32(255.0)
            r = math.floor(v)
            f = v - r
            if f > float32(0.5) or (f == float32(0.5) and not control and r % float32(2.0) == float32(1.0)):
                r += float32(1.0)
            out[y, xx, c] = np.uint8(r)
    return pixels


_zero = _make_zero()
_absmax = {c: _make_absmax(c) for c in (False, True)}
_split_rows = {c: _make_split_rows(c) for c in (False, True)}
_finish = {c: _make_finish(c) for c in (False, True)}
_gn_sums = {c: _make_gn_sums(c) for c in (False, True)}
_gn_stats = {c: _make_gn_stats(c) for c in (False, True)}
_gn_apply = _make_gn_apply()
_unpack = {c: _make_unpack(c) for c in (False, True)}
_pixels = {c: _make_pixels(c) for c in (False, True)}
_pack = {c: _make_pack(c) for c in (False, True)}


# --- launchers ----------------------------------------------------------------------------
def absmax(x, peak, stream=0, control=False):
    """peak[0] = max |x| over x (any shape, contiguous), on the device."""
    _zero[1, 1, stream](peak)
    rows = x.shape[0]
    plane = x.size // rows
    across = max(1, min(-(-plane // (4 * BLOCK)), -(-4096 // rows)))     # ~4096 blocks, >= 4 values a thread
    grid = (1, 2) if SIMULATED else (across, min(rows, 65535))
    _absmax[control][grid, BLOCK, stream](x.reshape(rows, plane), peak)


def _no_norm():
    """The (stats, w, b) arguments of a kernel that normalises nothing."""
    return _empty(2), _empty(1), _empty(1)


def split_rows(x, peak, out, weight=False, stream=0, control=False):
    """out fp16 bits of x [M, K] scaled by scale_of(peak[0]), [M, split_width(K, weight)]: [hi | lo], or
    [hi | hi | lo] (weight), each part part(K) columns, zeros past K."""
    _split_rows[control][_blocks(x.shape[0] * part(x.shape[1])), BLOCK, stream](x, peak, out, weight)


def chunk_rows(c_in, width):
    """Output image rows per chunk of a 1x1 conv: as many as keep its columns within COLUMN_BYTES."""
    return max(1, COLUMN_BYTES // (split_width(c_in) * 2 * width))


def split_image(x, peak, image, r0, up=False, norm=None, stream=0, control=False, triple=False, down=False):
    """image [rows W', parts P] fp16 bits: the split input of each pixel of input rows r0.. of a conv over x
    [C, H, W] (up: over the nearest-2x upsampling of x; norm (stats, w, b) from group_stats: over
    silu(group_norm(x)); down: over x's 2x2 phases [4C, H/2, W/2], H and W even), scaled by scale_of(peak[0]);
    rows outside the image are zero. [hi | lo] per pixel (parts = 2, W' = W, P = part(C)), or with triple the
    taps' layout: [hi | lo | hi] (parts = 3, P = tap_part(C)) and W' = W + 2, a zero pixel each side of a row
    (the conv's padding)."""
    width = 2 * x.shape[2] if up else (x.shape[2] // 2 if down else x.shape[2])
    channels = 4 * x.shape[0] if down else x.shape[0]
    parts, pad = (3, 1) if triple else (2, 0)
    span = width + 2 * pad
    rows, p = image.shape[0] // span, image.shape[1] // parts
    tiles = rows * -(-span // SPLIT_PX)
    grid = (max(1, min(tiles, 2 if SIMULATED else 65535)), max(1, -(-channels // SPLIT_CH)))
    stats, w, b = _no_norm() if norm is None else norm
    _make_split_image(control, up, norm is not None, triple, down)[grid, (SPLIT_PX, ROWS), stream](
        x, x.reshape(x.size), peak, image.reshape(image.size).view(np.uint32), rows, width, int(r0), p // 2,
        stats, w, b, pad)


def image_rows(rows, taps):
    """Rows of the split image a chunk of `rows` output rows reads."""
    return rows + 2 * (taps // 2)


def finish(d, peak_a, peak_w, bias, out, offset=0, channels=False, residual=None, stream=0, control=False, span=0):
    """out from the scaled product d [M, N] (see the kernel); bias None or [N]; residual None or shaped as out;
    span: the taps' grid row (W + 2) when d is a tap product's, else 0."""
    bias = _empty(1) if bias is None else bias
    residual = _empty(2) if residual is None else residual.reshape(out.shape)
    grid = (-(-d.shape[0] // TILE), -(-d.shape[1] // TILE))
    _finish[control][grid, (TILE, ROWS), stream](d, peak_a, peak_w, bias, residual, out, int(offset),
                                                 bool(channels), int(span))


def _empty(ndim):
    """A float32 array of ndim dimensions and no elements: the kernels' 'none' (one per process on the device)."""
    return cuda.device_array((0,) * ndim, np.float32) if SIMULATED else _device_empty(ndim)


@functools.cache
def _device_empty(ndim):
    return cuda.device_array((0,) * ndim, np.float32)


def group_stats(x, groups, eps, partial, stream=0, control=False, peak=None, w=None, b=None, bound_control=False):
    """The group statistics of x [C, H, W] float32 (consecutive channel groups; one pass of float32 sums about a
    shift near the mean, each block's share then merged about its own mean) into the workspace partial
    [4, groups, GN_PARTS]; returns partial[0], whose [g, :2] are group g's (mean, 1 / sqrt(var + eps)). With
    peak [1] and the affine w, b: peak[0] = a bound on
    max |silu(group_norm(x))| from each group's min and max (at most a few times the max: the split's scale,
    without a pass over the values)."""
    xg = x.reshape(groups, x.size // groups)
    if groups > 1024:
        raise ValueError(f"group_stats takes at most 1024 groups, not {groups}")
    extremes = partial[2:4] if peak is not None else _empty(3)
    _gn_sums[control][(GN_PARTS, groups), BLOCK, stream](xg, partial[0], partial[1], extremes)
    w, b, peak = (_empty(1), _empty(1), _empty(1)) if peak is None else (w, b, peak)
    _gn_stats[bound_control][1, max(32, -(-groups // 32) * 32), stream](partial, x.size // groups,
                                                                      np.float32(eps), w, b, peak)
    return partial[0]


def group_norm(x, w, b, out, groups, eps, silu, partial, stream=0, control=False):
    """out = GroupNorm(x) (then silu) over x [C, H, W] float32 (group_stats, then each value); partial a float32
    workspace [4, groups, GN_PARTS]."""
    group_stats(x, groups, eps, partial, stream=stream, control=control)
    rows = (x.shape[0], x.size // x.shape[0])
    _gn_apply[_blocks(x.size), BLOCK, stream](x.reshape(rows), partial[0], w, b, out.reshape(rows),
                                                     bool(silu))


def unpack_latents(lat, std, mean, out, stream=0, control=False):
    """out [C, 2h, 2w] = unpatchify(lat [4C, h, w] * std + mean) (std, mean [4C])."""
    _unpack[control][_blocks(out.size), BLOCK, stream](lat, std, mean, out)


def pack_latents(z, std, mean, out, stream=0, control=False):
    """out [4C, h, w] = (patchify(z [C, 2h, 2w]) - mean) / std (std, mean [4C]): unpack_latents' inverse."""
    _pack[control][_blocks(out.size), BLOCK, stream](z, std, mean, out)


def to_pixels(image, out, stream=0, control=False):
    """out uint8 [H, W, 3] from image [3, H, W] float32 (vae.to_pixels)."""
    _pixels[control][_blocks(image.size), BLOCK, stream](image, out)


# --- the split product on tensor cores ----------------------------------------------------
def segments(a_cols, w_cols):
    """(a column, w column, length) of the two fp16 products of a split product, a = [a_hi | a_lo] of
    a_cols = 2 P columns and w = [w_hi | w_hi | w_lo] of w_cols = 3 P: [a_hi | a_lo] . [w_hi | w_hi], then
    a_hi . w_lo."""
    p = a_cols // 2
    if a_cols != 2 * p or w_cols != 3 * p:
        raise ValueError(f"a split product takes [hi | lo] (2P columns) and [hi | hi | lo] (3P), not {a_cols} "
                         f"and {w_cols}")
    return [(0, 0, 2 * p), (0, 2 * p, p)]


class HalfProduct:
    """cuBLASLt d[M, N] = the split product of a [M, 2P] and w [N, 3P] (fp16 bits, `segments`), float32
    accumulation and output (gemm.py's layout with fp16 operands); the algorithm is the heuristic's first,
    planned once per shape.

    Each segment's K is cut into slices of at most SLICE_K columns, each one product that adds into d (beta
    = 1 from the second on). The tensor cores' float32 accumulator loses about half an ulp of the running
    sum per k16 step, with one sign (measured on the H200: the decoder's products were 1.7e-9 K off float64,
    relative, linear in K, against 1e-6 for a float32 sum over the same K); cuBLAS adds each slice into d in
    float32 with rounding to nearest, so the error grows with the slice, not with K."""

    def __init__(self):
        from .gemm import blas
        self.blas = blas()
        self.lt = self.blas.lt
        self._plans = {}
        self._one = np.array([1.0], np.float32)
        self._zero = np.array([0.0], np.float32)

    def _plan(self, m, n, k, lda, ldw, align=None):
        from .gemm import COMPUTE_32F, OP_N, OP_T, _set
        key = (m, n, k, lda, ldw, align)
        plan = self._plans.get(key)
        if plan is None:
            lt, A = self.lt, self.lt.MatmulDescAttribute
            desc = lt.matmul_desc_create(COMPUTE_32F, R_32F)
            _set(lt.matmul_desc_set_attribute, desc, A.TRANSA, OP_T, np.int32)
            _set(lt.matmul_desc_set_attribute, desc, A.TRANSB, OP_N, np.int32)
            layouts = (lt.matrix_layout_create(R_16F, k, n, ldw), lt.matrix_layout_create(R_16F, k, m, lda),
                       lt.matrix_layout_create(R_32F, n, m, n))
            found = self.blas._heuristic(desc, *layouts, 1, align)
            if len(found) == 0:
                raise RuntimeError(f"cuBLASLt has no fp16 algorithm for M={m} N={n} K={k}")
            plan = self._plans[key] = (desc, layouts, found)
        return plan

    def _matmul(self, plan, w_at, a_at, add, d, stream):
        """d (+)= the fp16 rows at a_at . those at w_at^T (device addresses) by a plan of _plan; add: beta = 1."""
        from .gemm import WORKSPACE, _row, pointer, stream_handle
        desc, (lw, la, ld), found = plan
        beta = self._one if add else self._zero
        self.lt.matmul(self.blas.lt_handle, desc, self._one.ctypes.data, w_at, lw, a_at, la, beta.ctypes.data,
                       pointer(d), ld, pointer(d), ld, _row(found, 0), pointer(self.blas.workspace), WORKSPACE,
                       stream_handle(stream))

    def __call__(self, a, w, d, stream=0):
        from .gemm import pointer
        m, lda = a.shape
        n, ldw = w.shape
        first = True
        for a0, w0, k in segments(lda, ldw):
            for k0, kk in slices(k):
                self._matmul(self._plan(m, n, kk, lda, ldw), pointer(w) + 2 * (w0 + k0), pointer(a) + 2 * (a0 + k0),
                             not first, d, stream)
                first = False

    def taps(self, image, w, d, span, stream=0, origin=0):
        """d [M, N] = the tap product (tap_product) of image [pixels, 3P] and w [taps, N, 3P] fp16 bits: one
        product a tap and K slice (`slices`: one for the decoder's K = 3P up to 3 tap_part(384), three for the
        encoder's last downsampling, 3 tap_part(4 x 512)), image rows from the tap's pixel offset (16-byte
        aligned rows: the heuristic is told), the products summed into d by cuBLAS (beta = 1 from the second on)."""
        from .gemm import pointer
        m, (count, n, p3) = d.shape[0], w.shape
        side = int(round(math.sqrt(count)))
        first = True
        for t in range(count):
            dy, dx = divmod(t, side)
            at = pointer(image) + 2 * (dy * span + dx + origin) * p3
            for k0, kk in slices(p3):
                self._matmul(self._plan(m, n, kk, p3, p3, align=16), pointer(w) + 2 * (t * n * p3 + k0),
                             at + 2 * k0, not first, d, stream)
                first = False


SLICE_K = 2048       # columns of one accumulation (HalfProduct)


def slices(k):
    """(start, length) of HalfProduct's K slices: equal lengths, multiples of 128 columns (256-byte aligned
    starts, as cuBLASLt's heuristic assumes), the last one shorter."""
    parts = -(-k // SLICE_K)           # ceil(k / SLICE_K)
    per = -(-k // parts)               # ceil(k / parts)
    size = -(-per // 128) * 128        # rounded up to a multiple of 128
    return [(k0, min(size, k - k0)) for k0 in range(0, k, size)]


_product = None


def half_product(a, w, d, stream=0):
    """d [M, N] float32 = the split product of a [M, 2P] and w [N, 3P] fp16 bits (`segments`). In the
    simulator (no cuBLAS): on the host in float64."""
    if SIMULATED:
        av, wv = half_value(a.copy_to_host()), half_value(w.copy_to_host())
        d[:] = sum(av[:, a0:a0 + k] @ wv[:, w0:w0 + k].T for a0, w0, k in segments(av.shape[1], wv.shape[1]))\
            .astype(np.float32)
        return
    _blas_product()(a, w, d, stream)


def _blas_product():
    """The process's HalfProduct (its plans kept), made on the first product."""
    global _product
    if _product is None:
        _product = HalfProduct()
    return _product


def tap_product(image, w, d, span, stream=0, origin=0):
    """d [M, N] float32 = sum over the taps t = (dy, dx) of a k x k conv (w [k k, N, 3P] fp16 bits, tap_weights)
    of image[m + dy span + dx + origin] . w[t] over the 3P columns, image [pixels, 3P] fp16 bits in the taps'
    layout (split_image triple: [hi | lo | hi] a pixel, rows of span = W + 2 pixels): d's row m is the output at
    image row m // span, column m % span (the last two columns of each row are not the image's). origin 1: a
    2x2 conv padded only after (the downsampling's), tap (0, 0) one pixel on, past the row's left zero. In the
    simulator (no cuBLAS): on the host in float64."""
    if SIMULATED:
        av, wv = half_value(image.copy_to_host()), half_value(w.copy_to_host())
        side, m = int(round(math.sqrt(wv.shape[0]))), d.shape[0]
        d[:] = sum(av[dy * span + dx + origin:dy * span + dx + origin + m] @ wv[dy * side + dx].T
                   for dy in range(side) for dx in range(side)).astype(np.float32)
        return
    _blas_product().taps(image, w, d, span, stream, origin)


def tap_part(c):
    """Columns of one part of the taps' layout: C rounded up to 8 (a pixel's 3 parts fill whole 16 bytes)."""
    return -(-c // 8) * 8


def tap_weights(w):
    """A conv weight [O, C, k, k] as the tap products' right operands: fp16 bits [k k, product_rows(O), 3 P] =
    [w_hi | w_hi | w_lo] over channel c for tap t = dy k + dx, P = tap_part(C), zeros past C and O; and its peak
    |w| (the scale's source)."""
    w = np.asarray(w, np.float32)
    o, c, kh, kw = w.shape
    peak = float(np.abs(w).max()) if w.size else 0.0
    p = tap_part(c)
    out = np.zeros((kh * kw, product_rows(o), 3 * p), np.uint16)
    hi, lo = host_split(w, host_scale(peak))
    for i, bits in enumerate((hi, hi, lo)):
        out[:, :o, i * p:i * p + c] = bits.reshape(o, c, kh * kw).transpose(2, 0, 1)
    return out, np.float32(peak)


def down_weight(w):
    """A stride-2 3x3 conv weight [O, C, 3, 3] as the stride-1 2x2 conv over the input's 2x2 phases
    (split_image down): [O, 4C, 2, 2], channel (2a + b) C + c at tap (ty, tx) = w[o, c, 2 ty + a, 2 tx + b], zero
    where that is past the 3x3 (exact: a rearrangement)."""
    w = np.asarray(w, np.float32)
    o, c = w.shape[:2]
    out = np.zeros((o, 2, 2, c, 2, 2), np.float32)       # [o, a, b, c, ty, tx]
    for dy in range(3):
        for dx in range(3):
            out[:, dy % 2, dx % 2, :, dy // 2, dx // 2] = w[:, :, dy, dx]
    return out.reshape(o, 4 * c, 2, 2)


def tap_rows(c_in, o, width):
    """Output rows per chunk of a tap conv: as many as keep the chunk's split image and product within
    TAP_BYTES, which the product's nine passes then find in L2."""
    per_row = (width + 2) * (3 * tap_part(c_in) * 2 + product_rows(o) * 4)
    return max(1, TAP_BYTES // per_row - 2)


# --- float64 references: the spec of each kernel ---------------------------------------------
def conv2d_reference(x, w, b, padding, up=False):
    """torch.nn.Conv2d (stride 1) of x [C, H, W] (up: of its nearest-2x upsampling) in float64."""
    x = np.asarray(x, np.float64)
    if up:
        x = x.repeat(2, axis=1).repeat(2, axis=2)
    c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (padding, padding), (padding, padding)))
    ho, wo = h + 2 * padding - kh + 1, wd + 2 * padding - kw + 1
    out = np.zeros((o, ho, wo))
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("oc,chw->ohw", np.asarray(w[:, :, i, j], np.float64), xp[:, i:i + ho, j:j + wo])
    return out + (0 if b is None else np.asarray(b, np.float64)[:, None, None])


def group_norm_reference(x, w, b, groups, eps, silu):
    x = np.asarray(x, np.float64)
    g = x.reshape(groups, -1)
    mean, var = g.mean(axis=1, keepdims=True), g.var(axis=1, keepdims=True)
    y = ((g - mean) / np.sqrt(var + eps)).reshape(x.shape)
    y = y * np.asarray(w, np.float64)[:, None, None] + np.asarray(b, np.float64)[:, None, None]
    return y / (1 + np.exp(-y)) if silu else y


def unpack_reference(lat, std, mean):
    z = np.asarray(lat, np.float64) * np.asarray(std, np.float64)[:, None, None] + \
        np.asarray(mean, np.float64)[:, None, None]
    c4, h, w = z.shape
    return z.reshape(c4 // 4, 2, 2, h, w).transpose(0, 3, 1, 4, 2).reshape(c4 // 4, 2 * h, 2 * w)


def pack_reference(z, std, mean):
    z = np.asarray(z, np.float64)
    c, h2, w2 = z.shape
    z = z.reshape(c, h2 // 2, 2, w2 // 2, 2).transpose(0, 2, 4, 1, 3).reshape(4 * c, h2 // 2, w2 // 2)
    return (z - np.asarray(mean, np.float64)[:, None, None]) / np.asarray(std, np.float64)[:, None, None]


def downsample_reference(x, w, b):
    """diffusers' Downsample2D (padding 0) in float64: x [C, H, W] padded by a zero row below and a zero column
    to the right, then a 3x3 stride-2 conv w [O, C, 3, 3] + b -> [O, H / 2, W / 2] (H, W even)."""
    x = np.asarray(x, np.float64)
    _, h, wd = x.shape
    xp = np.pad(x, ((0, 0), (0, 1), (0, 1)))
    out = np.zeros((w.shape[0], h // 2, wd // 2))
    for dy in range(3):
        for dx in range(3):
            out += np.einsum("oc,chw->ohw", np.asarray(w[:, :, dy, dx], np.float64), xp[:, dy:dy + h:2, dx:dx + wd:2])
    return out + np.asarray(b, np.float64)[:, None, None]


# --- gates -----------------------------------------------------------------------------------
# A split part carries x s to 2^-22 relative (hi's rounding 2^-11, lo's 2^-11 of that); fp16 subnormals
# (below 2^-14 of the scaled max 2^14) add an absolute 2^-25 per part, i.e. 2^-39 of the peak.
SPLIT_REL = 2.0 ** -21


def product_bound(terms, k, peaks=0.0):
    """|error| of a split product over k terms whose |a| |w| sum to `terms`: each term within 2 SPLIT_REL
    plus the dropped lo*lo, float32 accumulation over 3k terms, the peaks' subnormal floor."""
    return (3 * SPLIT_REL + gamma(3 * k) + 4 * EPS32) * terms + peaks * 2.0 ** -36 * k + 1e-30


def _gn_stats_error(g):
    """Per group of g [G, n] (float64), bounds on the float32 errors of gn_sums + gn_stats: (the mean's, the
    variance's relative). Each share's sums about the shift K run n / (GN_PARTS BLOCK) terms a thread and a
    tree of BLOCK: gamma_m relative to sum |x - K| (S1) and sum (x - K)^2 (S2); its mean K + S1 / n_b errs by
    that over n_b, its squares S2 - S1^2 / n_b by gamma_m (S2 + 2 |S1 / n_b| sum |x - K|). The merge over the
    GN_PARTS shares adds gamma_parts of the magnitudes it sums, and each share's mean error enters its squared
    distance from the group's mean."""
    groups, n = g.shape
    parts, step = GN_PARTS, GN_PARTS * BLOCK
    m = -(-n // step) + int(math.log2(BLOCK)) + 3
    taken = min(BLOCK, n)
    shift = g[:, np.arange(taken) * (n // taken)].mean(axis=1)
    label = ((np.arange(n) % step) // BLOCK)[None, :] + parts * np.arange(groups)[:, None]

    def per_share(v):
        return np.bincount(label.ravel(), v.ravel(), groups * parts).reshape(groups, parts)

    d = g - shift[:, None]
    count = np.bincount(label[0], minlength=parts)[None, :].astype(np.float64)
    live = np.maximum(count, 1.0)
    s1, mag, sq = per_share(d), per_share(np.abs(d)), per_share(d * d)
    share_mean = shift[:, None] + s1 / live
    mean = g.mean(axis=1)
    e_share = gamma(m) * mag / live + EPS32 * np.abs(share_mean)
    moved = (count * np.abs(share_mean - share_mean[:, :1])).sum(axis=1) / n
    e_mean = e_share.max(axis=1) + gamma(parts + 3) * (moved + np.abs(mean))
    dist = np.abs(share_mean - mean[:, None])
    m2 = (sq - s1 * s1 / live).sum(axis=1) + (count * dist ** 2).sum(axis=1)
    e_m2 = (gamma(m) * (sq + 2 * np.abs(s1 / live) * mag)).sum(axis=1) \
        + (2 * count * dist * (e_share + e_mean[:, None])).sum(axis=1) + gamma(2 * parts + 3) * m2
    return e_mean, e_m2 / np.maximum(m2, 1e-300) + 2 * EPS32


def group_norm_bound(x, w, b, groups, silu):
    """The group statistics' errors (_gn_stats_error): the mean's moves y by |w| rstd that much; the
    variance's relative error moves it by half that of |y - b| (and the rstd's own roundings, a few u);
    silu's slope is below 1.1 and its special-function sigmoid (_silu) adds at most (10 + |y|) u sigmoid(y) |y|
    below zero, under 5 u |y|, and about 6 u |y| above it."""
    x = np.asarray(x, np.float64)
    g = x.reshape(groups, -1)
    e_mean, e_var = _gn_stats_error(g)
    per = x.shape[0] // groups
    rstd = 1 / np.sqrt(g.var(axis=1) + 1e-6)
    shift = np.repeat(e_mean * rstd, per)[:, None, None]
    spread = np.repeat(0.5 * e_var, per)[:, None, None]
    w64, b64 = np.abs(np.asarray(w, np.float64)), np.asarray(b, np.float64)
    y = group_norm_reference(x, w, b, groups, 0.0, False)
    err = w64[:, None, None] * shift + (spread + 6 * EPS32) * np.abs(y - b64[:, None, None]) + 2 * EPS32 * np.abs(y)
    return (1.1 * err + 6 * EPS32 * np.abs(y)) if silu else err + 1e-30


# --- contract --------------------------------------------------------------------------------
def _make_split(rng, size):
    m, k = (6, 20) if size == "tiny" else (4096, 16300)
    x = rng.standard_normal((m, k)).astype(np.float32) * 37
    x[0, :4] = (1e-9, -3e-7, 0.0, 2.5e-6)                       # values far below the peak
    return {"x": x}


def _run_split(inp, control):
    """Both forms: hi + lo of the left one, hi + lo and the middle hi of the weight's, every zero column."""
    x = cuda.to_device(inp["x"])
    peak = cuda.device_array(1, np.float32)
    absmax(x, peak, control=control)
    forms = []
    for weight in (False, True):
        out = cuda.device_array((x.shape[0], split_width(x.shape[1], weight)), np.uint16)
        split_rows(x, peak, out, weight, control=control)
        forms.append(half_value(out.copy_to_host()))
    (a, w), k, p = forms, x.shape[1], part(x.shape[1])
    s = host_scale(float(np.abs(inp["x"]).max()))
    values = [(a[:, :k] + a[:, p:p + k]) / s, (w[:, :k] + w[:, 2 * p:2 * p + k]) / s, w[:, p:p + k] / s]
    pads = [a[:, k:p], a[:, p + k:], w[:, k:p], w[:, p + k:2 * p], w[:, 2 * p + k:]]
    return np.concatenate([v.ravel() for v in values + pads])


def _ref_split(inp):
    x = inp["x"].astype(np.float64)
    peak = np.abs(x).max()
    # hi + lo within SPLIT_REL of x (or the subnormal floor); the middle hi alone within 2^-11; pads exact zeros
    split = (SPLIT_REL * np.abs(x) + peak * 2.0 ** -38).ravel()
    zeros = np.zeros(5 * x.shape[0] * (part(x.shape[1]) - x.shape[1]))
    return np.concatenate([x.ravel()] * 3 + [zeros]), \
        np.concatenate([split, split, (2.0 ** -11 * np.abs(x) + peak * 2.0 ** -38).ravel(), zeros])


def _make_conv(taps, up):
    def make(rng, size):
        c, o, h, w = (5, 3, 3, 4) if size == "tiny" else (384, 384, 128, 128)
        if up:
            h, w = h // 2 + 1, w // 2 + 1
        x = rng.standard_normal((c, h, w)).astype(np.float32) * 3
        wt = (rng.standard_normal((o, c, taps, taps)) / math.sqrt(c * taps * taps)).astype(np.float32)
        return {"x": x, "w": wt, "b": rng.standard_normal(o).astype(np.float32), "taps": taps, "up": up}
    return make


def _make_conv_norm(rng, size):
    """A conv over silu(group_norm(x)), x of a mean far from zero."""
    c, o, h, w, groups = (8, 3, 3, 4, 4) if size == "tiny" else (192, 96, 256, 256, 32)
    x = (rng.standard_normal((c, h, w)) * 2 + 40).astype(np.float32)
    wt = (rng.standard_normal((o, c, 3, 3)) / math.sqrt(c * 9)).astype(np.float32)
    return {"x": x, "w": wt, "b": rng.standard_normal(o).astype(np.float32), "taps": 3, "up": False,
            "gw": (1 + 0.3 * rng.standard_normal(c)).astype(np.float32),
            "gb": (0.3 * rng.standard_normal(c)).astype(np.float32), "groups": groups}


def _run_conv(inp, control):
    """A conv as CudaOps runs it, chunk by chunk (two rows a chunk in the tiny case), finish into [O, H, W]: a 1x1
    conv through its columns (its split image [hi | lo]) and one split product; a k x k conv as tap products (the
    split image in the taps' layout, a product a tap); with "gw" in inp, over silu(group_norm(x)) made in the
    split's reads, its peak the bound group_stats gives. control: the split's lo parts zero."""
    x = cuda.to_device(inp["x"])
    taps, up = inp["taps"], inp["up"]
    wm, wpeak = (weight_matrix if taps == 1 else tap_weights)(inp["w"])
    w, peak_w, bias = cuda.to_device(wm), cuda.to_device(np.array([wpeak], np.float32)), cuda.to_device(inp["b"])
    c, h, wd = x.shape
    h, wd = (2 * h, 2 * wd) if up else (h, wd)
    o, span = inp["w"].shape[0], wd + 2
    out = cuda.device_array((o, h * wd), np.float32)
    peak = cuda.device_array(1, np.float32)
    norm = None
    if "gw" in inp:          # the peak: the bound the group statistics give, as CudaOps takes it
        partial = cuda.device_array((4, inp["groups"], GN_PARTS), np.float32)
        gw, gb = cuda.to_device(inp["gw"]), cuda.to_device(inp["gb"])
        norm = (group_stats(x, inp["groups"], 1e-6, partial, peak=peak, w=gw, b=gb), gw, gb)
    else:
        absmax(x, peak)
    rows = 2 if SIMULATED else (chunk_rows(c, wd) if taps == 1 else tap_rows(c, o, wd))
    for r0 in range(0, h, rows):
        n = min(rows, h - r0)
        if taps == 1:
            cols = cuda.to_device(np.full((n * wd, split_width(c)), 0xFFFF, np.uint16))    # NaN, as garbage
            d = cuda.device_array((n * wd, wm.shape[0]), np.float32)       # the weight's product rows
            split_image(x, peak, cols, r0, up, norm, control=bool(control))
            half_product(cols, w, d)
            finish(d[:, :o], peak, peak_w, bias, out, r0 * wd, channels=True)
        else:
            image = cuda.to_device(np.full((image_rows(n, taps) * span, wm.shape[2]), 0xFFFF, np.uint16))
            d = cuda.device_array((n * span - 2, wm.shape[1]), np.float32)
            split_image(x, peak, image, r0 - taps // 2, up, norm, control=bool(control), triple=True)
            tap_product(image, w, d, span)
            finish(d[:, :o], peak, peak_w, bias, out, r0 * wd, channels=True, span=span)
    return out.copy_to_host().reshape(o, h, wd)


def _ref_conv(inp):
    """With "gw": the conv of the float64 group norm + silu, plus that norm's own bound carried through |w|."""
    taps, up = inp["taps"], inp["up"]
    x, carried, loose = inp["x"], 0.0, 1.0
    if "gw" in inp:
        loose = 4.0            # the statistics' bound on the peak, at most a few times max |x|
        args = (inp["x"], inp["gw"], inp["gb"], inp["groups"])
        x = group_norm_reference(*args, 1e-6, True)
        carried = conv2d_reference(group_norm_bound(*args, True), np.abs(inp["w"]), None, taps // 2)
    ref = conv2d_reference(x, inp["w"], inp["b"], taps // 2, up)
    terms = conv2d_reference(np.abs(x), np.abs(inp["w"]), np.abs(inp["b"]), taps // 2, up)
    k = x.shape[0] * taps * taps
    peaks = float(loose * np.abs(x).max() * np.abs(inp["w"]).max())
    return ref, product_bound(terms, k, peaks) + carried


def _make_down(rng, size):
    """The encoder's downsampling conv; real: its last one's widths (4 C = 2048 phase channels: the tap
    products' K in three slices)."""
    c, o, h, w = (5, 3, 6, 8) if size == "tiny" else (512, 512, 128, 128)
    x = rng.standard_normal((c, h, w)).astype(np.float32) * 3
    wt = (rng.standard_normal((o, c, 3, 3)) / math.sqrt(c * 9)).astype(np.float32)
    return {"x": x, "w": wt, "b": rng.standard_normal(o).astype(np.float32)}


def _run_down(inp, control):
    """The stride-2 conv as CudaOps runs it: the 2x2 phases of x split in the taps' layout (split_image down),
    the 2x2 tap products of down_weight from one pixel on (origin 1: padding only after), finish from the grid.
    control: the phases (a, b) read swapped."""
    x = cuda.to_device(inp["x"])
    wm, wpeak = tap_weights(down_weight(inp["w"]))
    w, peak_w, bias = cuda.to_device(wm), cuda.to_device(np.array([wpeak], np.float32)), cuda.to_device(inp["b"])
    c, h, wd = x.shape
    h, wd = h // 2, wd // 2
    o, span = inp["w"].shape[0], wd + 2
    out = cuda.device_array((o, h * wd), np.float32)
    peak = cuda.device_array(1, np.float32)
    absmax(x, peak)
    rows = 2 if SIMULATED else tap_rows(4 * c, o, wd)
    for r0 in range(0, h, rows):
        n = min(rows, h - r0)
        image = cuda.to_device(np.full((image_rows(n, 2) * span, wm.shape[2]), 0xFFFF, np.uint16))  # NaN garbage
        d = cuda.device_array((n * span - 2, wm.shape[1]), np.float32)
        split_image(x, peak, image, r0, control=bool(control), triple=True, down=True)
        tap_product(image, w, d, span, origin=1)
        finish(d[:, :o], peak, peak_w, bias, out, r0 * wd, channels=True, span=span)
    return out.copy_to_host().reshape(o, h, wd)


def _ref_down(inp):
    x, w, b = inp["x"], inp["w"], inp["b"]
    terms = downsample_reference(np.abs(x), np.abs(w), np.abs(b))
    peaks = float(np.abs(x).max() * np.abs(w).max())
    return downsample_reference(x, w, b), product_bound(terms, 16 * x.shape[0], peaks)


def _make_pack_inputs(rng, size):
    h, w = (2, 3) if size == "tiny" else (64, 64)
    return {"z": rng.standard_normal((32, 2 * h, 2 * w)).astype(np.float32) * 4,
            "std": (rng.random(128) + 0.5).astype(np.float32), "mean": rng.standard_normal(128).astype(np.float32)}


def _run_pack(inp, control):
    z = cuda.to_device(inp["z"])
    _, h2, w2 = z.shape
    out = cuda.device_array((128, h2 // 2, w2 // 2), np.float32)
    pack_latents(z, cuda.to_device(inp["std"]), cuda.to_device(inp["mean"]), out, control=control)
    return out.copy_to_host()


def _ref_pack(inp):
    """Two roundings, the difference's and the quotient's."""
    ref = pack_reference(inp["z"], inp["std"], inp["mean"])
    return ref, 2.5 * EPS32 * np.abs(ref) + 1e-30


def _make_finish_inputs(rng, size):
    m, n = (40, 36) if size == "tiny" else (65536, 384)
    return {"d": rng.standard_normal((m, n)).astype(np.float32) * 1e4, "b": rng.standard_normal(n).astype(np.float32),
            "pa": np.float32(3.0), "pw": np.float32(0.01), "r": rng.standard_normal((n, m + 3)).astype(np.float32)}


def _run_finish(inp, control):
    d, b = cuda.to_device(inp["d"]), cuda.to_device(inp["b"])
    pa, pw = cuda.to_device(np.array([inp["pa"]])), cuda.to_device(np.array([inp["pw"]]))
    m, n = inp["d"].shape
    rows = cuda.device_array((m, n), np.float32)
    chans = cuda.device_array((n, m + 3), np.float32)
    finish(d, pa, pw, b, rows, control=control)
    finish(d, pa, pw, b, chans, 3, channels=True, residual=cuda.to_device(inp["r"]), control=control)
    return np.concatenate([rows.copy_to_host(), chans.copy_to_host()[:, 3:].T])


def _ref_finish(inp):
    """The rows call without a residual, the channels call with one (one more rounding, of the sum)."""
    inv = 1.0 / (host_scale(inp["pa"]) * host_scale(inp["pw"]))
    ref = inp["d"].astype(np.float64) * inv + inp["b"].astype(np.float64)
    bound = 2 * EPS32 * (np.abs(ref) + np.abs(inp["b"])) + 1e-30
    summed = ref + inp["r"][:, 3:].T.astype(np.float64)
    return np.concatenate([ref, summed]), np.concatenate([bound, bound + 2 * EPS32 * np.abs(summed)])


def _make_gn(rng, size):
    c, h, w, groups = (8, 5, 6, 4) if size == "tiny" else (96, 1024, 1024, 32)
    x = (rng.standard_normal((c, h, w)) * 2 + 40).astype(np.float32)   # a mean far from zero
    return {"x": x, "w": (1 + 0.3 * rng.standard_normal(c)).astype(np.float32),
            "b": (0.3 * rng.standard_normal(c)).astype(np.float32), "groups": groups, "eps": 1e-6}


def _run_gn(inp, control):
    x, w, b = (cuda.to_device(inp[n]) for n in ("x", "w", "b"))
    partial = cuda.device_array((4, inp["groups"], GN_PARTS), np.float32)
    outs = []
    for silu in (False, True):
        out = cuda.device_array(x.shape, np.float32)
        group_norm(x, w, b, out, inp["groups"], inp["eps"], silu, partial, control=control)
        outs.append(out.copy_to_host())
    return np.concatenate(outs)


def _ref_gn(inp):
    args = (inp["x"], inp["w"], inp["b"], inp["groups"], inp["eps"])
    bounds = [group_norm_bound(inp["x"], inp["w"], inp["b"], inp["groups"], silu) for silu in (False, True)]
    return np.concatenate([group_norm_reference(*args, False), group_norm_reference(*args, True)]), \
        np.concatenate(bounds)


def _run_gn_peak(inp, control):
    """group_stats' bound on max |silu(group_norm(x))|, for x of a mean far from zero and for x - 40 (a mean
    near zero, where the values below zero matter)."""
    w, b = cuda.to_device(inp["w"]), cuda.to_device(inp["b"])
    out = []
    for shift in (0.0, 40.0):
        x = cuda.to_device((inp["x"] - np.float32(shift)).astype(np.float32))
        partial = cuda.device_array((4, inp["groups"], GN_PARTS), np.float32)
        peak = cuda.device_array(1, np.float32)
        group_stats(x, inp["groups"], inp["eps"], partial, peak=peak, w=w, b=b, bound_control=control)
        out.append(peak.copy_to_host()[0])
    return np.array(out, np.float64)


def _ref_gn_peak(inp):
    """A bound, not the max: at least max |silu(y)| (or the split could overflow fp16) and at most 2x it (a
    looser one costs the split's small values bits); the gate is the interval [max, 2 max]."""
    tops = []
    for shift in (0.0, 40.0):
        y = group_norm_reference(inp["x"].astype(np.float64) - shift, inp["w"], inp["b"], inp["groups"], inp["eps"],
                                 True)
        tops.append(np.abs(y).max())
    tops = np.array(tops)
    return 1.5 * tops, 0.5 * tops


def _make_unpack_inputs(rng, size):
    h, w = (2, 3) if size == "tiny" else (128, 128)
    return {"lat": rng.standard_normal((128, h, w)).astype(np.float32),
            "std": (rng.random(128) + 0.5).astype(np.float32), "mean": rng.standard_normal(128).astype(np.float32)}


def _run_unpack(inp, control):
    lat = cuda.to_device(inp["lat"])
    _, h, w = lat.shape
    out = cuda.device_array((32, 2 * h, 2 * w), np.float32)
    unpack_latents(lat, cuda.to_device(inp["std"]), cuda.to_device(inp["mean"]), out, control=control)
    return out.copy_to_host()


def _ref_unpack(inp):
    ref = unpack_reference(inp["lat"], inp["std"], inp["mean"])
    mag = unpack_reference(np.abs(inp["lat"]), inp["std"], np.abs(inp["mean"]))
    return ref, 2 * EPS32 * mag + 1e-30


def _make_pixel_inputs(rng, size):
    """float32 neighbours of the rounding boundaries (ties both ways), values out of range, random values."""
    k = np.arange(255)
    boundary = (2 * (k + 0.5) / 255 - 1).astype(np.float32)
    near = [boundary]
    for step in (2, -2):
        v = boundary
        for _ in range(3):
            v = np.nextafter(v, np.float32(step))
            near.append(v)
    x = np.concatenate(near + [np.float32([-1, 1, -1.5, 2, 0, -0.0])])
    n = 3 * 24 * 48 if size == "tiny" else 3 * 1024 * 1024
    x = np.concatenate([x, rng.uniform(-1.1, 1.1, n - x.size).astype(np.float32)])
    return {"image": x.reshape(3, -1, 48 if size == "tiny" else 1024)}


def _run_pixels(inp, control):
    image = cuda.to_device(inp["image"])
    _, h, w = image.shape
    out = cuda.device_array((h, w, 3), np.uint8)
    to_pixels(image, out, control=control)
    return out.copy_to_host()


def _ref_pixels(inp):
    """vae.to_pixels is the spec (diffusers' rounding, checked against diffusers in tests/test_vae.py): exact."""
    x = np.asarray(inp["image"], np.float32)
    p = np.clip(x * np.float32(0.5) + np.float32(0.5), np.float32(0), np.float32(1))
    ref = np.round(np.transpose(p, (1, 2, 0)) * np.float32(255)).astype(np.float64)
    return ref, np.full(ref.shape, 0.5)


CASES = [
    Case("split_fp16", _make_split, _run_split, _ref_split, notes="control: lo written as zero"),
    Case("conv3x3_taps", _make_conv(3, False), _run_conv, _ref_conv,
         notes="tap products (host float64 in the simulator), finish from the grid; control: the split's lo parts zero"),
    Case("conv3x3_up_taps", _make_conv(3, True), _run_conv, _ref_conv,
         notes="the nearest-2x upsampling read through; control: the split's lo parts zero"),
    Case("conv1x1_split", _make_conv(1, False), _run_conv, _ref_conv,
         notes="its columns and one split product; control: the split's lo parts zero"),
    Case("conv3x3_norm_taps", _make_conv_norm, _run_conv, _ref_conv,
         notes="silu(group_norm(x)) made in the split's reads, the peak its statistics' bound; control: the split's "
               "lo parts zero"),
    Case("finish", _make_finish_inputs, _run_finish, _ref_finish, notes="control: bias[0] for every column"),
    Case("group_norm", _make_gn, _run_gn, _ref_gn, notes="control: the squares' sums take x - K, not its square"),
    Case("group_norm_peak", _make_gn, _run_gn_peak, _ref_gn_peak,
         notes="the statistics' bound on max |silu(group_norm(x))|; control: the bound leaves the mean in"),
    Case("conv3x3_down_taps", _make_down, _run_down, _ref_down,
         notes="the stride-2 downsampling as 2x2 tap products over the input's phases; control: phases swapped"),
    Case("unpack_latents", _make_unpack_inputs, _run_unpack, _ref_unpack, notes="control: pi, pj swapped"),
    Case("pack_latents", _make_pack_inputs, _run_pack, _ref_pack, notes="control: pi, pj swapped"),
    Case("to_pixels", _make_pixel_inputs, _run_pixels, _ref_pixels, notes="control: ties rounded down"),
]
