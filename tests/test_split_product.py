"""The split product's cuBLASLt calls (conv.HalfProduct), on the CPU: a stand-in for cuBLASLt records each
call's layouts, pointers and beta and carries it out in float64 on host arrays, so the segments and K slices
the device is asked for are checked against the three terms hi.w_hi + lo.w_hi + hi.w_lo written out from
the parts. Planted controls: a wrong segment (the second takes w_hi again) and a lost beta fail the check."""

import ctypes

import numpy as np
import pytest

from cuda_kernels import conv


class _Memory:
    """Host float64 arrays standing in for device allocations, found by fake addresses that count the device's
    element size (2 bytes for fp16 bits, 4 for float32)."""

    def __init__(self):
        self.blocks, self.next = {}, 1 << 20

    def add(self, values, itemsize):
        base, self.next = self.next, self.next + (values.size * itemsize + 4095) // 4096 * 4096 + 4096
        self.blocks[base] = (values.reshape(-1), itemsize)
        return base

    def view(self, address):
        for base, (flat, itemsize) in self.blocks.items():
            if base <= address < base + flat.size * itemsize:
                assert (address - base) % itemsize == 0
                return flat, (address - base) // itemsize
        raise AssertionError(f"address {address:#x} is in no allocation")


class _Array:
    def __init__(self, memory, values, itemsize):
        self.shape = values.shape
        self.__cuda_array_interface__ = {"data": (memory.add(values, itemsize), False)}


class _Lt:
    """The few cublasLt entry points HalfProduct calls; matmul computes D = op(A) op(B) + beta C in float64
    (d starts as NaN: a first call that read it would show)."""

    class MatmulDescAttribute:
        TRANSA, TRANSB = 3, 4

    def __init__(self, memory):
        self.memory, self.calls = memory, []

    def matmul_desc_create(self, compute, scale):
        return {"compute": compute}

    def matrix_layout_create(self, dtype, rows, cols, ld):
        return (dtype, rows, cols, ld)

    def matmul_desc_set_attribute(self, desc, attr, ptr, size):
        desc[attr] = ctypes.c_int32.from_address(ptr).value

    def matmul(self, handle, desc, alpha, a, la, b, lb, beta, c, lc, d, ld, algo, ws, ws_size, stream):
        assert desc[3] == 1 and desc[4] == 0, "A transposed, B not"     # OP_T, OP_N
        assert c == d and lc == ld
        beta = ctypes.c_float.from_address(beta).value
        (_, k, n, lda), (_, kb, m, ldb), (_, n2, m2, ldd) = la, lb, ld
        assert (kb, n2, m2, ldd) == (k, n, m, n)
        self.calls.append({"a": a, "b": b, "k": k, "beta": beta})
        fa, ia = self.memory.view(a)
        fb, ib = self.memory.view(b)
        fd, idd = self.memory.view(d)
        wa = np.lib.stride_tricks.as_strided(fa[ia:], (n, k), (lda * fa.itemsize, fa.itemsize), writeable=False)
        wb = np.lib.stride_tricks.as_strided(fb[ib:], (m, k), (ldb * fb.itemsize, fb.itemsize), writeable=False)
        out = fd[idd:idd + m * n].reshape(m, n)
        out[:] = wb @ wa.T + (beta * out if beta != 0 else 0)      # beta 0: C is not read (cuBLAS)


class _Blas:
    def __init__(self, memory):
        self.lt, self.lt_handle = _Lt(memory), 0
        self.workspace = _Array(memory, np.zeros(16), 8)

    def _heuristic(self, desc, *layouts):
        return np.zeros(1, dtype=[("algo", np.uint8, 64)])


def _operands(rng, m, n, k):
    """Split operands [a_hi | a_lo] and [w_hi | w_hi | w_lo] (parts of conv.part(k) columns, zeros past k) as
    float64 values, and the three terms written out from the parts."""
    p = conv.part(k)
    ah, al, wh, wl = (rng.standard_normal((r, k)) * s for r, s in ((m, 1), (m, 1e-3), (n, 1), (n, 1e-3)))
    a = np.zeros((m, 2 * p))
    w = np.zeros((n, 3 * p))
    a[:, :k], a[:, p:p + k] = ah, al
    w[:, :k], w[:, p:p + k], w[:, 2 * p:2 * p + k] = wh, wh, wl
    return a, w, ah @ wh.T + al @ wh.T + ah @ wl.T


def _product(monkeypatch, a, w, m, n):
    memory = _Memory()
    blas = _Blas(memory)
    monkeypatch.setattr("cuda_kernels.gemm.blas", lambda: blas)
    aa, ww = _Array(memory, a, 2), _Array(memory, w, 2)
    dd = _Array(memory, np.full((m, n), np.nan), 4)
    conv.HalfProduct()(aa, ww, dd)
    out = memory.view(dd.__cuda_array_interface__["data"][0])[0][:m * n].reshape(m, n)
    return out, blas.lt.calls, aa, ww


@pytest.mark.parametrize("k", [45, 864, 3456, 4500])
def test_the_product_sums_the_three_terms_over_aligned_slices(monkeypatch, k):
    rng = np.random.default_rng(k)
    m, n = 12, 5
    a, w, ref = _operands(rng, m, n, k)
    out, calls, aa, ww = _product(monkeypatch, a, w, m, n)
    assert np.abs(out - ref).max() <= 1e-12 * np.abs(ref).max()
    assert calls[0]["beta"] == 0.0 and all(c["beta"] == 1.0 for c in calls[1:])
    assert all(c["k"] <= conv.SLICE_K and c["k"] % 128 == 0 for c in calls)
    a0, w0 = aa.__cuda_array_interface__["data"][0], ww.__cuda_array_interface__["data"][0]
    assert all((c["b"] - a0) % 256 == 0 and (c["a"] - w0) % 256 == 0 for c in calls), "slices start 256-byte aligned"


@pytest.mark.parametrize("plant", ["second segment reads w_hi", "beta lost"])
def test_planted_bookkeeping_bugs_fail_the_same_check(monkeypatch, plant):
    rng = np.random.default_rng(1)
    m, n, k = 12, 5, 3456
    a, w, ref = _operands(rng, m, n, k)
    if plant == "second segment reads w_hi":
        monkeypatch.setattr(conv, "segments", lambda ac, wc: [(0, 0, ac), (0, ac // 2, ac // 2)])
    else:
        monkeypatch.setattr(conv, "SLICE_K", 1024)
        original = _Lt.matmul

        def forgetful(self, *args):
            args = list(args)
            args[7] = np.array([0.0], np.float32).ctypes.data
            return original(self, *args)
        monkeypatch.setattr(_Lt, "matmul", forgetful)
    out, *_ = _product(monkeypatch, a, w, m, n)
    assert not np.abs(out - ref).max() <= 1e-12 * np.abs(ref).max()


def test_segments_refuse_operands_not_in_the_split_form():
    assert conv.segments(256, 384) == [(0, 0, 256), (0, 256, 128)]
    with pytest.raises(ValueError):
        conv.segments(384, 384)
