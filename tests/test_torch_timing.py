"""scripts/torch_timing.kernel_table, the GPU scripts' CUPTI summary, on made-up spans: time per kernel name and
run, the busy time with overlaps counted once, the idle gaps between the kernels either side."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from torch_timing import kernel_table, table_lines  # noqa: E402

# two runs of: product 0-100 us, norm 100-130, a side copy 110-150 overlapping it, idle to 400, product 400-500
SPANS = [(0, 100, "sm90_gemm_a"), (100, 130, "norm_kernel"), (110, 150, "Memcpy DtoD"), (400, 500, "sm90_gemm_b"),
         (1000, 1100, "sm90_gemm_a"), (1100, 1130, "norm_kernel"), (1110, 1150, "Memcpy DtoD"),
         (1400, 1500, "sm90_gemm_b")]


def test_times_are_per_run_and_overlaps_count_once():
    table = kernel_table(SPANS, repeats=2)
    assert table["span_ms"] == pytest.approx(0.75)                 # 0 to 1500 us over two runs
    assert table["busy_ms"] == pytest.approx(0.25)                 # (100 + 50 + 100) us a run
    assert table["kernels"]["sm90_gemm_a"] == {"ms": pytest.approx(0.1), "launches": 1.0}
    assert list(table["kernels"])[0] in ("sm90_gemm_a", "sm90_gemm_b")   # largest first


def test_gaps_name_the_kernels_either_side_longest_first():
    gaps = kernel_table(SPANS, repeats=2)["idle_gaps_ms"]
    assert gaps[0] == (pytest.approx(0.5), "sm90_gemm_b", "sm90_gemm_a")    # 500 to 1000 us
    assert gaps[1] == (pytest.approx(0.25), "Memcpy DtoD", "sm90_gemm_b")   # 150 to 400: after the copy, not the norm
    assert len(gaps) == 3


def test_a_group_function_merges_names():
    table = kernel_table(SPANS, repeats=2, group=lambda n: "products" if "gemm" in n else n)
    assert table["kernels"]["products"] == {"ms": pytest.approx(0.2), "launches": 2.0}
    assert any(line.endswith("products") and "0.200 ms" in line for line in table_lines(table))


def test_by_family_names_ours_by_the_first_key_and_the_rest_as_cublas():
    from torch_timing import by_family
    group = by_family(("Memcpy", "im2col", "copy"))
    assert group("_ZN6cudapy4conv6im2col_copy") == "im2col"
    assert group("Memcpy HtoD (Pinned -> Device)") == "Memcpy"
    assert group("sm90_xmma_gemm_f16") == "cuBLAS sm90_xmma_gemm_f16"


def test_the_best_compile_mode_is_the_fastest_that_ran():
    from torch_timing import best_mode
    assert best_mode({"default": {"ms": 185.5, "compile_s": 13.5}, "reduce-overhead": {"ms": 181.0, "compile_s": 16.0},
                      "max-autotune-no-cudagraphs": {"error": "RuntimeError: no triton"}}) == "reduce-overhead"
    assert best_mode({"default": {"error": "BackendCompilerFailed"}}) is None
    assert best_mode({}) is None
