"""On a GPU: compiled kernels are kept on disk between processes (cuda_kernels.core._cache_dir).

A second process loads the SiTU kernel from the cache (a cache hit, no miss) and computes the same bytes as
the first, which compiled it; MOSS_KERNEL_CACHE=0 compiles again and writes nothing.
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
kernels = [k for k in (dit._situ(False), dit._situ_packed(False)) if k.stats.cache_hits or k.stats.cache_misses]
print(json.dumps({"sha": hashlib.sha256(out.copy_to_host().tobytes()).hexdigest(), "dir": core.CACHE_DIR,
                  "hits": sum(sum(k.stats.cache_hits.values()) for k in kernels),
                  "misses": sum(sum(k.stats.cache_misses.values()) for k in kernels)}))
"""


def _probe(env):
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_kernel_from_the_cache(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    first, second = _probe(env), _probe(env)
    print(first, second)
    assert first["dir"] == str(tmp_path / "cache")
    assert first["misses"] >= 1 and first["hits"] == 0
    assert second["hits"] >= 1 and second["misses"] == 0
    assert second["sha"] == first["sha"]
    off = _probe(dict(env, MOSS_KERNEL_CACHE="0", NUMBA_CACHE_DIR=str(tmp_path / "off")))
    assert off["dir"] is None and off["sha"] == first["sha"] and not (tmp_path / "off").exists()
