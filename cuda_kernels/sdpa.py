"""Bidirectional attention through cuDNN's fused SDPA (the cuDNN frontend's Python graph API), on bf16 bits
held in numba device arrays, executed from raw device pointers on the caller's stream (so inside a CUDA
graph capture too). q, k, v [S, H, D] of any row stride (column blocks of the fused qkv product), out
[S, H, D] contiguous bf16 bits. One cuDNN graph per (shape, strides, scale), built once and kept.

Needs `nvidia-cudnn-frontend` and the cuDNN 9 library (the GPU extra's `nvidia-cudnn-cu13`); `available()`
says whether both load, and the op table falls back to cuda_kernels.flash where they do not.
"""

import numpy as np
from numba import cuda

from .core import EPS16, Case, from_bf16_bits, to_bf16_bits
from .gemm import pointer, stream_handle

_state = {}


def available():
    """(True, "") when cuDNN's SDPA can be built here, else (False, why)."""
    if "ok" not in _state:
        try:
            import cudnn
            _state["handle"] = cudnn.create_handle()
            _state["ok"] = (True, f"cuDNN frontend {cudnn.__version__}, backend {cudnn.backend_version()}")
        except Exception as e:   # missing wheel, missing library, no device: each its own exception type
            _state["ok"] = (False, f"cuDNN SDPA unavailable ({type(e).__name__}: {e})")
    return _state["ok"]


def build(graph, every=False):
    """Validate a cuDNN graph and build its plan: the first of the heuristic's ranking (mode A, then the
    fallback engines) that builds, or with `every` each ranked plan that builds (for timing them one by one,
    execute_plan_at_index). Returns the built plan's workspace bytes (at least 1)."""
    import cudnn
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    if every:
        graph.build_plans(cudnn.build_plan_policy.ALL)
    else:
        graph.build_plans()
    return max(1, graph.get_workspace_size())


def _strides(a):
    item = a.dtype.itemsize
    return tuple(s // item for s in a.strides)


class _Plan:
    """A built cuDNN SDPA graph for one geometry, its tensors and workspace."""

    def __init__(self, shape, strides, scale, every=False):
        import cudnn
        handle = _state["handle"]
        s, h, d = shape
        g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)

        def declare(name, st):
            # dims [B, H, S, D]: the head stride and the token (row) stride of the [S, H, D] array
            return g.tensor(name=name, dim=[1, h, s, d], stride=[s * st[0], st[1], st[0], st[2]],
                            data_type=cudnn.data_type.BFLOAT16)

        self.q, self.k, self.v = (declare(n, st) for n, st in zip("qkv", strides[:3]))
        o, _ = g.sdpa(q=self.q, k=self.k, v=self.v, attn_scale=float(scale), generate_stats=False, name="sdpa")
        st = strides[3]
        o.set_output(True).set_dim([1, h, s, d]).set_stride([s * st[0], st[1], st[0], st[2]]) \
            .set_data_type(cudnn.data_type.BFLOAT16)
        self.o = o
        self.graph = g
        self.workspace = cuda.device_array(build(g, every), np.uint8)


def supports(q, k, v, out, scale):
    """Whether cuDNN builds a plan for this geometry (it is built and kept on the first ask)."""
    if not available()[0]:
        return False
    try:
        _plan(q, k, v, out, scale)
    except Exception:      # cudnnGraphNotSupportedError and the validation errors of odd shapes
        return False
    return True


def _plan(q, k, v, out, scale):
    key = (tuple(q.shape), tuple(_strides(a) for a in (q, k, v, out)), float(scale))
    plans = _state.setdefault("plans", {})
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _Plan(q.shape, key[1], scale)
    return plan


def plan_times(q, k, v, out, scale, stream, reps=20):
    """[(plan name, ms a call or why it did not run)] for every plan cuDNN ranks for this geometry, in
    ranking order (index 0 is the one `attention` runs), each timed with CUDA events over `reps` calls on
    `stream` (a numba stream) after one warm-up call. A probe for the benchmark: the plans are built apart
    from the kept ones."""
    import cudnn
    plan = _Plan(tuple(q.shape), tuple(_strides(a) for a in (q, k, v, out)), scale, every=True)
    g, handle = plan.graph, _state["handle"]
    cudnn.set_stream(handle, stream_handle(stream))
    pack = {plan.q: pointer(q), plan.k: pointer(k), plan.v: pointer(v), plan.o: pointer(out)}
    times = []
    for i in range(g.get_execution_plan_count()):
        try:
            name = g.get_plan_name_at_index(i)
            space = cuda.device_array(max(1, g.get_workspace_size_plan_at_index(i)), np.uint8)
            g.execute_plan_at_index(pack, pointer(space), index=i, handle=handle)
            start, stop = cuda.event(), cuda.event()
            start.record(stream)
            for _ in range(reps):
                g.execute_plan_at_index(pack, pointer(space), index=i, handle=handle)
            stop.record(stream)
            stop.synchronize()
            times.append((name, cuda.event_elapsed_time(start, stop) / reps))
        except Exception as e:        # a plan that did not build, or declines this geometry
            times.append((f"plan {i}", f"{type(e).__name__}: {e}"[:160]))
    return times


def attention(q, k, v, out, scale, stream=0):
    """out = softmax(q k^T scale) v per head, all [S, H, D] bf16 bits (uint16); q, k, v may be strided views."""
    import cudnn
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    for name, a in (("q", q), ("k", k), ("v", v), ("out", out)):
        if a.dtype != np.uint16 or a.ndim != 3 or a.strides[2] != 2:
            raise ValueError(f"sdpa: {name} must be [S, H, D] bf16 bits with unit element stride")
    plan = _plan(q, k, v, out, scale)
    handle = _state["handle"]
    cudnn.set_stream(handle, stream_handle(stream))
    plan.graph.execute({plan.q: pointer(q), plan.k: pointer(k), plan.v: pointer(v), plan.o: pointer(out)},
                       pointer(plan.workspace), handle=handle)


# --- contract --------------------------------------------------------------------------------
def attention_reference(q, k, v, scale):
    """float64 softmax(q k^T scale) v per head of [S, H, D] arrays, and P |v| (the bound's magnitude)."""
    qh, kh, vh = (np.transpose(np.asarray(a, np.float64), (1, 0, 2)) for a in (q, k, v))
    s = qh @ np.transpose(kh, (0, 2, 1)) * scale
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.transpose(p @ vh, (1, 0, 2)), np.transpose(p @ np.abs(vh), (1, 0, 2))


def _make(rng, size):
    s, h, d = (300, 2, 128) if size == "tiny" else (1324, 24, 128)
    qkv = rng.standard_normal((s, 3, h, d)) * np.array([2.0, 2.0, 1.0])[None, :, None, None]
    return {"qkv": to_bf16_bits(qkv), "scale": 1.0 / np.sqrt(d)}


def _run(inp, control):
    """q, k, v read in place from one [S, 3, H, D] product output, as the DiT's fused qkv leaves them."""
    qkv = cuda.to_device(inp["qkv"])
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    out = cuda.device_array(q.shape, np.uint16)
    d = q.shape[2]
    attention(q, k, v, out, 1.0 / d if control else inp["scale"])
    cuda.synchronize()
    return from_bf16_bits(out.copy_to_host())


def _ref(inp):
    x = from_bf16_bits(inp["qkv"])
    ref, mag = attention_reference(x[:, 0], x[:, 1], x[:, 2], inp["scale"])
    # P rounded to bf16 before P V (each term within EPS16), the output rounded to bf16: 2 EPS16 of P |v|
    return ref, 2 * EPS16 * (mag + np.abs(ref)) + 1e-30


CASES = [Case("cudnn_sdpa", _make, _run, _ref, simulator=False,
              notes="q/k/v strided views of one qkv product; control: scale 1/D instead of 1/sqrt(D)")]
