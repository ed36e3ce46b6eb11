"""Both delta-rule kernels with the launch geometry they get on a GPU (not the simulator's small one),
run in the numba CUDA simulator against the float64 recurrence: the recurrence with the GPU's default
geometry (256-thread blocks, 16-token tiles, token by token; 21 tokens at dk = 16 and 37 at dk = 8: a whole
tile, then a part tile; each simulated thread-step costs ~0.2 ms, so no more tokens than that) fitted to dk = 16
and to the tiny checkpoint's dk = 8, the recurrence in groups of 4 tokens, with two state columns a thread,
and the chunked form with 64-token chunks, 16-row solve blocks, with dk = 8 (70 tokens: a whole chunk and a
part one), the setup's 256 threads and the walk's 32 columns on 256 threads (the tiny checkpoint's key dim,
half the GPU default's threads: the simulator's mma statement takes at most 256). In the simulator a kernel
reads its module's constants when it runs, so setting them selects the geometry."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

INPUTS = """
import numpy as np
from cuda_kernels.core import gate
rng = np.random.default_rng(3)
n, hk, hv, dk, dv = {n}, 1, 2, {dk}, 16
def unit(a): return a / np.linalg.norm(a, axis=-1, keepdims=True)
inp = {{"q": (unit(rng.standard_normal((n, hk, dk))) * dk ** -0.5).astype(np.float32),
        "k": unit(rng.standard_normal((n, hk, dk))).astype(np.float32),
        "v": rng.standard_normal((n, hv, dv)).astype(np.float32),
        "g": -rng.uniform(0.0, 1.5, (n, hv)).astype(np.float32),
        "beta": rng.uniform(0.0, 1.0, (n, hv)).astype(np.float32)}}
"""

RECURRENT = """
from numba import cuda
from cuda_kernels import gdn
def run(control):
    arrays = [cuda.to_device(inp[name]) for name in ("q", "k", "v", "g", "beta")]
    out = cuda.device_array(inp["v"].shape, np.float32)
    gdn.gated_delta_rule(*arrays, out, control=control, geometry={geometry})
    return out.copy_to_host()
expected, bound = gdn._ref_delta(inp)
plain, control = gate(run(False), expected, bound), gate(run(True), expected, bound)
print(plain[0], control[0], plain[1], control[1])
"""

CHUNKED = """
from cuda_kernels import gdn_chunk as gc, gdn_setup as gs
gs.CHUNK, gs.SUB, gs.THREADS, gs.STRIP = 64, 16, 256, 4
gc.CHUNK, gc.WALK, gc.DK_MAX = gs.CHUNK, (32, 256), 32       # gdn_chunk's CHUNK is gdn_setup's
gc._walk.clear(); gs._setup.clear()
expected, bound = gc._ref_chunked(inp)
plain = gate(gc._run(inp, False), expected, bound)
control = gate(gc._run(inp, True), expected, bound)
print(plain[0], control[0], plain[1], control[1])
"""


SCRIPTS = {
    # the GPU's default (8, 256, 16, 1), fitted to dk = 16: 4 parts, 64 columns a block
    "recurrence": INPUTS.format(n=21, dk=16) + RECURRENT.format(geometry=(8, 256, 16, 1)),
    # the tiny checkpoint's dk = 8 (2 parts, 32-token tiles): what `moss-encode --device cuda` runs on it
    "recurrence dk 8": INPUTS.format(n=37, dk=8) + RECURRENT.format(geometry=(8, 256, 16, 1)),
    # groups of 4 tokens (the group algebra at a GPU geometry; the simulator's default groups 2); 21 tokens:
    # a whole tile of 4 groups, then a part tile with a whole group and a part one
    "grouped recurrence": INPUTS.format(n=21, dk=16) + RECURRENT.format(geometry=(4, 128, 16, 4)),
    # two state columns a thread at a GPU geometry (128 threads; 21 tokens: a tile and a part one); the
    # contract's simulator geometry runs two columns in groups of 2
    "recurrence 2 columns": INPUTS.format(n=21, dk=16) + RECURRENT.format(geometry=(8, 128, 16, 1, 2)),
    # the tiny checkpoint's dk = 8 (zero-padded to a 16-row tile in the walk), 32 walk columns over dv = 16;
    # the setup at its GPU geometry, 256 threads and strips of 4 n tiles; the walk (the GPU default's
    # columns, half its threads): step (1)'s k halves, step (2)'s dummy warps
    "chunked dk 8": INPUTS.format(n=70, dk=8) + CHUNKED,
}


def simulate(script):
    """The words a script prints, run in its own process in the numba CUDA simulator, and what it printed
    (stdout and stderr, for a failed comparison's message)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    printed = f"stdout: {done.stdout}\nstderr: {done.stderr[-3000:]}"
    assert done.returncode == 0, printed
    return done.stdout.split(), printed


@pytest.mark.parametrize("script", list(SCRIPTS.values()), ids=list(SCRIPTS))
def test_gpu_geometry_passes_its_gate_and_catches_its_control(script):
    # the gate's and the control's verdicts, then their worst |err| / bound (in the message if it fails: the
    # chunked form failed this once and did not again in 18 reruns)
    words, printed = simulate(script)
    assert words[:2] == ["True", "False"], printed


TIMED = INPUTS.format(n=13, dk=8) + """
from numba import cuda
from cuda_kernels import gdn
arrays = [cuda.to_device(inp[name]) for name in ("q", "k", "v", "g", "beta")]
outs = []
stamps = cuda.to_device(np.full((2, gdn.STAMPS), -1, np.int64))
for timed in (None, stamps):
    out = cuda.device_array(inp["v"].shape, np.float32)
    gdn.gated_delta_rule(*arrays, out, stamps=timed)
    outs.append(out.copy_to_host())
expected, bound = gdn._ref_delta(inp)
# the simulator has no cycle counter (clock() is 0): thread 0 of each of the 2 blocks writes zeros
print(outs[0].tobytes() == outs[1].tobytes(), gate(outs[1], expected, bound)[0],
      (stamps.copy_to_host() == 0).all())
"""


def test_timed_recurrence_writes_its_stamps_and_the_same_outputs():
    """The bench's timed recurrence (%clock64 stamps per block, gdn.STAMPS) at the simulator's geometry:
    the same output bytes as the untimed kernel, within the gate, and every block's stamps written."""
    words, printed = simulate(TIMED)
    assert words == ["True", "True", "True"], printed
