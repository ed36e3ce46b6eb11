"""The committed sm_90 resource record (cuda_kernels/RESOURCES.json) is what the kernels compile to now,
no kernel spills or keeps arrays in local memory, and none computes in float64."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim_util import toolchain_present

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "cuda_kernels" / "RESOURCES.json").read_text())


def test_no_kernel_spills_or_uses_local_memory():
    for name, r in RECORD["kernels"].items():
        assert (r["spill_stores"], r["spill_loads"], r["local_bytes"], r["stack_bytes"]) == (0, 0, 0, 0), name
        assert r["registers"] <= 255 and r["shared_bytes"] <= 48 * 1024, name


def test_no_kernel_computes_in_float64():
    for name, r in RECORD["kernels"].items():
        assert r["instructions"] > 0 and r["fp64_instructions"] == 0, name


FLOAT64_BY_ACCIDENT = """
import math
from numba import float32
from numba.core import types as t
from cuda_kernels import resources

def kernel(x, out):
    m = -math.inf if {python_float} else float32(-math.inf)   # a Python float makes m float64
    for i in range(x.shape[0]):
        m = max(m, x[i])
    out[0] = math.exp(x[0] - m)

cubin, _ = resources.compile_cubin(kernel, (t.Array(t.float32, 1, "C"), t.Array(t.float32, 1, "C")))
print(resources.count_instructions(cubin, resources.nvdisasm())[1])
"""


@pytest.mark.skipif(not toolchain_present(), reason="numba-cuda's cu13 extra (NVVM, NVRTC, nvJitLink) is not installed")
@pytest.mark.parametrize("python_float", [True, False])
def test_float64_count_sees_a_python_float_in_a_kernel(python_float):
    """The planted control of the float64 check: the softmax's old bug (a Python -inf as the running max)
    must show float64 instructions; the float32 spelling none."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", FLOAT64_BY_ACCIDENT.format(python_float=python_float)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (int(done.stdout) > 0) == python_float, done.stdout


@pytest.mark.skipif(not toolchain_present(), reason="numba-cuda's cu13 extra (NVVM, NVRTC, nvJitLink) is not installed")
def test_record_is_current():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-m", "cuda_kernels.resources"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    now = json.loads(done.stdout)
    # the test extra pins this toolchain (pyproject.toml): another one is an install to mend, not a pass
    assert now["toolchain"] == RECORD["toolchain"], \
        f"record made with {RECORD['toolchain']}, this toolchain is {now['toolchain']}: install '.[test]'"
    assert now["kernels"] == RECORD["kernels"], "rerun: python -m cuda_kernels.resources --write"
