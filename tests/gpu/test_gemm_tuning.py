"""On a GPU: the tuned cuBLASLt products at the encoder's 112-token bucket stay within the gemm gate.

The widened tuner times split-K variants of the heuristic's algorithms; which one wins depends on timing,
so every candidate it may keep is held against the float64 reference within the gate of cuda_kernels.gemm
(float32 sums over K terms; a bf16 output adds half an ulp), for a float32 output with the residual
epilogue and for a bf16 output. The chosen one must also give the same bits on every call.
"""

import numpy as np
import pytest

import cuda_kernels

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")

M = 112
# (K, N) of the Qwen3.5-9B encoder's products: GDN in_proj stacked, out_proj / o_proj, attention q|k|v
# stacked, gate|up stacked, down
SHAPES = [(4096, 12352), (4096, 4096), (4096, 10240), (4096, 24576), (12288, 4096)]


@pytest.fixture(scope="module")
def blas():
    from cuda_kernels.gemm import Blas
    return Blas(tune=True)


def _inputs(k, n):
    from cuda_kernels.core import to_bf16_bits
    rng = np.random.default_rng(k * 7 + n)
    return {"x": to_bf16_bits(rng.standard_normal((M, k))),
            "w": to_bf16_bits(rng.standard_normal((n, k), dtype=np.float32) * 0.02),
            "residual": rng.standard_normal((M, n)).astype(np.float32)}


def _every_candidate(blas, plan, x, w, out, residual, ref, bound, to_host):
    """Each candidate of the plan launched on its own; returns the ones outside the gate."""
    from numba import cuda

    from cuda_kernels.core import gate
    from cuda_kernels.gemm import _row, algo_config
    bad = []
    for i in range(plan["count"]):
        if plan["times"][i] is None:
            continue                              # failed to launch while tuning: never chosen
        blas._launch(plan, w, x, out, None, residual is not None, 0, i, residual)
        cuda.synchronize()
        ok, worst = gate(to_host(out), ref, bound)
        if not ok:
            bad.append((i, algo_config(blas.lt, _row(plan["found"], i)), worst))
    return bad


@pytest.mark.parametrize("k,n", SHAPES)
def test_tuned_products_and_all_their_candidates_are_within_the_gate(blas, k, n):
    from numba import cuda

    from cuda_kernels import gemm
    from cuda_kernels.core import from_bf16_bits, gate
    inp = _inputs(k, n)
    x, w, residual = cuda.to_device(inp["x"]), cuda.to_device(inp["w"]), cuda.to_device(inp["residual"])

    # float32 output with the residual (beta = 1) epilogue: the encoder's o_proj / out_proj / down
    ref, bound = gemm._ref_residual(inp)
    out = cuda.device_array((M, n), np.float32)
    blas.linear(x, w, out, residual=residual)
    first = out.copy_to_host()
    blas.linear(x, w, out, residual=residual)
    second = out.copy_to_host()
    ok, worst = gate(first, ref, bound)
    info = blas.chosen(M, n, k, np.float32, accumulate=True)
    print(f"K={k} N={n} f32+residual: chosen {info}, worst/gate {worst:.3g}")
    assert ok, f"chosen {info}: worst error / gate {worst:.3g}"
    assert np.array_equal(first, second), "the chosen algorithm gave different bits on a second call"
    assert info["candidates"] > info["heuristic"], "no split-K variant was accepted at M = 112"
    plan = blas.planned(M, n, k, np.float32, accumulate=True)
    bad = _every_candidate(blas, plan, x, w, out, residual, ref, bound, lambda a: a.copy_to_host())
    assert not bad, f"candidates outside the gate (index, config, worst/gate): {bad}"

    # bf16 output, no residual
    ref, bound = gemm._ref(inp, out_bits=True)
    out16 = cuda.device_array((M, n), np.uint16)
    blas.linear(x, w, out16)
    first = out16.copy_to_host()
    blas.linear(x, w, out16)
    ok, worst = gate(from_bf16_bits(first), ref, bound)
    info = blas.chosen(M, n, k, np.uint16)
    print(f"K={k} N={n} bf16: chosen {info}, worst/gate {worst:.3g}")
    assert ok, f"chosen {info}: worst error / gate {worst:.3g}"
    assert np.array_equal(first, out16.copy_to_host()), "the chosen algorithm gave different bits on a second call"
    plan = blas.planned(M, n, k, np.uint16)
    bad = _every_candidate(blas, plan, x, w, out16, None, ref, bound, lambda a: from_bf16_bits(a.copy_to_host()))
    assert not bad, f"candidates outside the gate (index, config, worst/gate): {bad}"


def test_the_search_is_not_widened_for_large_outputs(blas):
    """At 4352 rows the output has many tiles: only the heuristic's algorithms are timed."""
    from numba import cuda
    k, n, m = 4096, 4096, 4352
    x = cuda.to_device(np.zeros((m, k), np.uint16))
    w = cuda.to_device(np.zeros((n, k), np.uint16))
    out = cuda.device_array((m, n), np.float32)
    blas.linear(x, w, out)
    info = blas.chosen(m, n, k, np.float32)
    assert info["candidates"] == info["heuristic"] <= 16
    assert not np.any(out.copy_to_host())


def test_a_stored_pick_runs_the_tuned_algorithm_in_a_new_blas(blas, tmp_path):
    """tuned_picks() written as PICKS stores them, read back by a Blas that does not tune: it runs the same
    algorithm (same configuration, same bits); another GPU's or library's records are not read."""
    import json

    from numba import cuda

    from cuda_kernels import gemm
    k, n = SHAPES[1]
    inp = _inputs(k, n)
    x, w, residual = cuda.to_device(inp["x"]), cuda.to_device(inp["w"]), cuda.to_device(inp["residual"])
    out = cuda.device_array((M, n), np.float32)
    blas.linear(x, w, out, residual=residual)
    tuned_bits = out.copy_to_host()
    path = tmp_path / "picks.json"
    path.write_text(json.dumps({blas.library_key(): blas.tuned_picks()}))
    stored = gemm.Blas(picks=gemm.stored_picks(blas.library_key(), path))
    out2 = cuda.device_array((M, n), np.float32)
    stored.linear(x, w, out2, residual=residual)
    info, tuned = stored.chosen(M, n, k, np.float32, accumulate=True), blas.chosen(M, n, k, np.float32, accumulate=True)
    assert info["stored"] and not tuned["stored"]
    assert [info[f] for f in ("id", "tile", "splitk", "reduction")] == [tuned[f] for f in ("id", "tile", "splitk", "reduction")]
    assert np.array_equal(out2.copy_to_host(), tuned_bits)
    plain = gemm.Blas(picks={})
    plain.linear(x, w, out2, residual=residual)
    assert not plain.chosen(M, n, k, np.float32, accumulate=True)["stored"]
    assert gemm.stored_picks("no such GPU | cuBLASLt 0", path) == {}
