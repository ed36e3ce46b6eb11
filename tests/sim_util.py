"""Running a script in the numba CUDA simulator, in a process of its own (a simulated kernel must not share
a process with the real driver)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def simulated_lines(script, timeout=600, args=(), env=None):
    """The stdout lines of `python -c script ARGS` run from the repository root with NUMBA_ENABLE_CUDASIM=1 (and
    ENV's variables); a failing run fails the caller with the end of its stderr."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", **(env or {}))
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()
