"""GEMM benchmark on the GPU: cuBLASLt via nvmath on numba arrays vs torch.matmul bf16, same run.

    python scripts/gpu_bench_gemm.py            # prints a markdown table
"""

import sys

import numpy as np
import torch
from numba import cuda

from cuda_kernels.gemm import Blas
from cuda_kernels.layout import random_bf16

# (name, K, N): the encoder's (Qwen3.5-9B) and the DiT's projections
SHAPES = [("enc qkv (GDN)", 4096, 8192), ("enc z / o / out", 4096, 4096), ("enc gate, up", 4096, 12288),
          ("enc down", 12288, 4096), ("enc k, v", 4096, 1024),
          ("DiT q/k/v/o", 3072, 3072), ("DiT up+gate", 3072, 16384), ("DiT down", 8192, 3072)]
ROWS = (100, 1000, 4352)
REPS = 30


def time_ms(fn, start, stop, sync):
    for _ in range(3):
        fn()
    start()
    for _ in range(REPS):
        fn()
    ms = stop()
    sync()
    return ms / REPS


def main():
    plain, tuned = Blas(), Blas(tune=True)
    print("| M | shape | K | N | ours bf16 out (TFLOP/s) | ours tuned bf16 out | ours f32 out | torch bf16 | ours/torch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in ROWS:
        for name, k, n in SHAPES:
            x = cuda.device_array((m, k), np.uint16)
            w = cuda.device_array((n, k), np.uint16)
            random_bf16(x.reshape(x.size), 1, 1.0)
            random_bf16(w.reshape(w.size), 2, 0.02)
            o16 = cuda.device_array((m, n), np.uint16)
            o32 = cuda.device_array((m, n), np.float32)
            ev = [cuda.event(), cuda.event()]

            def nb_start():
                ev[0].record()

            def nb_stop():
                ev[1].record()
                ev[1].synchronize()
                return cuda.event_elapsed_time(ev[0], ev[1])
            t16 = time_ms(lambda: plain.linear(x, w, o16), nb_start, nb_stop, cuda.synchronize)
            t16t = time_ms(lambda: tuned.linear(x, w, o16), nb_start, nb_stop, cuda.synchronize)
            t32 = time_ms(lambda: plain.linear(x, w, o32), nb_start, nb_stop, cuda.synchronize)
            tx = torch.as_tensor(x, device="cuda").view(torch.bfloat16)
            tw = torch.as_tensor(w, device="cuda").view(torch.bfloat16)
            te = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]

            def t_start():
                te[0].record()

            def t_stop():
                te[1].record()
                te[1].synchronize()
                return te[0].elapsed_time(te[1])
            tt = time_ms(lambda: torch.matmul(tx, tw.T), t_start, t_stop, torch.cuda.synchronize)
            # same numbers? compare ours (bf16 out) with torch's
            ref = torch.matmul(tx, tw.T).float().cpu().numpy()
            ours = torch.as_tensor(o16, device="cuda").view(torch.bfloat16).float().cpu().numpy()
            rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
            flop = 2.0 * m * k * n
            best = min(t16, t16t)
            print(f"| {m} | {name} | {k} | {n} | {flop / t16 / 1e9:.0f} | {flop / t16t / 1e9:.0f} | "
                  f"{flop / t32 / 1e9:.0f} | {flop / tt / 1e9:.0f} | {tt / best:.2f} (rel diff {rel:.1e}) |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
