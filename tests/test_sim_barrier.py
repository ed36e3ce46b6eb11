"""The simulator's thread blocks with cuda_kernels.sim_barrier's barrier give what numba's own polling scheduler
gives (MOSS_SIM_BARRIER=poll), and what the kernels must give: a shared-memory tree sum over blocks whose last
threads return after one barrier, syncthreads_count, a value written between two barriers seen by every thread,
and an exception in one thread raised by the launch with that thread's indices. Control: a barrier that lets a
thread through as soon as it arrives fails the between-barriers check."""

import json

import numpy as np
from sim_util import simulated_lines

SCRIPT = r'''
import json
import sys
import numpy as np
from numba import cuda, float32
from cuda_kernels import sim_barrier  # noqa: F401   (cuda_kernels installs it unless MOSS_SIM_BARRIER=poll)
import cuda_kernels.core  # noqa: F401

if sys.argv[1:] == ["early"]:          # the control: a barrier that lets each arriving thread through
    def release_early(block):
        if block._arrived:
            block._arrived = 0
            block._generation += 1
            block._released.notify_all()
    sim_barrier._release_if_all_waiting = release_early
    sim_barrier.install()


@cuda.jit
def tree_sum(x, sums, counts):
    s = cuda.shared.array(64, float32)
    i = cuda.threadIdx.x
    s[i] = x[cuda.blockIdx.x * 64 + i]
    cuda.syncthreads()
    if i >= 48:                          # these threads leave: the barriers below wait for the others only
        return
    if i < 16:
        s[i] += s[i + 48]
    cuda.syncthreads()
    step = 16
    while step > 0:
        if i < step:
            s[i] += s[i + step] + s[i + 32] * float32(step == 16)
        cuda.syncthreads()
        step //= 2
    n = cuda.syncthreads_count(x[cuda.blockIdx.x * 64 + i] > float32(0))
    if i == 0:
        sums[cuda.blockIdx.x] = s[0]
        counts[cuda.blockIdx.x] = n


@cuda.jit
def between(flags):
    s = cuda.shared.array(1, float32)
    i = cuda.threadIdx.x
    if i == 0:
        s[0] = 0
    cuda.syncthreads()
    if i == 63:
        s[0] = 1
    cuda.syncthreads()
    flags[cuda.blockIdx.x * 64 + i] = s[0]


@cuda.jit
def fails(x):
    if cuda.threadIdx.x == 3 and cuda.blockIdx.x == 1:
        x[10 ** 6] = 1.0
    cuda.syncthreads()


x = np.random.default_rng(0).integers(-8, 9, 3 * 64).astype(np.float32)
sums, counts, flags = np.zeros(3, np.float32), np.zeros(3, np.int32), np.zeros(2 * 64, np.float32)
tree_sum[3, 64](x, sums, counts)
between[2, 64](flags)
try:
    fails[2, 8](np.zeros(4, np.float32))
    error = None
except IndexError as e:
    error = str(e)
print(json.dumps({"sums": sums.tolist(), "counts": counts.tolist(), "flags": flags.tolist(), "error": error}))
'''


def _run(*args, poll=False):
    return json.loads(simulated_lines(SCRIPT, args=args, env={"MOSS_SIM_BARRIER": "poll"} if poll else None)[-1])


def test_the_barrier_gives_what_numbas_scheduler_and_the_kernels_give():
    x = np.random.default_rng(0).integers(-8, 9, 3 * 64).astype(np.float32).reshape(3, 64)
    # every value once: the tree adds 48-63 into 0-15, then 32-47 with the first halving step
    want = {"sums": x.sum(axis=1).tolist(), "counts": (x[:, :48] > 0).sum(axis=1).tolist(),
            "flags": [1.0] * 128}
    ours, numbas = _run(), _run(poll=True)
    for got in (ours, numbas):
        assert {k: got[k] for k in want} == want
        assert got["error"].startswith("tid=[3, 0, 0] ctaid=[1, 0, 0]")
    assert ours == numbas
    early = _run("early")            # control: threads let through at once read the flag before it is written
    assert early["flags"] != want["flags"]
