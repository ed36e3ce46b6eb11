"""On a GPU: compiled kernels are kept on disk between processes (cuda_kernels.core._cache_dir).

A second process loads the SiTU kernel and the flash attention kernels (made by a factory, closed over device
functions) from the cache (cache hits, no miss) and computes the same bytes as the first, which compiled
them; MOSS_KERNEL_CACHE=0 compiles again and writes nothing.
"""

import json
import os
import subprocess
import sys

import pytest

import cuda_kernels

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")

PROBE = """
import hashlib, json
import numpy as np
from numba import cuda
from cuda_kernels import core, dit
rng = np.random.default_rng(0)
h = core.to_bf16_bits(rng.standard_normal((64, 256)).astype(np.float32))
g = core.to_bf16_bits(rng.standard_normal((64, 256)).astype(np.float32))
out = cuda.device_array((64, 256), np.uint16)
dit.situ(cuda.to_device(h), cuda.to_device(g), out)
from cuda_kernels import flash
q = cuda.to_device(rng.standard_normal((40, 2, 64)).astype(np.float32))
att = cuda.device_array((40, 2, 64), np.float32)
flash.flash_attention(q, q, q, att, 0.125, True)
made = [dit._situ(False), dit._situ_packed(False), flash.kernel(64, True, False)[0], flash.prep_kernel(64)]
kernels = [k for k in made if k.stats.cache_hits or k.stats.cache_misses]
sha = hashlib.sha256(out.copy_to_host().tobytes() + att.copy_to_host().tobytes()).hexdigest()
print(json.dumps({"sha": sha, "dir": core.CACHE_DIR, "kernels": len(kernels),
                  "hits": sum(sum(k.stats.cache_hits.values()) for k in kernels),
                  "misses": sum(sum(k.stats.cache_misses.values()) for k in kernels)}))
"""


def _probe(env):
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_kernel_from_the_cache(tmp_path):
    # no prebuilt files: the first process must compile (prebuilt.py's own test covers those)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), MOSS_PREBUILT_KERNELS=str(tmp_path / "none"))
    first, second = _probe(env), _probe(env)
    print(first, second)
    assert first["dir"] == str(tmp_path / "cache")
    assert first["kernels"] == 3 and first["misses"] >= 3 and first["hits"] == 0
    assert second["hits"] >= 1 and second["misses"] == 0
    assert second["sha"] == first["sha"]
    off = _probe(dict(env, MOSS_KERNEL_CACHE="0", NUMBA_CACHE_DIR=str(tmp_path / "off")))
    assert off["dir"] is None and off["sha"] == first["sha"] and not (tmp_path / "off").exists()
