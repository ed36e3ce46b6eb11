"""Tensor cores from numba: the warp-wide mma.sync m16n8k16 (bf16 inputs, float32 accumulators) through
inline PTX (numba_cuda.md 4.2), and a plain product kernel over it, the gate-checked base for in-kernel
tensor-core work (the chunked delta rule's within-chunk products, flash attention). The simulator cannot
run inline PTX: there `mma_bf16` is a statement of the instruction from the fragment layout below (the
warp's registers exchanged through shared memory), so the kernels' fragment packing is checked on CI
against that layout, and on the GPU against the tensor cores. The TF32 m16n8k8 product and the
asynchronous 16-byte copies into shared memory (cp.async, which the chunked delta rule's walk stages its
operands with) follow the same pattern: inline PTX on the GPU, a statement in the simulator.

Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16", bf16): with lane = 4 row + quad,
  A (16 x 16, row-major), four 32-bit registers of two bf16 each, the lower column in the low half:
    a0 = A[row, 2 quad : 2 quad + 2], a1 = A[row + 8, 2 quad : +2], a2 = A[row, 2 quad + 8 : +2],
    a3 = A[row + 8, 2 quad + 8 : +2];
  B (16 x 8, "col": stored as B^T, 8 rows of 16), two registers:
    b0 = B[2 quad : 2 quad + 2, row], b1 = B[2 quad + 8 : +2, row];
  C, D (16 x 8 float32): c0, c1 = C[row, 2 quad], C[row, 2 quad + 1]; c2, c3 the same at row + 8.
"""

import numpy as np
from llvmlite import ir
from numba import cuda, float32, types, uint32
from numba.core import cgutils
from numba.cuda.extending import intrinsic

from .core import SIMULATED, Case, from_bf16_bits, gamma, jit, to_bf16_bits
from .gemm import EPS_TF32

THREADS = 128      # threads per block of the kernels here (whole warps)
STATED_THREADS = 256   # the largest block that calls the simulator's statement of an instruction

_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")


@intrinsic
def _mma_ptx(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """(d0, d1, d2, d3) = A B + C for one warp's fragments (every lane of the warp must call it)."""
    sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

    def codegen(context, builder, signature, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
        asm = ir.InlineAsm(fnty, _MMA, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", side_effect=False)
        result = builder.call(asm, args)
        parts = [builder.extract_value(result, i) for i in range(4)]
        return context.make_tuple(builder, signature.return_type, parts)
    return sig, codegen


def _post(regs, values):
    """Simulator only: the lane posts its six registers into the block's shared `regs` (one row per
    thread) and waits for the block; returns (its warp's first thread, row, quad)."""
    tid = cuda.threadIdx.x
    for i, r in enumerate(values):
        regs[tid, i] = r
    cuda.syncthreads()
    return tid - tid % 32, (tid % 32) // 4, tid % 4


@jit(device=True)
def _mma_stated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """The simulator's mma_bf16: each lane posts its six registers, then reads A and B back through the
    fragment layout (module docstring) and sums its four outputs in float32, k in order. Every thread of
    the block must call it (it synchronises the block)."""
    regs = cuda.shared.array((STATED_THREADS, 6), np.uint32)
    base, row, quad = _post(regs, (a0, a1, a2, a3, b0, b1))

    def element(reg, lane, high):         # one bf16 of a posted register, as a float32
        bits = (int(regs[base + lane, reg]) >> (16 if high else 0)) & 0xFFFF
        return np.array([bits << 16], dtype=np.uint32).view(np.float32)[0]

    def a(i, k):                          # A[i, k]: lane 4 (i % 8) + (k % 8) // 2, register by half
        return element((i // 8) + 2 * (k // 8), 4 * (i % 8) + (k % 8) // 2, k % 2)

    def b(k, j):                          # B[k, j]: lane 4 j + (k % 8) // 2, register b0 or b1
        return element(4 + k // 8, 4 * j + (k % 8) // 2, k % 2)
    return _stated_sums(a, b, 16, row, quad, (c0, c1, c2, c3))


def _stated_sums(a, b, depth, row, quad, c):
    """The lane's four outputs of a stated instruction (simulator only): C + A B at (row, 2 quad),
    (row, 2 quad + 1), (row + 8, 2 quad), (row + 8, 2 quad + 1), the `depth` products summed in float32, k
    in order; then the block's second barrier, after which the posted registers may be overwritten."""
    out = []
    for e, (i, j) in enumerate(((row, 2 * quad), (row, 2 * quad + 1), (row + 8, 2 * quad), (row + 8, 2 * quad + 1))):
        acc = np.float32(c[e])
        for k in range(depth):
            acc = np.float32(acc + a(i, k) * b(k, j))
        out.append(acc)
    cuda.syncthreads()
    return out[0], out[1], out[2], out[3]


mma_bf16 = _mma_stated if SIMULATED else _mma_ptx

# --- TF32: mma.sync m16n8k8, float32 registers whose low 13 mantissa bits the tensor cores ignore --------
# Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k8", .tf32), lane = 4 row + quad:
#   A (16 x 8): a0 = A[row, quad], a1 = A[row + 8, quad], a2 = A[row, quad + 4], a3 = A[row + 8, quad + 4];
#   B (8 x 8): b0 = B[quad, row], b1 = B[quad + 4, row];  C, D as for m16n8k16.
# Only the pairing of A's and B's k indices matters to the product: a kernel may give the lane's two k
# slots any two k values (say 2 quad and 2 quad + 1, neighbours in memory) if A and B agree.
_MMA_TF32 = ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
             "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
TF32_MASK = 0xFFFFE000         # the bits of a float32 the TF32 instruction reads


@intrinsic
def _mma_tf32_ptx(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """(d0, d1, d2, d3) = A B + C from float32 fragments read as TF32 (every lane of the warp calls it)."""
    sig = types.UniTuple(types.float32, 4)(*([types.float32] * 10))

    def codegen(context, builder, signature, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
        asm = ir.InlineAsm(fnty, _MMA_TF32, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", side_effect=False)
        bits = [builder.bitcast(x, i32) for x in args[:6]]
        result = builder.call(asm, bits + list(args[6:]))
        parts = [builder.extract_value(result, i) for i in range(4)]
        return context.make_tuple(builder, signature.return_type, parts)
    return sig, codegen


@jit(device=True)
def _mma_tf32_stated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """The simulator's mma_tf32, as _mma_stated: the lanes' registers exchanged through shared memory,
    each input cut to TF32 (TF32_MASK), the eight products summed in float32, k in order."""
    regs = cuda.shared.array((STATED_THREADS, 6), np.float32)
    base, row, quad = _post(regs, (a0, a1, a2, a3, b0, b1))

    def cut(x):
        return (np.array([x], np.float32).view(np.uint32) & np.uint32(TF32_MASK)).view(np.float32)[0]

    def a(i, k):                          # A[i, k]: lane 4 (i % 8) + k % 4, register by row and k half
        return cut(regs[base + 4 * (i % 8) + k % 4, (i // 8) + 2 * (k // 4)])

    def b(k, j):
        return cut(regs[base + 4 * j + k % 4, 4 + k // 4])
    return _stated_sums(a, b, 8, row, quad, (c0, c1, c2, c3))


mma_tf32 = _mma_tf32_stated if SIMULATED else _mma_tf32_ptx


# --- asynchronous copies into shared memory (not tensor cores, but inline PTX of the same kind) -------
def _element_address(context, builder, aryty, ary, index, idxty):
    array = context.make_array(aryty)(context, builder, ary)
    idx = context.cast(builder, index, idxty, types.intp)
    ptr = cgutils.get_item_pointer(context, builder, aryty, array, [idx], wraparound=False)
    return builder.ptrtoint(ptr, ir.IntType(64))


@intrinsic
def _copy16_ptx(typingctx, dst, di, src, si, live):
    """cp.async.cg of the 16 bytes at src[si:si + 4] into the shared array dst[di:di + 4] (both 1-D float32,
    16-byte aligned there), zeros instead when `live` is false (src-size 0: nothing is read)."""
    sig = types.void(dst, di, src, si, live)

    def codegen(context, builder, signature, args):
        dty, dity, sty, sity, _ = signature.args
        to = _element_address(context, builder, dty, args[0], args[1], dity)
        frm = _element_address(context, builder, sty, args[2], args[3], sity)
        size = builder.select(args[4], ir.Constant(ir.IntType(32), 16), ir.Constant(ir.IntType(32), 0))
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(64), ir.IntType(32)])
        asm = ir.InlineAsm(fnty, "{ .reg .u64 s; cvta.to.shared.u64 s, $0; "
                           "cp.async.cg.shared.global [s], [$1], 16, $2; }", "l,l,r,~{memory}", side_effect=True)
        builder.call(asm, [to, frm, size])
        return context.get_dummy_value()
    return sig, codegen


def _plain_asm(text, doc):
    """A no-operand, no-result inline PTX statement as an intrinsic (ordered against memory accesses)."""
    @intrinsic
    def statement(typingctx):
        sig = types.void()

        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()
        return sig, codegen
    statement.__doc__ = doc
    return statement


_copy_commit_ptx = _plain_asm("cp.async.commit_group;", "Close this thread's group of asynchronous copies.")
_copy_wait_prior_ptx = _plain_asm("cp.async.wait_group 1;", "Wait for all but the last committed group.")
_copy_wait_ptx = _plain_asm("cp.async.wait_all;", "Wait for all of this thread's asynchronous copies (a barrier "
                            "then shows them to the block).")


@jit(device=True)
def _copy16_stated(dst, di, src, si, live):
    """The simulator's copy16: the copy (or the zeros) at once; it checks the alignment the instruction
    needs (both offsets whole 16-byte words)."""
    if di % 4 or si % 4:
        raise ValueError(f"copy16 from {int(si)} to {int(di)}: offsets must be multiples of 4 floats")
    for e in range(4):
        dst[di + e] = src[si + e] if live else np.float32(0.0)


@jit(device=True)
def _copy_nothing_stated():
    """The simulator's copies land at once: nothing to commit or wait for."""
    return


@intrinsic
def _clock_ptx(typingctx):
    """The SM's cycle counter (%clock64), ordered against memory accesses: for timing a kernel's phases."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        asm = ir.InlineAsm(ir.FunctionType(ir.IntType(64), []), "mov.u64 $0, %clock64;", "=l,~{memory}",
                           side_effect=True)
        return builder.call(asm, [])
    return sig, codegen


@jit(device=True)
def _clock_stated():
    """The simulator has no cycle counter: zero."""
    return np.int64(0)


clock = _clock_stated if SIMULATED else _clock_ptx
copy16 = _copy16_stated if SIMULATED else _copy16_ptx
copy_commit = _copy_nothing_stated if SIMULATED else _copy_commit_ptx
copy_wait_prior = _copy_nothing_stated if SIMULATED else _copy_wait_prior_ptx
copy_wait = _copy_nothing_stated if SIMULATED else _copy_wait_ptx


@jit(device=True, forceinline=True)
def pair(bits, row, col):
    """Two neighbouring bf16 of a row, bits[row, col] in the low half and bits[row, col + 1] in the high."""
    return uint32(bits[row, col]) | (uint32(bits[row, col + 1]) << uint32(16))


def _make_product(control, tf32):
    mma = mma_tf32 if tf32 else mma_bf16
    step = 8 if tf32 else 16

    @jit
    def mma_product(x, w, out):
        """out [M, N] = x [M, K] w [N, K]^T in float32: bf16 bits in (K % 16 == 0), or float32 read as TF32
        (`tf32`, K % 8 == 0); a warp per 16 x 8 tile of out, M % 16 == N % 8 == 0. control: w's two k
        halves swapped (b0 <-> b1)."""
        lane = cuda.threadIdx.x % 32
        warp = cuda.blockIdx.x * (cuda.blockDim.x // 32) + cuda.threadIdx.x // 32
        tiles_n = out.shape[1] // 8
        tiles = (out.shape[0] // 16) * tiles_n
        live = warp < tiles               # a warp past the last tile computes the last one, writes nothing
        tile = min(warp, tiles - 1)
        m0, n0 = 16 * (tile // tiles_n), 8 * (tile % tiles_n)
        row, quad = lane // 4, lane % 4
        c0 = float32(0.0)
        c1 = float32(0.0)
        c2 = float32(0.0)
        c3 = float32(0.0)
        for k0 in range(0, x.shape[1], step):
            if tf32:
                a0, a1 = x[m0 + row, k0 + quad], x[m0 + row + 8, k0 + quad]
                a2, a3 = x[m0 + row, k0 + quad + 4], x[m0 + row + 8, k0 + quad + 4]
                b0, b1 = w[n0 + row, k0 + quad], w[n0 + row, k0 + quad + 4]
            else:
                a0 = pair(x, m0 + row, k0 + 2 * quad)
                a1 = pair(x, m0 + row + 8, k0 + 2 * quad)
                a2 = pair(x, m0 + row, k0 + 2 * quad + 8)
                a3 = pair(x, m0 + row + 8, k0 + 2 * quad + 8)
                b0 = pair(w, n0 + row, k0 + 2 * quad)
                b1 = pair(w, n0 + row, k0 + 2 * quad + 8)
            if control:
                b0, b1 = b1, b0
            c0, c1, c2, c3 = mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        if live:
            out[m0 + row, n0 + 2 * quad] = c0
            out[m0 + row, n0 + 2 * quad + 1] = c1
            out[m0 + row + 8, n0 + 2 * quad] = c2
            out[m0 + row + 8, n0 + 2 * quad + 1] = c3
    return mma_product


_product = {c: _make_product(c, False) for c in (False, True)}
_product_tf32 = {c: _make_product(c, True) for c in (False, True)}


def mma_product(x, w, out, stream=0, control=False):
    """out = x w^T (float32) on tensor cores, x [M, K] and w [N, K] bf16 bits (M, N, K multiples of 16, 8,
    16) or float32 read as TF32 (K a multiple of 8)."""
    m, k = x.shape
    n = w.shape[0]
    if m % 16 or n % 8 or k % (8 if x.dtype == np.float32 else 16) or w.shape[1] != k or out.shape != (m, n):
        raise ValueError(f"mma_product: shapes {x.shape} x {w.shape} -> {out.shape}: M, N, K must be multiples of "
                         "16, 8, 16")
    warps = (m // 16) * (n // 8)
    kernel = _product_tf32 if x.dtype == np.float32 else _product
    kernel[control][((warps + THREADS // 32 - 1) // (THREADS // 32),), THREADS, stream](x, w, out)


# --- contract (GPU only) -----------------------------------------------------------------------
def _make(rng, size):
    m, k, n = (32, 64, 24) if size == "tiny" else (1024, 4096, 512)
    return {"x": to_bf16_bits(rng.standard_normal((m, k))), "w": to_bf16_bits(rng.standard_normal((n, k)))}


def _make_tf32(rng, size):
    m, k, n = (32, 24, 16) if size == "tiny" else (1024, 4096, 512)
    return {"x": rng.standard_normal((m, k)).astype(np.float32), "w": rng.standard_normal((n, k)).astype(np.float32)}


def _ref_tf32(inp):
    x, w = (np.asarray(inp[n], np.float64) for n in ("x", "w"))
    # each input cut to TF32 (relative 2^-10 each), K float32 sums (x2 as for bf16)
    return x @ w.T, (2 * EPS_TF32 + 2 * gamma(x.shape[1])) * (np.abs(x) @ np.abs(w).T) + 1e-30


def _run(inp, control):
    x, w = cuda.to_device(inp["x"]), cuda.to_device(inp["w"])
    out = cuda.device_array((x.shape[0], w.shape[0]), np.float32)
    mma_product(x, w, out, control=control)
    return out.copy_to_host()


def _ref(inp):
    x, w = from_bf16_bits(inp["x"]), from_bf16_bits(inp["w"])
    # bf16 products are exact in float32; K of them summed with float32 accumulators (the tensor cores'
    # internal order is not documented: a full K-term bound, x2)
    return x @ w.T, 2 * gamma(x.shape[1]) * (np.abs(x) @ np.abs(w).T) + 1e-30


CASES = [
    Case("mma_bf16_product", _make, _run, _ref,
         notes="control: the two k halves of the B fragment swapped (simulator: the instruction's statement)"),
    Case("mma_tf32_product", _make_tf32, _run, _ref_tf32,
         notes="control: the two k halves of the B fragment swapped (simulator: the instruction's statement)"),
]
