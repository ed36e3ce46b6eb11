"""The committed sm_90 resource record (cuda_kernels/RESOURCES.json) is what the kernels compile to now,
and no kernel spills or keeps arrays in local memory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "cuda_kernels" / "RESOURCES.json").read_text())


def _toolchain_present():
    try:
        from cuda import pathfinder
        for lib in ("nvvm", "nvrtc", "nvJitLink"):
            pathfinder.load_nvidia_dynamic_lib(lib)
        return True
    except Exception:
        return False


def test_no_kernel_spills_or_uses_local_memory():
    for name, r in RECORD["kernels"].items():
        assert (r["spill_stores"], r["spill_loads"], r["local_bytes"], r["stack_bytes"]) == (0, 0, 0, 0), name
        assert r["registers"] <= 255 and r["shared_bytes"] <= 48 * 1024, name


@pytest.mark.skipif(not _toolchain_present(), reason="numba-cuda's cu13 extra (NVVM, NVRTC, nvJitLink) is not installed")
def test_record_is_current():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-m", "cuda_kernels.resources"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    now = json.loads(done.stdout)
    if now["toolchain"] != RECORD["toolchain"]:
        pytest.skip(f"record made with {RECORD['toolchain']}, this toolchain is {now['toolchain']}")
    assert now["kernels"] == RECORD["kernels"], "rerun: python -m cuda_kernels.resources --write"
