"""GEMM benchmark on the GPU: cuBLASLt via nvmath on numba arrays vs torch.matmul bf16, same run.

    python scripts/gpu_bench_gemm.py            # prints a markdown table

Per shape and row count: the heuristic-only tuner (the heuristic's top 16 timed; "old") and the widened one
(plus split-K variants where the output has few tiles; "new"), bf16 output and float32 output (+ the
residual epilogue where the encoder uses it), the widened tuner's chosen algorithm (id, tile, split-K,
reduction scheme) and torch.matmul bf16 (on the same default stream). Times in us per call on the GPU alone:
CUDA events around REPS calls queued behind a spin kernel, so Python's launch cost does not count (the
encoder replays its products in a CUDA graph).
A failing row prints its error and the run goes on.
"""

import sys
import time
import traceback

import numpy as np
import torch
from numba import cuda

from cuda_kernels.gemm import Blas, GpuTimer, _row, algo_config
from cuda_kernels.layout import random_bf16

# (name, K, N, residual): the Qwen3.5-9B encoder's products as the fused graph runs them, then the DiT's
SHAPES = [("enc GDN in_proj (stacked)", 4096, 12352, False), ("enc out_proj / o_proj", 4096, 4096, True),
          ("enc attn q+k+v", 4096, 10240, False), ("enc gate+up", 4096, 24576, False),
          ("enc down", 12288, 4096, True),
          ("DiT q/k/v/o", 3072, 3072, False), ("DiT up+gate", 3072, 16384, False), ("DiT down", 8192, 3072, False)]
ROWS = (112, 1024, 4352)
LAST_ROWS_BUDGET_S = 40        # the last row count only if the run so far took less than this
REPS = 30
REDUCTION = {0: "none", 1: "inplace", 2: "f32 ws", 4: "out ws"}
DETAIL = []                    # the fastest candidates per shape at the first row count, printed after


TIMER = None


def time_us(fn):
    """Mean us per call over REPS calls on the GPU alone (gemm.GpuTimer: the default stream is held while
    the calls are queued, as a CUDA graph replays them), after a warm-up."""
    global TIMER
    if TIMER is None:
        TIMER = GpuTimer()
    return TIMER(fn, REPS) * 1e3


def algo_text(info):
    if not info:
        return "?"
    split = f" split {info['splitk']} {REDUCTION.get(info['reduction'], info['reduction'])}" \
        if info["splitk"] > 1 else ""
    return f"id {info['id']} {info['tile']}{split} ({info['candidates']} cand.)"


def fastest(blas, m, n, k, out_dtype, residual, count=5):
    """The tuner's first-round times of its `count` fastest candidates, as text."""
    plan = blas.planned(m, n, k, out_dtype, accumulate=residual)
    timed = sorted((t, i) for i, t in enumerate(plan.get("times") or []) if t is not None)[:count]
    parts = []
    for t, i in timed:
        algo_id, tile, split, scheme, _, _ = algo_config(blas.lt, _row(plan["found"], i))
        where = "heur" if i < plan["heuristic"] else "split"
        parts.append(f"{t * 1e3:.1f} us {tile}/{split}/{REDUCTION.get(scheme, scheme)} ({where})")
    return "; ".join(parts)


def row(old, new, m, name, k, n, residual):
    x = cuda.device_array((m, k), np.uint16)
    w = cuda.device_array((n, k), np.uint16)
    random_bf16(x.reshape(x.size), 1, 1.0)
    random_bf16(w.reshape(w.size), 2, 0.02)
    o16 = cuda.device_array((m, n), np.uint16)
    o32 = cuda.device_array((m, n), np.float32)
    res = cuda.to_device(np.ones((m, n), np.float32)) if residual else None
    cuda.synchronize()
    old16 = time_us(lambda: old.linear(x, w, o16))
    new16 = time_us(lambda: new.linear(x, w, o16))
    old32 = time_us(lambda: old.linear(x, w, o32, residual=res))
    new32 = time_us(lambda: new.linear(x, w, o32, residual=res))
    tx = torch.as_tensor(x, device="cuda").view(torch.bfloat16)
    tw = torch.as_tensor(w, device="cuda").view(torch.bfloat16)
    tt = time_us(lambda: torch.matmul(tx, tw.T))
    # same numbers? ours (widened tuner, bf16 out) against torch's
    new.linear(x, w, o16)
    cuda.synchronize()
    ref = torch.matmul(tx, tw.T).float()
    ours = torch.as_tensor(o16, device="cuda").view(torch.bfloat16).float()
    rel = float(torch.linalg.norm(ours - ref) / torch.linalg.norm(ref))
    info16 = new.chosen(m, n, k, np.uint16)
    info32 = new.chosen(m, n, k, np.float32, accumulate=residual)
    tflop = 2.0 * m * k * n / 1e6       # TFLOP/s = flop / us / 1e6
    best = min(new16, new32)
    print(f"| {m} | {name} | {k} | {n} | {old16:.1f} | {new16:.1f} | {old32:.1f} | {new32:.1f} | {tt:.1f} | "
          f"{tflop / best:.0f} | {tt / new16:.2f} | {old16 / new16:.2f} / {old32 / new32:.2f} | "
          f"{algo_text(info16)} | {algo_text(info32)} | {rel:.1e} |")
    if m == ROWS[0]:
        try:
            DETAIL.append(f"M={m} K={k} N={n} f32: " + fastest(new, m, n, k, np.float32, residual))
        except Exception as exc:
            DETAIL.append(f"M={m} K={k} N={n}: {type(exc).__name__}: {exc}")


def main():
    start = time.time()
    old, new = Blas(tune=True, widen=False), Blas(tune=True)
    print("f32 out: with the residual epilogue (beta = 1, C != D) where the encoder uses it; us per call; "
          "TFLOP/s of the better new column")
    print("| M | shape | K | N | old bf16 (us) | new bf16 | old f32 | new f32 | torch bf16 | new TFLOP/s | "
          "torch/new bf16 | old/new bf16 / f32 | new algo bf16 | new algo f32 | rel diff vs torch |")
    print("|" + "---|" * 15)
    for m in ROWS:
        if m == ROWS[-1] and time.time() - start > LAST_ROWS_BUDGET_S:
            print(f"(M = {m} left out: {time.time() - start:.0f} s so far)")
            break
        for name, k, n, residual in SHAPES:
            try:
                row(old, new, m, name, k, n, residual)
            except Exception as exc:
                print(f"| {m} | {name} | {k} | {n} | error: {type(exc).__name__}: {exc} |")
                traceback.print_exc(file=sys.stderr)
            sys.stdout.flush()
    print("\nwidened tuner, fastest candidates (first-round time, tile/split/reduction, from):")
    for line in DETAIL:
        print(line)
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
