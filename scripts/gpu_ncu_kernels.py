"""Launches for Nsight Compute to read counters on, each named group at the 9B encoder's shapes:

  recurrence  the token recurrence, 112 tokens (the GDN shape: 16 key heads, 32 value heads, dk = dv = 128)
  products    the 100-token products whose weights stream slowest (N = 4096 from K = 4096 and 12288)
  flash       causal flash attention, 1000 tokens (16 query heads, 4 key/value heads, head dim 256)
  chunked     the chunked delta rule's setup and walk, 1000 tokens
  rows        the row kernels of a 1000-token encode (the contract's real cases): gdn_inputs, swiglu,
              rms_norm and gated_rms_norm with bf16 outputs
  decoder     one chunk of a 96 -> 96 channel tap conv of the 1024 decode: its split image (plain and of
              silu(group_norm)) and its finish with a residual

    ncu --clock-control none --set full -k regex:'gated_delta_rule|nvjet' python3 scripts/gpu_ncu_kernels.py
    python3 scripts/gpu_ncu_kernels.py flash chunked       (the kernels: flash|prep, setup|walk)
    python3 scripts/gpu_ncu_kernels.py rows                (the kernels: gdn_inputs|swiglu|rms_norm)
    python3 scripts/gpu_ncu_kernels.py decoder             (the kernels: split_image|finish)

(run as a script, as gpu_run.sh does: it imports its sibling gpu_bench_delta)
"""

import sys

import numpy as np
from numba import cuda

from cuda_kernels import elementwise, flash, gdn, gdn_chunk, gdn_inputs, gemm, norms
from gpu_bench_delta import inputs


def recurrence():
    inp = inputs(112)
    args = [cuda.to_device(inp[name]) for name in ("q", "k", "v", "g", "beta")]
    out = cuda.device_array(inp["v"].shape, np.float32)
    for _ in range(2):
        gdn.gated_delta_rule(*args, out)


def products():
    blas = gemm.blas()
    rng = np.random.default_rng(0)
    for k in (4096, 12288):
        x = cuda.to_device(rng.integers(0x3c00, 0x3f00, (100, k)).astype(np.uint16))
        w = cuda.to_device(rng.integers(0x3c00, 0x3f00, (4096, k)).astype(np.uint16))
        y = cuda.device_array((100, 4096), np.float32)
        for _ in range(2):
            blas.linear(x, w, y, accumulate=True)


def attention(n=1000, heads=16, kv_heads=4, d=256):
    rng = np.random.default_rng(0)
    q, k, v = (cuda.to_device(rng.standard_normal((n, h, d)).astype(np.float32))
               for h in (heads, kv_heads, kv_heads))
    out = cuda.device_array((n, heads, d), np.float32)
    work = {name: cuda.device_array(shape, np.uint32)
            for name, shape in flash.workspace_shapes(n, heads, kv_heads, d).items()}
    for _ in range(2):
        flash.flash_attention(q, k, v, out, d ** -0.5, True, work=work)


def chunked():
    inp = inputs(1000)
    args = [cuda.to_device(inp[name]) for name in ("q", "k", "v", "g", "beta")]
    out = cuda.device_array(inp["v"].shape, np.float32)
    n, _, dk = inp["q"].shape
    work = {name: cuda.device_array(shape, np.float32)
            for name, shape in gdn_chunk.workspace_shapes(n, inp["v"].shape[1], dk, inp["v"].shape[2]).items()}
    for _ in range(2):
        gdn_chunk.gated_delta_rule_chunked(*args, out, work)


def rows():
    rng = np.random.default_rng(0)
    wanted = ("gdn_inputs", "swiglu_bf16_in_out", "rms_norm_bf16_out", "gated_rms_norm_bf16_out")
    for case in gdn_inputs.CASES + elementwise.CASES + norms.CASES:
        if case.name in wanted:
            inp = case.make(rng, "real")
            for _ in range(2):
                case.run(inp, False)


def decoder(c=96, size=1024):
    from cuda_kernels import conv
    rng = np.random.default_rng(0)
    x = cuda.to_device(rng.standard_normal((c, size, size), dtype=np.float32))
    w, b = cuda.to_device(np.ones(c, np.float32)), cuda.to_device(np.zeros(c, np.float32))
    partial = cuda.device_array((2, 32, conv.GN_PARTS), np.float32)
    conv.group_stats(x, 32, 1e-6, partial)
    peak = cuda.device_array(1, np.float32)
    conv.absmax(x, peak)
    rows, span = min(size, conv.tap_rows(c, c, size)), size + 2
    r0 = min(100, size - rows)          # the chunk's first output row
    image = cuda.device_array((conv.image_rows(rows, 3) * span, 3 * conv.tap_part(c)), np.uint16)
    for norm in (None, (partial[0], w, b)):
        conv.split_image(x, peak, image, r0 - 1, norm=norm, triple=True)
    d = cuda.device_array((rows * span - 2, c), np.float32)
    d[:] = 1.0
    out = cuda.device_array((c, size * size), np.float32)
    conv.finish(d, peak, peak, b, out, r0 * size, channels=True, residual=out, span=span)


GROUPS = {"recurrence": recurrence, "products": products, "flash": attention, "chunked": chunked, "rows": rows,
          "decoder": decoder}


def main(names):
    for name in names or ("recurrence", "products"):
        GROUPS[name]()
    cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main(sys.argv[1:])
