"""Strided copies (slice, transpose, concat) and the counter-based random bf16 fill for test weights."""

import numpy as np
from numba import cuda, float32, uint32, uint64

from .core import BLOCK, EPS16, SIMULATED, Case, from_bf16_bits, jit, narrow

MAXDIM = 4


def _make_strided_copy(control):
    @jit
    def strided_copy(src, src_offset, src_strides, dst, dst_offset, dst_strides, shape):
        start, stride = cuda.grid(1), cuda.gridsize(1)
        total = shape[0] * shape[1] * shape[2] * shape[3]
        for idx in range(start, total, stride):
            rest = idx
            s = src_offset
            d = dst_offset
            for axis in range(MAXDIM - 1, -1, -1):
                i = rest % shape[axis]
                rest //= shape[axis]
                s += i * (dst_strides[axis] if control else src_strides[axis])
                d += i * dst_strides[axis]
            dst[d] = src[s]
    return strided_copy


_copy = {c: _make_strided_copy(c) for c in (False, True)}


def _pad(values, fill):
    values = tuple(int(v) for v in values)
    return (fill,) * (MAXDIM - len(values)) + values


def strided_copy(src, src_offset, src_strides, dst, dst_offset, dst_strides, shape, stream=0, control=False):
    """dst.flat[dst_offset + sum i_a dst_strides_a] = src.flat[src_offset + sum i_a src_strides_a] over `shape`.

    Offsets and strides count elements; src and dst are flat (1-D) arrays; up to 4 axes.
    """
    n = int(np.prod(shape))
    blocks = max(1, min((n + BLOCK - 1) // BLOCK, 2 if SIMULATED else 4096))
    _copy[control][blocks, BLOCK, stream](src, int(src_offset), _pad(src_strides, 0), dst, int(dst_offset),
                                          _pad(dst_strides, 0), _pad(shape, 1))


def _make_copy_rows(control):
    @jit
    def copy_rows(src, src_offset, src_stride, dst, dst_offset, dst_stride, rows, width):
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i >= width:
            return
        for r in range(cuda.blockIdx.y, rows, cuda.gridDim.y):
            dst[dst_offset + r * dst_stride + i] = src[src_offset + r * (dst_stride if control else src_stride) + i]
    return copy_rows


_rows = {c: _make_copy_rows(c) for c in (False, True)}


def copy_rows(src, src_offset, src_stride, dst, dst_offset, dst_stride, rows, width, stream=0, control=False):
    """dst.flat[dst_offset + r dst_stride + i] = src.flat[src_offset + r src_stride + i], r < rows, i < width.

    The common case of slice and concat (contiguous runs of `width`), without strided_copy's divisions.
    """
    grid = ((width + BLOCK - 1) // BLOCK, max(1, min(rows, 2 if SIMULATED else 1024)))
    _rows[control][grid, BLOCK, stream](src, int(src_offset), int(src_stride), dst, int(dst_offset),
                                        int(dst_stride), int(rows), int(width))


# --- random bf16 weights, made on the device ----------------------------------------------------
MASK = 0xFFFFFFFF


@jit(device=True)
def wrap(x):
    """x modulo 2^32 (numba widens uint32 products to 64 bits on the GPU; numpy wraps in the simulator)."""
    return uint32(uint64(x) & uint64(MASK))


@jit(device=True)
def mix(x):
    """A 32-bit integer hash (lowbias32): every input bit moves every output bit."""
    x = wrap(x)
    x = wrap(x ^ (x >> uint32(16)))
    x = wrap(uint64(x) * uint64(0x7FEB352D))
    x = wrap(x ^ (x >> uint32(15)))
    x = wrap(uint64(x) * uint64(0x846CA68B))
    return wrap(x ^ (x >> uint32(16)))


def _make_random(control):
    @jit
    def random_bf16(out, seed, std, mean):
        start, stride = cuda.grid(1), cuda.gridsize(1)
        key = mix(wrap(uint64(seed) * uint64(0x9E3779B9) + uint64(0x632BE5AB)))
        for i in range(start, out.size, stride):
            acc = float32(0.0)
            for j in range(4):
                h = mix(wrap(uint64(i) * uint64(4) + uint64(j) + (uint64(0) if control else uint64(key))))
                acc += float32(h >> uint32(8)) * float32(1.0 / 16777216.0)
            # sum of 4 uniforms: mean 2, variance 1/3
            out[i] = narrow(mean + std * (acc - float32(2.0)) * float32(1.7320508))
    return random_bf16


_random = {c: _make_random(c) for c in (False, True)}


def random_bf16(out, seed, std=1.0, mean=0.0, stream=0, control=False):
    """Fill out (uint16, flat) with bf16 bits of mean + std * (an approximately normal counter hash)."""
    blocks = max(1, min((out.size + BLOCK - 1) // BLOCK, 2 if SIMULATED else 8192))
    _random[control][blocks, BLOCK, stream](out, np.uint32(seed), np.float32(std), np.float32(mean))


def random_reference(n, seed, std=1.0, mean=0.0):
    def mix_np(x):
        x = x.astype(np.uint64) & 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)
    key = mix_np(np.array([(seed * 0x9E3779B9 + 0x632BE5AB) & 0xFFFFFFFF]))[0]
    i = np.arange(n, dtype=np.uint64)
    acc = sum((mix_np((i * 4 + j + key) & 0xFFFFFFFF) >> 8).astype(np.float64) / 16777216.0 for j in range(4))
    return mean + std * (acc - 2.0) * 1.7320508


# --- contract -------------------------------------------------------------------------------------
def _make_copy_inputs(rng, size):
    shape = (3, 4, 5) if size == "tiny" else (1000, 16, 512)
    return {"x": rng.standard_normal(shape).astype(np.float32)}


def _run_copy(inp, control):
    """A slice along axis 2 then a transpose (1, 0, 2) of it: what the attention gate split does."""
    x = inp["x"]
    n0, n1, n2 = x.shape
    w = n2 // 2
    src = cuda.to_device(x.ravel())
    dst = cuda.device_array(n0 * n1 * w, np.float32)
    # out[b, a, c] = x[a, b, w + c]: iterate over the output shape (n1, n0, w)
    strided_copy(src, w, (n2, n1 * n2, 1), dst, 0, (n0 * w, w, 1), (n1, n0, w), control=control)
    return dst.copy_to_host().reshape(n1, n0, w)


def _ref_copy(inp):
    x = inp["x"].astype(np.float64)
    ref = np.ascontiguousarray(x[:, :, x.shape[2] // 2:x.shape[2] // 2 * 2].transpose(1, 0, 2))
    return ref, np.zeros_like(ref)


def _run_rows(inp, control):
    """The q/k/v split of the GDN projections: columns [w, 2w) of every row."""
    x = inp["x"].reshape(inp["x"].shape[0], -1)
    rows, n = x.shape
    w = n // 3
    src = cuda.to_device(x.ravel())
    dst = cuda.device_array(rows * w, np.float32)
    copy_rows(src, w, n, dst, 0, w, rows, w, control=control)
    return dst.copy_to_host().reshape(rows, w)


def _ref_rows(inp):
    x = inp["x"].reshape(inp["x"].shape[0], -1).astype(np.float64)
    w = x.shape[1] // 3
    return x[:, w:2 * w], np.zeros((x.shape[0], w))


def _make_random_inputs(rng, size):
    return {"n": 1000 if size == "tiny" else 1 << 24, "seed": int(rng.integers(1 << 31))}


def _run_random(inp, control):
    out = cuda.device_array(inp["n"], np.uint16)
    random_bf16(out, inp["seed"], 0.02, 0.0, control=control)
    return from_bf16_bits(out.copy_to_host())


def _ref_random(inp):
    ref = random_reference(inp["n"], inp["seed"], 0.02)
    # float32 arithmetic may move a value across a bf16 rounding boundary: one bf16 ulp, plus float32 slack
    return ref, 2 * EPS16 * np.abs(ref) + 1e-6 * 0.02


CASES = [
    Case("strided_copy", _make_copy_inputs, _run_copy, _ref_copy,
         notes="control: walks the source with the destination's strides"),
    Case("copy_rows", _make_copy_inputs, _run_rows, _ref_rows,
         notes="control: steps through the source with the destination's row stride"),
    Case("random_bf16", _make_random_inputs, _run_random, _ref_random, notes="control: ignores the seed"),
]
