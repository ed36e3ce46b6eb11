"""LoRA merged into a bf16 weight on the device: each adapter's scaled delta (a float32 product), their float32 sum
in the adapters' order, then W' = bf16(W + sum), rounded once to nearest even (moss_cli/lora.py's statement)."""

import numpy as np
from numba import cuda, uint16, uint32

from .core import BLOCK, EPS16, SIMULATED, Case, float32_bits, from_bf16_bits, gamma, jit, narrow, \
    to_bf16_bits, widen


def _grid(n):
    """Grid-stride launch: enough blocks to fill the GPU, few in the simulator."""
    blocks = (n + BLOCK - 1) // BLOCK
    return max(1, min(blocks, 2 if SIMULATED else 4096)), BLOCK


def _make_merge(control):
    @jit
    def merge(w, delta, total, first, last):
        start, stride = cuda.grid(1), cuda.gridsize(1)
        for i in range(start, w.size, stride):
            t = delta[i] if first else total[i] + delta[i]
            if last:
                v = widen(w[i]) + t
                w[i] = uint16(float32_bits(v) >> uint32(16)) if control else narrow(v)
            else:
                total[i] = t
    return merge


_merge = {c: _make_merge(c) for c in (False, True)}


def merge(w, delta, total, first, last, stream=0, control=False):
    """One adapter's scaled delta into weight w (bf16 bits), all flat and contiguous: the running sum starts at
    delta when `first`, else total + delta; when `last` w becomes bf16(w + sum), else the sum goes to total
    (float32, unread when first and last). control: the sum truncated to bf16."""
    grid, block = _grid(w.size)
    _merge[control][grid, block, stream](w, delta, total, first, last)


def product(up, down, out, alpha, stream=0):
    """out[M, N] (float32) = float32(alpha) * (up[M, K] @ down[K, N]), the product in float32 (cuBLAS on the
    GPU); up and down of one type: bf16 bits (uint16), float16 or float32. The simulator has no cuBLAS: there
    the product is numpy's float32 one on the host copies, as moss_cli/lora.py states it."""
    if not SIMULATED:
        from .gemm import blas
        blas().product_f32(up, down, out, alpha, stream=stream)
        return
    a, b = (_float32(x.copy_to_host()) for x in (up, down))
    delta = a @ b
    delta *= np.float32(alpha)
    out.copy_to_device(delta)


def _float32(x):
    return from_bf16_bits(x).astype(np.float32) if x.dtype == np.uint16 else np.asarray(x, np.float32)


# --- contract --------------------------------------------------------------------------------
def _make(rng, size):
    rows, cols = (6, 40) if size == "tiny" else (3072, 3072)
    w = to_bf16_bits(rng.standard_normal((rows, cols)) * 0.02)
    deltas = [(rng.standard_normal((rows, cols)) * s).astype(np.float32) for s in (0.01, 0.003)]
    return {"w": w, "deltas": deltas}


def _run(inp, control):
    w = cuda.to_device(inp["w"].ravel())
    total = cuda.device_array(w.size, np.float32)
    count = len(inp["deltas"])
    for j, d in enumerate(inp["deltas"]):
        merge(w, cuda.to_device(d.ravel()), total, j == 0, j == count - 1, control=control)
    return from_bf16_bits(w.copy_to_host()).reshape(inp["w"].shape)


def _ref(inp):
    terms = [from_bf16_bits(inp["w"])] + [d.astype(np.float64) for d in inp["deltas"]]
    ref = sum(terms)
    # the float32 sums (one per delta after the first, one with w), then half a bf16 ulp of the result
    size = gamma(len(terms) - 1) * sum(np.abs(t) for t in terms)
    return ref, size + EPS16 * (np.abs(ref) + size) + 1e-30


CASES = [
    Case("lora_merge", _make, _run, _ref, notes="two adapters' deltas summed into a bf16 weight; control: the "
                                                "sum truncated to bf16 instead of rounded to nearest even"),
]
