"""Elementwise kernels: float32 -> bf16 cast, unary activations, binary ops with trailing broadcast, SwiGLU, the
sigmoid gate."""

import functools
import math

import numpy as np
from numba import cuda, float32, uint16, uint32, uint64

from .core import (BLOCK, EPS32, SIMULATED, Case, DeviceView, as_float32, bf16_bound, float32_bits, from_bf16_bits,
                   jit, narrow, to_bf16_bits, widen)

SCALE, SIGMOID, SILU, TANH, EXP, SOFTPLUS = range(6)
UNARY = {"scale": SCALE, "sigmoid": SIGMOID, "silu": SILU, "tanh": TANH, "exp": EXP, "softplus": SOFTPLUS}
ADD, SUB, MUL = range(3)
BINARY = {"add": ADD, "sub": SUB, "mul": MUL}


def _grid(n):
    """Grid-stride launch: enough blocks to fill the GPU, few in the simulator."""
    blocks = (n + BLOCK - 1) // BLOCK
    return max(1, min(blocks, 2 if SIMULATED else 4096)), BLOCK


# --- cast ------------------------------------------------------------------------------------
def _make_cast(control):
    @jit
    def cast_bf16(x, out):
        start, stride = cuda.grid(1), cuda.gridsize(1)
        for i in range(start, x.size, stride):
            if control:
                out[i] = uint16(float32_bits(x[i]) >> uint32(16))
            else:
                out[i] = narrow(x[i])
    return cast_bf16


_cast = {c: _make_cast(c) for c in (False, True)}


def cast_bf16(x, out, stream=0, control=False):
    """out (uint16 bf16 bits) = round-to-nearest-even(x), both flat contiguous."""
    grid, block = _grid(x.size)
    _cast[control][grid, block, stream](x, out)


# --- unary -----------------------------------------------------------------------------------
@jit(device=True)
def sigmoid(x):
    return float32(1.0) / (float32(1.0) + math.exp(-x))


@jit(device=True)
def silu(x):
    return x / (float32(1.0) + math.exp(-x))


def _make_unary(control):
    @jit
    def unary(x, out, op, s):
        start, stride = cuda.grid(1), cuda.gridsize(1)
        for i in range(start, x.size, stride):
            v = x[i]
            if op == SCALE:
                r = v * s
            elif op == SIGMOID:
                r = float32(1.0) / (float32(1.0) + math.exp(v if control else -v))
            elif op == SILU:
                r = silu(v)
            elif op == TANH:
                r = math.tanh(v)
            elif op == EXP:
                r = math.exp(v)
            else:
                r = v if v > float32(20.0) else math.log1p(math.exp(v))
            out[i] = r
    return unary


_unary = {c: _make_unary(c) for c in (False, True)}


def unary(x, out, op, s=1.0, stream=0, control=False):
    """out = f(x) elementwise, f by name (see UNARY); softplus follows torch (x itself above 20)."""
    grid, block = _grid(x.size)
    _unary[control][grid, block, stream](x, out, UNARY[op], np.float32(s))


# --- binary ----------------------------------------------------------------------------------
def _make_binary(control):
    @jit
    def binary(a, b, out, op):
        start, stride = cuda.grid(1), cuda.gridsize(1)
        n, na, nb = out.size, a.size, b.size
        for i in range(start, n, stride):
            # the modulo (a 64-bit division) only where an operand repeats
            x = a[i] if na == n else a[i % na]
            if control:
                y = b[i // (n // nb)]
            else:
                y = b[i] if nb == n else b[i % nb]
            if op == ADD:
                out[i] = x + y
            elif op == SUB:
                out[i] = x - y
            else:
                out[i] = x * y
    return binary


_binary = {c: _make_binary(c) for c in (False, True)}


def binary(a, b, out, op, stream=0, control=False):
    """out = a op b; a smaller operand repeats along the leading axis (a trailing vector, a row)."""
    grid, block = _grid(out.size)
    _binary[control][grid, block, stream](a, b, out, BINARY[op])


# --- SwiGLU and the sigmoid gate: row tiles -------------------------------------------------
# team threads cover a segment of team x TILE_PER elements of one row, each thread loading all its elements
# before it computes (many loads in flight); BLOCK // team rows per block. The simulator gets small tiles.
TILE_MIN, TILE_MAX = (4, 8) if SIMULATED else (32, BLOCK)
TILE_PER = 2 if SIMULATED else 8


def _tiles(rows, n):
    """(grid, team) for `rows` rows of n elements: grid (row blocks, segments per row)."""
    team = TILE_MIN
    while team < TILE_MAX and team * TILE_PER < n:
        team *= 2
    return (-(-rows // (BLOCK // team)), -(-n // (team * TILE_PER))), team


@jit(device=True, forceinline=True)
def _float_at(a, r, i):
    return a[r, i]


@jit(device=True, forceinline=True)
def _bits_at(a, r, i):
    return widen(a[r, i])


@functools.cache
def _swiglu(control, bits, team, bits_in=False):
    per = TILE_PER
    read = _bits_at if bits_in else _float_at

    @jit(launch_bounds=(BLOCK, 5))     # five blocks per SM (no spills at TILE_PER): more loads in flight
    def swiglu(gate, up, out):
        r = cuda.blockIdx.x * (BLOCK // team) + cuda.threadIdx.x // team
        first = cuda.blockIdx.y * (team * per) + cuda.threadIdx.x % team
        n = out.shape[1]
        if r >= out.shape[0]:
            return
        g = cuda.local.array(per, float32)
        u = cuda.local.array(per, float32)
        for j in range(per):
            i = first + j * team
            if i < n:
                g[j], u[j] = (read(up, r, i), read(gate, r, i)) if control else (read(gate, r, i), read(up, r, i))
        for j in range(per):
            i = first + j * team
            if i < n:
                y = silu(g[j]) * u[j]
                if bits:
                    out[r, i] = narrow(y)
                else:
                    out[r, i] = y
    return swiglu


# The packed SwiGLU: each thread item is 4 consecutive elements of a row read and written as 8-byte words
# (a bf16 operand one word, a float32 one two): a warp's load or store moves 256 bytes, where the element
# kernel's 2-byte bf16 accesses move 64. Taken when the rows allow it (`_words`), else the element kernel.
PACK = 4


@functools.cache
def _load4(bits):
    """Elements 4c .. 4c + 3 of row r of a packed operand (bf16: one uint64 word; float32: two) into v."""
    @jit(device=True, forceinline=True)
    def load4(a, r, c, v):
        if bits:
            word = a[r, c]
            for e in range(PACK):
                v[e] = widen(uint16((word >> uint64(16 * e)) & uint64(0xFFFF)))
        else:
            for e in range(2):
                word = a[r, 2 * c + e]
                v[2 * e] = as_float32(uint32(word & uint64(0xFFFFFFFF)))
                v[2 * e + 1] = as_float32(uint32(word >> uint64(32)))
    return load4


@functools.cache
def _swiglu_packed(control, bits, team, bits_in):
    per = TILE_PER // 2
    load4 = _load4(bits_in)

    @jit(launch_bounds=(BLOCK, 4))
    def swiglu_packed(gate, up, out, items):
        r = cuda.blockIdx.x * (BLOCK // team) + cuda.threadIdx.x // team
        first = cuda.blockIdx.y * (team * per) + cuda.threadIdx.x % team
        if r >= out.shape[0]:
            return
        g = cuda.local.array((per, PACK), float32)
        u = cuda.local.array((per, PACK), float32)
        for j in range(per):            # every load issued before the first store
            c = first + j * team
            if c < items:
                if control:
                    load4(up, r, c, g[j])
                    load4(gate, r, c, u[j])
                else:
                    load4(gate, r, c, g[j])
                    load4(up, r, c, u[j])
        for j in range(per):
            c = first + j * team
            if c < items:
                if bits:
                    word = uint64(0)
                    for e in range(PACK):
                        word |= uint64(narrow(silu(g[j, e]) * u[j, e])) << uint64(16 * e)
                    out[r, c] = word
                else:
                    for e in range(2):
                        lo = uint64(float32_bits(silu(g[j, 2 * e]) * u[j, 2 * e]))
                        hi = uint64(float32_bits(silu(g[j, 2 * e + 1]) * u[j, 2 * e + 1]))
                        out[r, 2 * c + e] = lo | (hi << uint64(32))
    return swiglu_packed


def _words(a):
    """a's rows as 8-byte words [R, N item / 8] (a DeviceView, no copy) when they can be read so: unit element
    stride, 8-byte aligned start and row stride, a whole number of words per row; else None. (The simulator:
    a numpy view.)"""
    if SIMULATED:
        host = a._ary
        data, strides, n, item = host.ctypes.data, host.strides, host.shape[1], host.itemsize
    else:
        face = a.__cuda_array_interface__
        item = np.dtype(face["typestr"]).itemsize
        n = face["shape"][1]
        data, strides = face["data"][0], face["strides"] or (n * item, item)
    if strides[1] != item or data % 8 or strides[0] % 8 or n % PACK:
        return None
    if SIMULATED:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(host.view(np.uint64))
    return cuda.as_cuda_array(DeviceView(a, (a.shape[0], n * item // 8), (strides[0], 8), "<u8"))


def swiglu(gate, up, out, stream=0, control=False, packed=True):
    """out = silu(gate) * up over [R, N] arrays of any strides (gate and up may be column blocks of one
    product's output); gate and up float32 or both uint16 (bf16 bits, a product's bf16 output); out
    float32, or uint16 for bf16 bits: the next product's operand. `packed`: 8-byte words where all three
    allow it (the default; False: always the element kernel)."""
    if gate.dtype != up.dtype:
        raise TypeError(f"swiglu: gate {gate.dtype} and up {up.dtype} differ")
    words = [_words(a) for a in (gate, up, out)] if packed else [None]
    if all(w is not None for w in words):
        items = out.shape[1] // PACK
        grid, team = _tiles(out.shape[0], items * 2)     # (_tiles sizes for TILE_PER; a thread takes per // 2)
        kernel = _swiglu_packed(control, out.dtype == np.uint16, team, gate.dtype == np.uint16)
        kernel[grid, BLOCK, stream](*words, items)
        return
    grid, team = _tiles(*out.shape)
    _swiglu(control, out.dtype == np.uint16, team, gate.dtype == np.uint16)[grid, BLOCK, stream](gate, up, out)


@functools.cache
def _sigmoid_gate(control, bits, team):
    per = TILE_PER

    @jit(launch_bounds=(BLOCK, 5))     # as swiglu
    def sigmoid_gate(x, g, out):
        r = cuda.blockIdx.x * (BLOCK // team) + cuda.threadIdx.x // team
        first = cuda.blockIdx.y * (team * per) + cuda.threadIdx.x % team
        n = out.shape[2]
        if r >= out.shape[0] * out.shape[1]:
            return
        t, h = r // out.shape[1], r % out.shape[1]
        a = cuda.local.array(per, float32)
        b = cuda.local.array(per, float32)
        for j in range(per):
            i = first + j * team
            if i < n:
                a[j], b[j] = x[t, h, i], g[t, h, i]
        for j in range(per):
            i = first + j * team
            if i < n:
                y = a[j] * (silu(b[j]) if control else sigmoid(b[j]))
                if bits:
                    out[t, h, i] = narrow(y)
                else:
                    out[t, h, i] = y
    return sigmoid_gate


def sigmoid_gate(x, g, out, stream=0, control=False):
    """out = x * sigmoid(g) over [L, H, d] arrays of any strides (g may be heads of a column block);
    out float32, or uint16 for bf16 bits."""
    grid, team = _tiles(out.shape[0] * out.shape[1], out.shape[2])
    _sigmoid_gate(control, out.dtype == np.uint16, team)[grid, BLOCK, stream](x, g, out)


# --- contract --------------------------------------------------------------------------------
def _sizes(size):
    return (4, 24) if size == "tiny" else (1000, 4096)


def _run_cast(inp, control):
    x = cuda.to_device(inp["x"].ravel())
    out = cuda.device_array(x.size, np.uint16)
    cast_bf16(x, out, control=control)
    return out.copy_to_host().astype(np.float64)


def _ref_cast(inp):
    # exact: ml_dtypes rounds to nearest even, as the kernel must
    return to_bf16_bits(inp["x"].ravel()).astype(np.float64), np.zeros(inp["x"].size)


def _make_vec(rng, size):
    rows, cols = _sizes(size)
    return {"x": (rng.standard_normal((rows, cols)) * 3).astype(np.float32)}


def _run_unary(inp, control):
    x = cuda.to_device(inp["x"].ravel())
    outs = []
    for op in UNARY:
        out = cuda.device_array(x.size, np.float32)
        unary(x, out, op, s=0.37, control=control)
        outs.append(out.copy_to_host())
    return np.concatenate(outs).astype(np.float64)


def _ref_unary(inp):
    x = inp["x"].ravel().astype(np.float64)
    sig = 1 / (1 + np.exp(-x))
    ref = np.concatenate([x * np.float64(np.float32(0.37)), sig, x * sig, np.tanh(x), np.exp(x),
                          np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))])
    # a handful of float32 roundings, each of the libm functions within 2 ulp
    return ref, 8 * EPS32 * np.abs(ref) + 1e-30


def _make_binary_inputs(rng, size):
    rows, cols = _sizes(size)
    return {"a": rng.standard_normal((rows, cols)).astype(np.float32),
            "b": rng.standard_normal((rows, cols)).astype(np.float32),
            "row": rng.standard_normal(cols).astype(np.float32)}


def _run_binary(inp, control):
    a = cuda.to_device(inp["a"].ravel())
    outs = []
    for other in ("b", "row"):
        b = cuda.to_device(inp[other].ravel())
        for op in BINARY:
            out = cuda.device_array(a.size, np.float32)
            binary(a, b, out, op, control=control)
            outs.append(out.copy_to_host())
    return np.concatenate(outs).astype(np.float64)


def _ref_binary(inp):
    a = inp["a"].astype(np.float64)
    refs, mags = [], []
    for other in (inp["b"].astype(np.float64), inp["row"].astype(np.float64)[None, :]):
        b = np.broadcast_to(other, a.shape)
        for r, m in ((a + b, np.abs(a) + np.abs(b)), (a - b, np.abs(a) + np.abs(b)), (a * b, np.abs(a * b))):
            refs.append(r.ravel())
            mags.append(m.ravel())
    # one float32 rounding of the exact result
    return np.concatenate(refs), EPS32 * np.concatenate(mags) + 1e-30


def _run_swiglu(inp, control, bits_in=False, packed=True):
    """gate and up as the two column blocks of one [R, 2N] product output (float32, or bf16 bits as a
    product with a bf16 output leaves them), bf16 bits out."""
    both = np.concatenate([inp["a"], inp["b"]], axis=1)
    both = cuda.to_device(to_bf16_bits(both) if bits_in else both)
    n = inp["a"].shape[1]
    out = cuda.device_array(inp["a"].shape, np.uint16)
    swiglu(both[:, :n], both[:, n:], out, control=control, packed=packed)
    return from_bf16_bits(out.copy_to_host())


def _run_swiglu_float(inp, control):
    both = cuda.to_device(np.concatenate([inp["a"], inp["b"]], axis=1))
    n = inp["a"].shape[1]
    out = cuda.device_array(inp["a"].shape, np.float32)
    swiglu(both[:, :n], both[:, n:], out, control=control)
    return out.copy_to_host()


def _ref_swiglu_float(inp):
    ref = swiglu_reference(inp["a"], inp["b"])
    return ref, swiglu_bound(ref, bits=False)


def swiglu_reference(gate, up):
    gate, up = gate.astype(np.float64), up.astype(np.float64)
    return gate / (1 + np.exp(-gate)) * up


def swiglu_bound(ref, bits=True):
    # silu as in unary (a few roundings), one product, then half a bf16 ulp
    return (bf16_bound(10 * EPS32) if bits else 10 * EPS32) * np.abs(ref) + 1e-30


def _ref_swiglu(inp):
    ref = swiglu_reference(inp["a"], inp["b"])
    return ref, swiglu_bound(ref)


def _ref_swiglu_bits_in(inp):
    """The reference on the bf16-rounded inputs (the rounding is the product's, not this kernel's)."""
    ref = swiglu_reference(*(from_bf16_bits(to_bf16_bits(inp[n])) for n in ("a", "b")))
    return ref, swiglu_bound(ref)


def _run_sigmoid_gate(inp, control):
    """g as the second half of each head of a [R, 2, 2 hd] array (query | gate per head, as q_proj leaves
    them)."""
    rows, n = inp["a"].shape
    hd = n // 2
    both = np.concatenate([inp["a"].reshape(rows, 2, hd), inp["b"].reshape(rows, 2, hd)], axis=2)
    g = cuda.to_device(both)[:, :, hd:]
    x = cuda.to_device(inp["a"].reshape(rows, 2, hd))
    out = cuda.device_array(x.shape, np.uint16)
    sigmoid_gate(x, g, out, control=control)
    return from_bf16_bits(out.copy_to_host().reshape(rows, n))


def sigmoid_gate_reference(x, g):
    return x.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))


def sigmoid_gate_bound(ref, bits=True):
    return (bf16_bound(8 * EPS32) if bits else 8 * EPS32) * np.abs(ref) + 1e-30


def _ref_sigmoid_gate(inp):
    ref = sigmoid_gate_reference(inp["a"], inp["b"])
    return ref, sigmoid_gate_bound(ref)


CASES = [
    Case("cast_bf16", _make_vec, _run_cast, _ref_cast,
         notes="control: truncates instead of rounding to nearest even"),
    Case("unary", _make_vec, _run_unary, _ref_unary, notes="control: sigmoid with the sign of x flipped"),
    Case("binary", _make_binary_inputs, _run_binary, _ref_binary,
         notes="control: broadcasts the row operand down columns instead of along rows"),
    Case("swiglu_bf16_out", _make_binary_inputs, _run_swiglu, _ref_swiglu,
         notes="control: silu of up times gate (the operands swapped)"),
    Case("swiglu_bf16_in_out", _make_binary_inputs, lambda i, c: _run_swiglu(i, c, True), _ref_swiglu_bits_in,
         notes="gate and up as bf16 bits; control: silu of up times gate"),
    Case("swiglu_elements", _make_binary_inputs, lambda i, c: _run_swiglu(i, c, True, packed=False),
         _ref_swiglu_bits_in,
         notes="the element kernel (rows that cannot be read as words); control: operands swapped"),
    Case("swiglu_float_out", _make_binary_inputs, lambda i, c: _run_swiglu_float(i, c), _ref_swiglu_float,
         notes="float32 in and out, packed; control: operands swapped"),
    Case("sigmoid_gate_bf16_out", _make_binary_inputs, _run_sigmoid_gate, _ref_sigmoid_gate,
         notes="control: silu(g) instead of sigmoid(g)"),
]
