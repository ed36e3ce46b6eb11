"""The kernel contract in the numba CUDA simulator: every simulator-capable kernel passes its gate
against its float64 reference and every planted control is caught."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")


def _python(code_or_args, sim=True, timeout=300):
    env = dict(os.environ)
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"   # must be set before numba.cuda is imported: a fresh process
    else:
        env.pop("NUMBA_ENABLE_CUDASIM", None)
    return subprocess.run([sys.executable, *code_or_args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_every_simulator_kernel_passes_its_gate_and_every_control_is_caught():
    # 84 s in a CI run on 2 cores; with numba's polling scheduler (MOSS_SIM_BARRIER=poll) up to 428 s
    done = _python(["-m", "cuda_kernels.contract", "--size", "tiny"], timeout=1500)
    print(done.stdout)
    summary = re.search(r"(\d+) kernels, (\d+) pass; (\d+) controls, (\d+) caught", done.stdout)
    assert summary, done.stdout + done.stderr
    kernels, passed, controls, caught = map(int, summary.groups())
    assert kernels >= 19
    assert (passed, controls, caught) == (kernels, kernels, kernels), done.stdout
    assert done.returncode == 0
    # a gate set from a measurement stays near it: the error now is at least a quarter of the one recorded
    # (the gate at 4x of it), so a kernel that became more accurate gets its record (contract.MEASURED) mended
    tight = re.findall(r"^(\S+) +gate pass \(worst \|err\|/bound ([\d.e+-]+), gate at ([\d.e+-]+) of the bound",
                       done.stdout, re.M)
    assert len(tight) >= 8, done.stdout
    for name, worst, at in tight:
        assert float(worst) >= float(at) / 16, (name, worst, at)


def test_moss_cli_imports_without_numba_cuda_and_reports_why_no_gpu():
    code = ("import sys, moss_cli, moss_cli.ops, cuda_kernels; "
            "assert not any(m.startswith('numba.cuda') for m in sys.modules), 'numba.cuda imported'; "
            "ok, why = cuda_kernels.available(); print(ok); print(why)")
    done = _python(["-c", code], sim=False)
    assert done.returncode == 0, done.stderr
    ok, why = done.stdout.splitlines()[:2]
    assert ok in ("True", "False") and (ok == "True" or len(why) > 10), done.stdout


COPY16 = """
import numpy as np
from numba import cuda, float32
from cuda_kernels.mma import copy16, copy_commit, copy_wait, copy_wait_prior

@cuda.jit
def stage(src, dst, di, si, live):
    sh = cuda.shared.array(0, float32)
    for i in range(8):
        sh[i] = float32(-1.0)
    copy16(sh, di, src, si, live)
    copy_commit()
    copy_wait_prior()
    copy_wait()
    for i in range(8):
        dst[i] = sh[i]

src = np.arange(12, dtype=np.float32)
for di, si, live in ((4, 8, True), (0, 4, False)):
    dst = np.zeros(8, np.float32)
    stage[1, 1, 0, 32](src, dst, di, si, live)
    print(dst.tolist())
try:
    stage[1, 1, 0, 32](src, np.zeros(8, np.float32), 2, 4, True)
except ValueError as exc:
    print("refused:", exc)
"""


def test_simulated_async_copy_moves_16_bytes_zero_fills_and_refuses_misaligned_offsets():
    """The simulator's statement of cp.async (what CI's walk runs on): four floats land at the shared
    offset, zeros when the source is not live, and an offset that is not a whole 16-byte word is refused,
    as the instruction would fault."""
    done = _python(["-c", COPY16])
    lines = done.stdout.splitlines()
    assert lines[0] == str([-1.0] * 4 + [8.0, 9.0, 10.0, 11.0]), done.stdout + done.stderr
    assert lines[1] == str([0.0] * 4 + [-1.0] * 4), done.stdout + done.stderr
    assert lines[2].startswith("refused:") and "copy16 from 4 to 2" in lines[2], done.stdout + done.stderr
