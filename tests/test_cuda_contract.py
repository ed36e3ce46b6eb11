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


def _python(code_or_args, sim=True):
    env = dict(os.environ)
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"   # must be set before numba.cuda is imported: a fresh process
    else:
        env.pop("NUMBA_ENABLE_CUDASIM", None)
    return subprocess.run([sys.executable, *code_or_args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_every_simulator_kernel_passes_its_gate_and_every_control_is_caught():
    done = _python(["-m", "cuda_kernels.contract", "--size", "tiny"])
    print(done.stdout)
    summary = re.search(r"(\d+) kernels, (\d+) pass; (\d+) controls, (\d+) caught", done.stdout)
    assert summary, done.stdout + done.stderr
    kernels, passed, controls, caught = map(int, summary.groups())
    assert kernels >= 19
    assert (passed, controls, caught) == (kernels, kernels, kernels), done.stdout
    assert done.returncode == 0


def test_moss_cli_imports_without_numba_cuda_and_reports_why_no_gpu():
    code = ("import sys, moss_cli, moss_cli.ops, cuda_kernels; "
            "assert not any(m.startswith('numba.cuda') for m in sys.modules), 'numba.cuda imported'; "
            "ok, why = cuda_kernels.available(); print(ok); print(why)")
    done = _python(["-c", code], sim=False)
    assert done.returncode == 0, done.stderr
    ok, why = done.stdout.splitlines()[:2]
    assert ok in ("True", "False") and (ok == "True" or len(why) > 10), done.stdout
