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


def cuda_ops_weights(rng):
    """Weights as a checkpoint holds them, for CudaOps.param / params in the uploaders' simulator scripts (which
    put tests/ on sys.path): bf16 and float32, 1-D to 3-D."""
    import ml_dtypes
    import numpy as np
    return {"w2": rng.standard_normal((40, 33)).astype(ml_dtypes.bfloat16),
            "f2": rng.standard_normal((8, 16)).astype(np.float32),
            "b1": rng.standard_normal(33).astype(ml_dtypes.bfloat16),
            "f3": rng.standard_normal((2, 3, 4)).astype(np.float32),
            "q": rng.standard_normal((70, 33)).astype(ml_dtypes.bfloat16),
            "k": rng.standard_normal((9, 33)).astype(np.float32)}


def cuda_ops_expected(stored):
    """What CudaOps puts on the device for cuda_ops_weights: 2-D weights as bf16 bits, the rest float32, and
    "stack": params(["q", "w2", "k"]) by rows."""
    import numpy as np
    from cuda_kernels.core import from_bf16_bits, to_bf16_bits
    return {"w2": stored["w2"].view(np.uint16), "f2": to_bf16_bits(stored["f2"]),
            "b1": from_bf16_bits(stored["b1"].view(np.uint16)).astype(np.float32), "f3": stored["f3"],
            "stack": np.concatenate([stored["q"].view(np.uint16), stored["w2"].view(np.uint16),
                                     to_bf16_bits(stored["k"])])}


def toolchain_present():
    """Whether numba-cuda's cu13 extra (NVVM, NVRTC, nvJitLink) loads: kernels then compile without a GPU."""
    try:
        from cuda import pathfinder
        for lib in ("nvvm", "nvrtc", "nvJitLink"):
            pathfinder.load_nvidia_dynamic_lib(lib)
        return True
    except Exception:
        return False


# a script's lines that count the kernels numba compiles in its process (into `compiled`, by qualified name);
# the script imports numba.cuda's dispatcher first
COUNT_COMPILES = """compiled = []
real_init = dispatcher._Kernel.__init__
def counting_init(self, *a, **k):
    compiled.append(a[0].__qualname__)
    real_init(self, *a, **k)
dispatcher._Kernel.__init__ = counting_init
"""
