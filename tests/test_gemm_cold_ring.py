"""The tuner's cold ring (gemm.cold_ring): copies of the weight that together pass the byte total, each
equal to the weight and held in its own buffer, so timing over them in turn reads the weight from memory
each call. Run in the numba CUDA simulator in its own process (the ring is plain device arrays)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

SCRIPT = """
import numpy as np
from numba import cuda
from cuda_kernels.gemm import cold_ring
w = np.random.default_rng(0).integers(0, 1 << 16, (6, 10)).astype(np.uint16)
for total in (1, 600):                     # below one weight (still two arrays), and 5 weights' bytes
    dw = cuda.to_device(w)
    ring = cold_ring(dw, total=total)
    assert ring[0] is dw
    assert len(ring) == max(2, -(-total // w.nbytes)), (total, len(ring))
    assert all(np.array_equal(r.copy_to_host(), w) for r in ring)
    ring[1].copy_to_device(np.zeros_like(w))   # separate buffers: one changed, the others not
    assert np.array_equal(ring[0].copy_to_host(), w) and not ring[1].copy_to_host().any()
print("ok")
"""


def test_cold_ring_copies_the_weight_past_the_total():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
