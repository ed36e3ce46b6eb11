"""Matrix products on tensor cores through cuBLASLt / cuBLAS (nvmath-python's low-level bindings).

Row-major C[M, N] = A[M, K] B[N, K]^T is the column-major product C^T = B^T A with B transposed:
cuBLAS sees m = N, n = M, k = K. bf16 operands are uint16 device arrays; accumulation is float32;
the output is float32 or bf16. The algorithm is chosen once per shape (heuristic, optionally timed).
GPU only: the simulator has no cuBLAS.
"""

import itertools
import json
import os
import time
from pathlib import Path

import numpy as np
from numba import cuda, float32

from .core import EPS16, Case, from_bf16_bits, gamma, jit, to_bf16_bits

R_16BF, R_16F, R_32F = 14, 2, 0  # cudaDataType
COMPUTE_32F = 68               # cublasComputeType_t
COMPUTE_32F_FAST_TF32 = 77     # float32 data, products on tensor cores with TF32 inputs
EPS_TF32 = 2.0 ** -10          # TF32 keeps 10 mantissa bits: the input conversion's relative error, truncating
OP_N, OP_T = 0, 1
WORKSPACE = 32 << 20
CANDIDATES = 16                # heuristic algorithms asked for (timed when tuning)
WIDE_CANDIDATES = 48           # asked for when the search is widened (small outputs)
SPLITS = (2, 3, 4, 6, 8, 12, 16)
# Split-K variants are tried when the output has fewer 128 x 128 tiles than this many waves of SMs: there
# the heuristic's kernels leave SMs idle and the product is bound by reading the weight.
WIDE_WAVES = 4
TIMED_CALLS = 5
# Candidates are timed on copies of the weight that together exceed the L2 several times (H200: 50 MB), one
# per call in turn: in the encoder each weight is read once per pass, from HBM. Timed on one weight, part
# of it stays in L2 (on the H200 a 100-token N = K = 4096 product ran faster on one weight than on the ring).
COLD_BYTES = 256 << 20
FINALISTS = 4                  # timed again over more calls, the fastest kept
# Algorithms the tuner picked on a GPU (scripts/gpu_encoder_9b.py writes them), per GPU name and cuBLASLt
# version: a process finding its shape here runs the stored algorithm (cuBLASLt's algorithm struct may be
# stored and restored for the same library version), so its bytes are as fixed as the heuristic's.
PICKS = Path(__file__).with_name("GEMM_PICKS.json")


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


@jit
def _spin(n, sink):
    """One thread through n dependent float32 FMAs: keeps the stream busy while the host queues work."""
    acc = float32(0.0)
    for _ in range(n):
        acc = acc * float32(0.5) + float32(1.0)
    if acc < float32(0.0):                 # never; keeps the loop
        sink[0] = acc


class GpuTimer:
    """ms per call of fn() on the GPU alone: the stream (0) is held by a spin kernel while the calls are
    queued, so host launch costs (tens of us per cuBLASLt call from Python, more than a small product
    takes) do not leave the GPU idle between them. The hold grows when queueing outlasted it."""

    def __init__(self):
        self.sink = cuda.device_array(1, np.float32)
        self.per_ms = None                 # spin iterations per ms, measured on first use
        self.hold_ms = 1.0

    def _calibrate(self):
        n = 1 << 20                        # a few ms: long against the launch itself
        _spin[1, 1](1, self.sink)          # compiles
        start, stop = cuda.event(), cuda.event()
        start.record()
        _spin[1, 1](n, self.sink)
        stop.record()
        stop.synchronize()
        self.per_ms = n / max(cuda.event_elapsed_time(start, stop), 1e-3)

    def __call__(self, fn, calls):
        if self.per_ms is None:
            self._calibrate()
        for _ in range(3):
            fn()                           # warm-up (also compiles or plans what the first call does)
            cuda.synchronize()
            start, stop = cuda.event(), cuda.event()
            _spin[1, 1](int(self.per_ms * self.hold_ms), self.sink)
            queued = time.perf_counter()
            start.record()
            for _ in range(calls):
                fn()
            stop.record()
            queued = (time.perf_counter() - queued) * 1e3
            stop.synchronize()
            ms = cuda.event_elapsed_time(start, stop) / calls
            if queued < 0.8 * self.hold_ms:
                return ms
            self.hold_ms = 2 * queued      # the GPU may have waited for the host: again, held longer
        return ms


def cold_ring(w, total=COLD_BYTES):
    """w and copies of it, together at least `total` bytes (at least two arrays): timing a product over
    them in turn reads its weight from HBM, as one encoder pass does."""
    ring = [w]
    while len(ring) < 2 or len(ring) * w.nbytes < total:
        copy = cuda.device_array_like(w)
        copy.copy_to_device(w)
        ring.append(copy)
    return ring


def _get(getter, obj, attr, dtype=np.uint32):
    buf = np.zeros(1, dtype)
    written = np.zeros(1, np.uint64)
    getter(obj, int(attr), buf.ctypes.data, buf.itemsize, written.ctypes.data)
    return int(buf[0])


def _row(results, i):
    """Address of the algorithm struct of heuristic result i (the struct is the record's first field)."""
    return results.ctypes.data + i * results.itemsize + results.dtype.fields["algo"][1]


def _config(lt, ptr, attr):
    """One configuration attribute of the algorithm struct at `ptr` (in the attribute's own type)."""
    return _get(lt.matmul_algo_config_get_attribute, ptr, attr, lt.get_matmul_algo_config_attribute_dtype(attr))


def _capability(lt, ptr, attr):
    """One scalar capability attribute of the algorithm struct at `ptr`."""
    return _get(lt.matmul_algo_cap_get_attribute, ptr, attr, lt.get_matmul_algo_cap_attribute_dtype(attr))


def algo_config(lt, ptr):
    """(id, tile, split-K, reduction scheme, stages, cluster shape) of the algorithm struct at `ptr`; tile
    is the cuBLASLt name ("128x64") where known, else its number; None for a field that cannot be read."""
    C = lt.MatmulAlgoConfigAttribute
    fields = []
    for attr in (C.ID, C.TILE_ID, C.SPLITK_NUM, C.REDUCTION_SCHEME, C.STAGES_ID, C.CLUSTER_SHAPE_ID):
        try:
            fields.append(_config(lt, ptr, attr))
        except Exception:
            fields.append(None)
    try:
        fields[1] = lt.MatmulTile(fields[1]).name.removeprefix("TILE_")
    except ValueError:
        pass
    return tuple(fields)


class Blas:
    """One cuBLASLt + cuBLAS handle pair, a workspace and the per-shape algorithm cache."""

    def __init__(self, tune=False, widen=True, picks=None):
        """tune: time the candidates per shape (MOSS_GEMM_TUNE=1); picks: {shape key: algorithm record} to
        run where a shape is found (None: this GPU's and cuBLASLt's entries of PICKS, {}: none)."""
        from nvmath.bindings import cublas, cublasLt
        self.lt, self.cb = cublasLt, cublas
        self.lt_handle = cublasLt.create()
        self.cb_handle = cublas.create()
        self.workspace = cuda.device_array(WORKSPACE, np.uint8)
        self.cb.set_workspace(self.cb_handle, pointer(self.workspace), WORKSPACE)
        self.tune = tune
        self.widen = widen             # when tuning small outputs, time split-K variants too
        self._sms = None
        self._timer = None
        self.cold = True               # time candidates on a ring of weight copies (COLD_BYTES)
        self._plans = {}
        self._one = np.array([1.0], np.float32)
        self._zero = np.array([0.0], np.float32)
        self.picks = stored_picks(self.library_key()) if picks is None else picks

    def library_key(self):
        """'<GPU name> | cuBLASLt <version>': the entry of PICKS this process may use."""
        name = cuda.get_current_device().name
        name = name.decode() if isinstance(name, bytes) else str(name)
        return f"{name} | cuBLASLt {self.lt.get_version()}"

    def tuned_picks(self):
        """{shape key: record} of every tuned shape (the form PICKS stores under library_key())."""
        out = {}
        for key, plan in self._plans.items():
            if plan.get("tuned"):
                choice = plan["choice"]
                times = plan.get("times") or []
                out[_pick_key(key)] = {
                    "algo": plan["found"][choice]["algo"].tobytes().hex(),
                    "config": list(algo_config(self.lt, _row(plan["found"], choice))),
                    "timed_ms": times[choice] if choice < len(times) else None,
                    "first_heuristic_ms": times[0] if times else None}
        return out

    def _restore(self, plan, record):
        """The stored algorithm appended to the plan's candidates and chosen, if cuBLASLt accepts it."""
        cand = plan["found"][:1].copy()
        cand["algo"][0] = np.frombuffer(bytes.fromhex(record["algo"]), dtype=cand["algo"].dtype.base).reshape(
            cand["algo"][0].shape)
        try:
            self.lt.matmul_algo_check(self.lt_handle, plan["desc"], *plan["layouts"], plan["layouts"][2],
                                      _row(cand, 0), cand.ctypes.data)
        except Exception:                   # refused (another library build): keep the heuristic's
            return
        if int(cand[0]["workspace_size"]) > WORKSPACE:
            return
        plan["found"] = np.concatenate([plan["found"], cand])
        plan["count"] = len(plan["found"])
        plan["choice"] = plan["count"] - 1
        plan["stored"] = True

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
            # a bf16 output takes a bf16 bias (cuBLASLt refuses a float32 one there)
            _set(lt.matmul_desc_set_attribute, desc, A.BIAS_DATA_TYPE, R_32F if out_type == R_32F else R_16BF,
                 np.int32)
        a_layout = lt.matrix_layout_create(R_16BF, k, n, k)    # the weight, [N, K] row-major
        b_layout = lt.matrix_layout_create(R_16BF, k, m, k)    # the activations, [M, K] row-major
        c_layout = lt.matrix_layout_create(out_type, n, m, n)
        wide = self.tune and self.widen and self._few_tiles(m, n)
        found = self._heuristic(desc, a_layout, b_layout, c_layout, WIDE_CANDIDATES if wide else CANDIDATES)
        if len(found) == 0:
            raise RuntimeError(f"cuBLASLt has no algorithm for M={m} N={n} K={k}")
        heuristic = len(found)
        if wide:
            found = np.concatenate([found, self._split_variants(found, desc, (a_layout, b_layout, c_layout),
                                                                 k, out_type)])
        plan = {"desc": desc, "layouts": (a_layout, b_layout, c_layout), "found": found, "choice": 0,
                "count": len(found), "heuristic": heuristic}
        record = None if self.tune else self.picks.get(_pick_key(key))
        if record is not None:
            self._restore(plan, record)
        self._plans[key] = plan
        return plan

    def _few_tiles(self, m, n):
        """True when the output [N, M] has fewer 128 x 128 tiles than WIDE_WAVES waves of the GPU's SMs."""
        if self._sms is None:
            self._sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
        return -(-m // 128) * -(-n // 128) < WIDE_WAVES * self._sms

    def _heuristic(self, desc, a_layout, b_layout, c_layout, count, align=None):
        """The heuristic's first `count` algorithms; align: the bytes every operand's pointer is a multiple of,
        where less than the 256 the heuristic assumes by default."""
        lt = self.lt
        pref = lt.matmul_preference_create()
        try:
            P = lt.MatmulPreferenceAttribute
            _set(lt.matmul_preference_set_attribute, pref, P.MAX_WORKSPACE_BYTES, WORKSPACE, np.uint64)
            for attr in (() if align is None else (P.MIN_ALIGNMENT_A_BYTES, P.MIN_ALIGNMENT_B_BYTES,
                                                   P.MIN_ALIGNMENT_C_BYTES, P.MIN_ALIGNMENT_D_BYTES)):
                _set(lt.matmul_preference_set_attribute, pref, attr, align, np.uint32)
            found = np.zeros(count, dtype=lt.matmul_heuristic_result_dtype)
            got = np.zeros(1, np.int32)
            lt.matmul_algo_get_heuristic(self.lt_handle, desc, a_layout, b_layout, c_layout, c_layout, pref,
                                         count, found.ctypes.data, got.ctypes.data)
        finally:
            lt.matmul_preference_destroy(pref)
        return found[:int(got[0])].copy()

    def _split_variants(self, found, desc, layouts, k, out_type):
        """Split-K copies of the heuristic's algorithms that cuBLASLt accepts (matmul_algo_check), one per
        (algorithm, split, reduction scheme), skipping duplicates and any the library refuses.

        Reduction schemes, all deterministic (each output is summed in a fixed order): COMPUTE_TYPE keeps
        the float32 partial sums in the workspace and adds them in a separate kernel; INPLACE (float32 output
        only) adds them into the output in a fixed sequence that counters in the workspace enforce. Not
        OUTPUT_TYPE: for a bf16 output its partial sums would be rounded to bf16."""
        lt, C, cap = self.lt, self.lt.MatmulAlgoConfigAttribute, self.lt.MatmulAlgoCapAttribute
        schemes = [int(lt.ReductionScheme.COMPUTE_TYPE)]
        if out_type == R_32F:
            schemes.append(int(lt.ReductionScheme.INPLACE))
        seen = {found[i]["algo"].tobytes() for i in range(len(found))}
        out = []
        for i in range(len(found)):
            try:
                if _capability(lt, _row(found, i), cap.SPLITK_SUPPORT) != 1:
                    continue
                mask = _capability(lt, _row(found, i), cap.REDUCTION_SCHEME_MASK)
            except Exception:
                continue
            for split in SPLITS:
                if k // split < 256:            # slices shorter than this only add partial sums to read
                    continue
                for scheme in schemes:
                    if not mask & scheme:
                        continue
                    cand = found[i:i + 1].copy()
                    try:
                        for attr, value in ((C.SPLITK_NUM, split), (C.REDUCTION_SCHEME, scheme)):
                            _set(lt.matmul_algo_config_set_attribute, _row(cand, 0), attr, value,
                                 lt.get_matmul_algo_config_attribute_dtype(attr))
                        if cand[0]["algo"].tobytes() in seen:
                            continue
                        lt.matmul_algo_check(self.lt_handle, desc, *layouts, layouts[2], _row(cand, 0),
                                             cand.ctypes.data)
                    except Exception:             # refused by cuBLASLt (NOT_SUPPORTED, INVALID_VALUE, ...)
                        continue
                    if int(cand[0]["workspace_size"]) > WORKSPACE:
                        continue
                    seen.add(cand[0]["algo"].tobytes())
                    out.append(cand)
        return np.concatenate(out) if out else found[:0].copy()

    def _launch(self, plan, a, x, out, bias, accumulate, stream, choice, c=None):
        lt = self.lt
        if bias is not None:
            _set(lt.matmul_desc_set_attribute, plan["desc"], lt.MatmulDescAttribute.BIAS_POINTER,
                 pointer(bias), np.int64)
        a_layout, b_layout, c_layout = plan["layouts"]
        algo = _row(plan["found"], choice)
        beta = self._one if accumulate else self._zero
        c = out if c is None else c        # out-of-place C (same type and layout as D) is allowed
        lt.matmul(self.lt_handle, plan["desc"], self._one.ctypes.data, pointer(a), a_layout, pointer(x),
                  b_layout, beta.ctypes.data, pointer(c), c_layout, pointer(out), c_layout, algo,
                  pointer(self.workspace), WORKSPACE, stream_handle(stream))

    def linear(self, x, w, out, bias=None, accumulate=False, residual=None, stream=0):
        """out[M, N] (+)= x[M, K] @ w[N, K]^T (+ bias[N]) (+ residual[M, N], the beta = 1 epilogue reading
        another array); x, w bf16 bits; out (and residual) float32 or bf16 bits, contiguous; the bias of
        out's type (float32, or bf16 bits)."""
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
        """Time each candidate over a few calls, then the FINALISTS fastest again over more calls, and keep
        the fastest (the output is recomputed after); one that fails to launch is skipped. The first
        round's times (ms per call, None when it failed) are kept in the plan."""
        ring = cold_ring(w) if self.cold else [w]
        times = [self._time_one(plan, ring, x, out, bias, stream, i, TIMED_CALLS) for i in range(plan["count"])]
        plan["times"] = times
        ranked = sorted((t, i) for i, t in enumerate(times) if t is not None)
        if not ranked:
            return 0
        again = ((self._time_one(plan, ring, x, out, bias, stream, i, 4 * TIMED_CALLS), i)
                 for _, i in ranked[:FINALISTS])
        final = [(t, i) for t, i in again if t is not None]
        return min(final)[1] if final else ranked[0][1]

    def _time_one(self, plan, ring, x, out, bias, stream, i, calls):
        """ms per call of candidate i on the GPU (beta = 0, writing out), each call on the next weight of
        the ring; None if it fails. Tuning runs on stream 0 (the eager pass before any capture), where the
        timer holds the GPU."""
        if self._timer is None:
            self._timer = GpuTimer()
        turn = itertools.cycle(ring)
        try:
            return self._timer(lambda: self._launch(plan, next(turn), x, out, bias, False, stream, i), calls)
        except Exception:
            return None

    def planned(self, m, n, k, out_dtype=np.float32, bias=False, accumulate=False):
        """The plan of a product of this shape (None before its first call); accumulate covers residual."""
        return self._plans.get((m, n, k, R_32F if out_dtype == np.float32 else R_16BF, bias, accumulate))

    def chosen(self, m, n, k, out_dtype=np.float32, bias=False, accumulate=False):
        """The algorithm a product of this shape runs (after its first call): algo_config's fields, the
        number of candidates (and of those from the heuristic), and when tuned the timed ms per call of the
        choice and of the best among the first CANDIDATES heuristic ones (what the heuristic-only tuner
        keeps); None before the first call."""
        plan = self.planned(m, n, k, out_dtype, bias, accumulate)
        if plan is None:
            return None
        info = dict(zip(("id", "tile", "splitk", "reduction", "stages", "cluster"),
                        algo_config(self.lt, _row(plan["found"], plan["choice"]))))
        info["candidates"], info["heuristic"] = plan["count"], plan["heuristic"]
        info["stored"] = bool(plan.get("stored"))
        times = plan.get("times")
        if times:
            heur = [t for t in times[:min(plan["heuristic"], CANDIDATES)] if t is not None]
            info["ms"] = times[plan["choice"]]
            info["heuristic_ms"] = min(heur) if heur else None
        return info

    # --- cuBLAS: float32 strided-batched products (attention scores and mixing) ---------------
    def gemm_batched_f32(self, transa, transb, m, n, k, a, a_off, lda, stride_a, b, b_off, ldb, stride_b,
                         c, c_off, ldc, stride_c, batch, alpha=1.0, beta=0.0, stream=0, tf32=False):
        """Column-major C = alpha op(A) op(B) + beta C, float32 data, batch of `batch` with element
        strides/offsets; `tf32`: the products on tensor cores from TF32-rounded inputs (float32 accumulate)."""
        self.cb.set_stream(self.cb_handle, stream_handle(stream))
        alpha_buf, beta_buf = np.array([alpha], np.float32), np.array([beta], np.float32)
        self.cb.gemm_strided_batched_ex(
            self.cb_handle, transa, transb, m, n, k, alpha_buf.ctypes.data,
            pointer(a) + 4 * a_off, R_32F, lda, stride_a, pointer(b) + 4 * b_off, R_32F, ldb, stride_b,
            beta_buf.ctypes.data, pointer(c) + 4 * c_off, R_32F, ldc, stride_c, batch,
            COMPUTE_32F_FAST_TF32 if tf32 else COMPUTE_32F, -1)

    # --- cuBLAS: one float32 product of low-rank factors (LoRA deltas) -------------------------
    def product_f32(self, a, b, out, alpha=1.0, stream=0):
        """Row-major out[M, N] = alpha a[M, K] @ b[K, N]: float32 out and accumulation (no TF32), a and b of one
        type (bf16 bits as uint16, float16 or float32), all contiguous."""
        m, k = a.shape
        n = b.shape[1]
        kind = {"uint16": R_16BF, "float16": R_16F, "float32": R_32F}[np.dtype(a.dtype).name]
        self.cb.set_stream(self.cb_handle, stream_handle(stream))
        alpha_buf = np.array([alpha], np.float32)
        # column-major: out^T [N, M] = b^T [N, K] a^T [K, M], each operand as it lies
        self.cb.gemm_ex(self.cb_handle, OP_N, OP_N, n, m, k, alpha_buf.ctypes.data, pointer(b), kind, n,
                        pointer(a), kind, k, self._zero.ctypes.data, pointer(out), R_32F, n, COMPUTE_32F, -1)


def _pick_key(plan_key):
    """'M=.. N=.. K=.. out=.. bias=.. acc=..' of a plan key (x [M, K], w [N, K]; out f32 or bf16)."""
    m, n, k, out_type, bias, accumulate = plan_key
    return f"M={m} N={n} K={k} out={'f32' if out_type == R_32F else 'bf16'} bias={int(bias)} acc={int(accumulate)}"


def stored_picks(library_key, path=PICKS):
    """PICKS' records for one GPU and cuBLASLt version ({} when there are none)."""
    try:
        return json.loads(Path(path).read_text()).get(library_key, {})
    except FileNotFoundError:
        return {}


_blas = None


# Timing the candidates picks the fastest algorithm per shape, but the pick can differ between processes
# (timing noise) and with it the last bits of a product; moss-encode's bytes must not. So the process's
# Blas runs the stored pick (PICKS) where this GPU and cuBLASLt have one for the shape, else the heuristic's
# first algorithm (fixed for one GPU and cuBLAS version), unless MOSS_GEMM_TUNE=1.
TUNE = os.environ.get("MOSS_GEMM_TUNE", "") == "1"


def blas():
    """The process's Blas (handles created on first use, on the current device); with MOSS_GEMM_TUNE=1 it
    times the candidates once per shape and keeps the fastest."""
    global _blas
    if _blas is None:
        _blas = Blas(tune=TUNE)
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
