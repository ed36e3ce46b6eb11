"""Flash attention (cuda_kernels.flash) in the numba CUDA simulator: within its derived gate of the float64
reference on the edge shapes (L = 1, L past a key block, causal or not, H = Hkv and H = 4 Hkv, strided k and
v, a head dim padded to the split's multiple), and exact where exactness is owed (a reused workspace too)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

SCRIPT = r'''
import numpy as np
from numba import cuda
from cuda_kernels import flash
from cuda_kernels.core import from_bf16_bits, gate, heads_view, to_bf16_bits

rng = np.random.default_rng(1)


def run(q, k, v, causal, scale=0.25, work=None):
    """k and v as column blocks of one [L, 2 Hkv d] matrix, q contiguous."""
    n, hk, d = k.shape
    kv = cuda.to_device(np.concatenate([k.reshape(n, -1), v.reshape(n, -1)], axis=1))
    out = cuda.device_array(q.shape, np.float32)
    flash.flash_attention(cuda.to_device(q), heads_view(kv, 0, hk, d), heads_view(kv, hk * d, hk, d), out, scale,
                          causal, work=work)
    return out.copy_to_host()


def case(name, n, hq, hk, d, causal):
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for h in (hq, hk, hk))
    got = run(q, k, v, causal)
    ref, x, p = flash.flash_reference(q, k, v, 0.25, causal)
    ok, worst = gate(got, ref, flash.flash_bound(q, k, v, 0.25, causal, x, p, flash.geometry(d)[2]))
    print(name, "pass" if ok else "FAIL", f"{worst:.3f}")


case("L=1 causal H=2Hkv d=16", 1, 2, 1, 16, True)
case("L=19 full H=Hkv d=16", 19, 2, 2, 16, False)
case("L=17 causal H=4Hkv d=32", 17, 4, 1, 32, True)
case("L=5 full H=2Hkv d=48", 5, 2, 1, 48, False)

flash.BM, flash._kernels = 32, {}     # two warps along the rows (the GPU has four), each pair split over d
case("BM=32 L=40 causal H=2Hkv d=32", 40, 2, 1, 32, True)
flash.BM, flash._kernels = 16, {}

# one token attends to itself alone: its value, rounded to bf16, exactly
v = rng.standard_normal((1, 1, 16)).astype(np.float32)
got = run(rng.standard_normal((1, 2, 16)).astype(np.float32), rng.standard_normal((1, 1, 16)).astype(np.float32), v,
          True)
print("self", bool(np.array_equal(got, np.repeat(from_bf16_bits(to_bf16_bits(v)), 2, axis=1))))

# masked keys contribute nothing: rows 0..7 keep their bits when keys and values 8.. change
q, k, v = (rng.standard_normal((20, 2, 16)).astype(np.float32) for _ in range(3))
a = run(q, k, v, True)
k[8:], v[8:] = 1e4, -1e4
b = run(q, k, v, True)
print("masked", bool(np.array_equal(a[:8], b[:8])), bool(np.abs(a[8:] - b[8:]).max() > 1))

# a reused workspace (pool memory, here all bf16 NaN pairs): the pre-pass writes every word the kernel reads,
# the padding rows included, so the result keeps its bits
dirty = {name: cuda.to_device(np.full(shape, 0xFFFFFFFF, np.uint32))
         for name, shape in flash.workspace_shapes(20, 2, 2, 16).items()}
print("dirty workspace", bool(np.array_equal(run(q, k, v, True, work=dirty), b)))
'''


def test_flash_attention_edge_shapes_pass_the_gate_and_masked_keys_add_nothing():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    for name in ("L=1 causal H=2Hkv d=16", "L=19 full H=Hkv d=16", "L=17 causal H=4Hkv d=32", "L=5 full H=2Hkv d=48",
                 "BM=32 L=40 causal H=2Hkv d=32"):
        assert f"{name} pass" in done.stdout, done.stdout
    assert "self True" in done.stdout, done.stdout
    assert "masked True True" in done.stdout, done.stdout
    assert "dirty workspace True" in done.stdout, done.stdout
