"""Matrix products on tensor cores through cuBLASLt / cuBLAS (nvmath-python's low-level bindings).

Row-major C[M, N] = A[M, K] B[N, K]^T is the column-major product C^T = B^T A with B transposed:
cuBLAS sees m = N, n = M, k = K. bf16 operands are uint16 device arrays; accumulation is float32;
the output is float32 or bf16. The algorithm is chosen once per shape (heuristic, optionally timed).
GPU only: the simulator has no cuBLAS.
"""

import numpy as np
from numba import cuda

from .core import EPS16, Case, from_bf16_bits, gamma, to_bf16_bits

R_16BF, R_32F = 14, 0          # cudaDataType
COMPUTE_32F = 68               # cublasComputeType_t
COMPUTE_32F_FAST_TF32 = 77     # float32 data, products on tensor cores with TF32 inputs
EPS_TF32 = 2.0 ** -10          # TF32 keeps 10 mantissa bits: the input conversion's relative error, truncating
OP_N, OP_T = 0, 1
WORKSPACE = 32 << 20
CANDIDATES = 16                # heuristic algorithms asked for (timed when tuning)


def pointer(a):
    """Device address of a numba device array (its first element)."""
    return a.__cuda_array_interface__["data"][0]


def stream_handle(stream):
    """Raw CUstream of 0, a numba stream, a cuda.core Stream or a cuda.core GraphBuilder."""
    if stream is None or stream == 0:
        return 0
    if hasattr(stream, "stream") and not hasattr(stream, "handle"):
        stream = stream.stream
    h = stream.handle
    return int(h.value) if hasattr(h, "value") else int(h)


def _set(setter, obj, attr, value, dtype):
    buf = np.array([value], dtype=dtype)
    setter(obj, int(attr), buf.ctypes.data, buf.itemsize)


class Blas:
    """One cuBLASLt + cuBLAS handle pair, a workspace and the per-shape algorithm cache."""

    def __init__(self, tune=False):
        from nvmath.bindings import cublas, cublasLt
        self.lt, self.cb = cublasLt, cublas
        self.lt_handle = cublasLt.create()
        self.cb_handle = cublas.create()
        self.workspace = cuda.device_array(WORKSPACE, np.uint8)
        self.cb.set_workspace(self.cb_handle, pointer(self.workspace), WORKSPACE)
        self.tune = tune
        self._plans = {}
        self._one = np.array([1.0], np.float32)
        self._zero = np.array([0.0], np.float32)

    # --- cuBLASLt: bf16 x bf16 -> float32 / bf16, optional bias and accumulate ----------------
    def _plan(self, m, n, k, out_type, bias, accumulate, stream):
        key = (m, n, k, out_type, bias, accumulate)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        lt, A = self.lt, self.lt.MatmulDescAttribute
        desc = lt.matmul_desc_create(COMPUTE_32F, R_32F)
        _set(lt.matmul_desc_set_attribute, desc, A.TRANSA, OP_T, np.int32)
        _set(lt.matmul_desc_set_attribute, desc, A.TRANSB, OP_N, np.int32)
        if bias:
            _set(lt.matmul_desc_set_attribute, desc, A.EPILOGUE, int(lt.Epilogue.BIAS), np.uint32)
            _set(lt.matmul_desc_set_attribute, desc, A.BIAS_DATA_TYPE, R_32F, np.int32)
        a_layout = lt.matrix_layout_create(R_16BF, k, n, k)    # the weight, [N, K] row-major
        b_layout = lt.matrix_layout_create(R_16BF, k, m, k)    # the activations, [M, K] row-major
        c_layout = lt.matrix_layout_create(out_type, n, m, n)
        pref = lt.matmul_preference_create()
        _set(lt.matmul_preference_set_attribute, pref, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
             WORKSPACE, np.uint64)
        found = np.zeros(CANDIDATES, dtype=lt.matmul_heuristic_result_dtype)
        count = np.zeros(1, np.int32)
        lt.matmul_algo_get_heuristic(self.lt_handle, desc, a_layout, b_layout, c_layout, c_layout, pref,
                                     len(found), found.ctypes.data, count.ctypes.data)
        if count[0] == 0:
            raise RuntimeError(f"cuBLASLt has no algorithm for M={m} N={n} K={k}")
        plan = {"desc": desc, "layouts": (a_layout, b_layout, c_layout), "found": found, "choice": 0,
                "count": int(count[0])}
        self._plans[key] = plan
        return plan

    def _launch(self, plan, a, x, out, bias, accumulate, stream, choice, c=None):
        lt = self.lt
        if bias is not None:
            _set(lt.matmul_desc_set_attribute, plan["desc"], lt.MatmulDescAttribute.BIAS_POINTER,
                 pointer(bias), np.int64)
        a_layout, b_layout, c_layout = plan["layouts"]
        found = plan["found"]
        algo = found.ctypes.data + choice * found.itemsize
        beta = self._one if accumulate else self._zero
        c = out if c is None else c        # out-of-place C (same type and layout as D) is allowed
        lt.matmul(self.lt_handle, plan["desc"], self._one.ctypes.data, pointer(a), a_layout, pointer(x),
                  b_layout, beta.ctypes.data, pointer(c), c_layout, pointer(out), c_layout, algo,
                  pointer(self.workspace), WORKSPACE, stream_handle(stream))

    def linear(self, x, w, out, bias=None, accumulate=False, residual=None, stream=0):
        """out[M, N] (+)= x[M, K] @ w[N, K]^T (+ bias[N]) (+ residual[M, N], the beta = 1 epilogue reading
        another array); x, w bf16 bits; out (and residual) float32 or bf16 bits, contiguous."""
        m, k = x.shape
        n = w.shape[0]
        out_type = R_32F if out.dtype == np.float32 else R_16BF
        if residual is not None and (residual.dtype != out.dtype or tuple(residual.shape) != (m, n)):
            raise ValueError(f"residual {residual.dtype} {residual.shape} does not match out {out.dtype} {(m, n)}")
        accumulate = accumulate or residual is not None
        plan = self._plan(m, n, k, out_type, bias is not None, accumulate, stream)
        if self.tune and "tuned" not in plan:
            plan["choice"] = self._time_choices(plan, w, x, out, bias, accumulate, stream)
            plan["tuned"] = True
        self._launch(plan, w, x, out, bias, accumulate, stream, plan["choice"], residual)

    def _time_choices(self, plan, w, x, out, bias, accumulate, stream):
        """Time each heuristic candidate a few times and keep the fastest (output is recomputed after)."""
        best, best_ms = 0, float("inf")
        for i in range(plan["count"]):
            start, stop = cuda.event(), cuda.event()
            try:
                self._launch(plan, w, x, out, bias, False, stream, i)
                start.record()
                for _ in range(5):
                    self._launch(plan, w, x, out, bias, False, stream, i)
                stop.record()
                stop.synchronize()
            except Exception:
                continue
            ms = cuda.event_elapsed_time(start, stop)
            if ms < best_ms:
                best, best_ms = i, ms
        return best

    # --- cuBLAS: float32 strided-batched products (attention scores and mixing) ---------------
    def gemm_batched_f32(self, transa, transb, m, n, k, a, a_off, lda, stride_a, b, b_off, ldb, stride_b,
                         c, c_off, ldc, stride_c, batch, alpha=1.0, stream=0, tf32=False):
        """Column-major C = alpha op(A) op(B), float32 data, batch of `batch` with element strides/offsets;
        `tf32`: the products on tensor cores from TF32-rounded inputs (float32 accumulate)."""
        self.cb.set_stream(self.cb_handle, stream_handle(stream))
        alpha_buf = np.array([alpha], np.float32)
        self.cb.gemm_strided_batched_ex(
            self.cb_handle, transa, transb, m, n, k, alpha_buf.ctypes.data,
            pointer(a) + 4 * a_off, R_32F, lda, stride_a, pointer(b) + 4 * b_off, R_32F, ldb, stride_b,
            self._zero.ctypes.data, pointer(c) + 4 * c_off, R_32F, ldc, stride_c, batch,
            COMPUTE_32F_FAST_TF32 if tf32 else COMPUTE_32F, -1)


_blas = None


def blas():
    """The process's Blas (handles created on first use, on the current device); it times the heuristic's
    candidates once per shape and keeps the fastest."""
    global _blas
    if _blas is None:
        _blas = Blas(tune=True)
    return _blas


def linear_reference(x_bits, w_bits, bias=None):
    y = from_bf16_bits(x_bits) @ from_bf16_bits(w_bits).T
    return y if bias is None else y + bias.astype(np.float64)


# --- contract (GPU only) -----------------------------------------------------------------------
def _make(rng, size):
    m, k, n = (8, 64, 64) if size == "tiny" else (256, 4096, 4096)
    return {"x": to_bf16_bits(rng.standard_normal((m, k))), "w": to_bf16_bits(rng.standard_normal((n, k)) * 0.02),
            "bias": rng.standard_normal(n).astype(np.float32)}


def _run(inp, control, out_dtype=np.float32):
    x, w = cuda.to_device(inp["x"]), cuda.to_device(inp["w"])
    bias = cuda.to_device(inp["bias"]) if out_dtype == np.float32 else None
    if control:
        w = cuda.to_device(np.ascontiguousarray(inp["w"].T))   # the weight not transposed
    out = cuda.device_array((x.shape[0], w.shape[0]), out_dtype)
    blas().linear(x, w, out, bias=bias)
    cuda.synchronize()
    host = out.copy_to_host()
    return from_bf16_bits(host) if out_dtype == np.uint16 else host


def _ref(inp, out_bits=False):
    bias = None if out_bits else inp["bias"]
    ref = linear_reference(inp["x"], inp["w"], bias)
    terms = np.abs(from_bf16_bits(inp["x"])) @ np.abs(from_bf16_bits(inp["w"])).T
    terms += 0 if bias is None else np.abs(bias)
    # exact bf16 products summed in float32 over K terms (+ the bias); a bf16 output adds half an ulp
    bound = gamma(inp["x"].shape[1] + 1) * terms + 1e-30
    return ref, bound + (EPS16 * np.abs(ref) if out_bits else 0)


def _run_residual(inp, control):
    x, w = cuda.to_device(inp["x"]), cuda.to_device(inp["w"])
    residual = cuda.to_device(inp["residual"])
    out = cuda.device_array((x.shape[0], w.shape[0]), np.float32)
    # control: the residual ignored (the plain product)
    blas().linear(x, w, out, residual=None if control else residual)
    cuda.synchronize()
    return out.copy_to_host()


def _ref_residual(inp):
    ref = linear_reference(inp["x"], inp["w"]) + inp["residual"].astype(np.float64)
    terms = np.abs(from_bf16_bits(inp["x"])) @ np.abs(from_bf16_bits(inp["w"])).T + np.abs(inp["residual"])
    return ref, gamma(inp["x"].shape[1] + 1) * terms + 1e-30


def _make_residual(rng, size):
    inp = _make(rng, size)
    inp["residual"] = rng.standard_normal((inp["x"].shape[0], inp["w"].shape[0])).astype(np.float32)
    return inp


CASES = [
    Case("linear_bf16_residual", _make_residual, _run_residual, _ref_residual, simulator=False,
         notes="control: the residual not added"),
    Case("linear_bf16_f32out_bias", _make, _run, _ref, simulator=False,
         notes="control: the weight passed untransposed"),
    Case("linear_bf16_bf16out", _make, lambda i, c: _run(i, c, np.uint16), lambda i: _ref(i, True),
         simulator=False, notes="control: the weight passed untransposed"),
]
