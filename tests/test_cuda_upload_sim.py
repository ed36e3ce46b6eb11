"""The pinned-staging uploader (moss_cli/memory/upload.py) in the CUDA simulator: uploaded arrays equal the
host arrays bit for bit, for arrays larger than a staging buffer, many small ones packed together, bf16,
float32, non-contiguous and stacked (`out=`) ones; and with device copies held back until an event or a
synchronize forces them (as a real asynchronous copy may be), so a staging buffer refilled too early shows.
CudaOps.param / params through it keep the 2-D bf16 rule, and CudaOps.preload hands weights to the feeder
thread without waiting while a weight taken later waits for its own copies (control: one taken without
waiting reads an unfilled array), with the interpreter's switch interval at SWITCH_S while they are in flight."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

SCRIPT = r'''
import ml_dtypes
import numpy as np
from numba import cuda

from moss_cli.memory import upload as cuda_upload
from moss_cli.memory.upload import Uploader

cuda_upload.PIECE_BYTES = 512        # so pieces of a few KB are split over the threads
rng = np.random.default_rng(0)


class LateStream:
    """Copies queued, run only when an event recorded behind them or the stream is synchronized."""
    def __init__(self):
        self.queue, self.done = [], 0

    def run(self, upto):
        while self.done < upto:
            dst, src = self.queue[self.done]
            dst.copy_to_device(src)            # reads the staging buffer now, not when queued
            self.done += 1

    def synchronize(self):
        self.run(len(self.queue))


class LateEvent:
    def __init__(self, timing=False):
        self.stream, self.mark = None, 0

    def record(self, stream):
        self.stream, self.mark = stream, len(stream.queue)

    def synchronize(self):
        self.stream.run(self.mark)

    def wait(self, stream):
        pass


class LateUploader(Uploader):
    def _start(self):
        fresh = self._staging is None
        super()._start()
        if fresh:
            self._stream = LateStream()
            self._free = [LateEvent() for _ in range(self.buffers)]

    def _copy(self, dst, stage):
        self._stream.queue.append((dst, stage))
        self.copies += 1


def arrays():
    out = []
    out.append(rng.integers(0, 1 << 16, 10_000, dtype=np.uint16).reshape(100, 100))       # 5 buffers' worth
    out.append(rng.standard_normal((37, 129)).astype(np.float32))                          # not a multiple of 256
    out.append(rng.standard_normal((64, 48)).astype(ml_dtypes.bfloat16))                   # bf16 -> its bits
    out.append(rng.standard_normal((30, 20)).astype(np.float32).T)                         # not contiguous
    out += [rng.standard_normal(int(n)).astype(np.float32) for n in rng.integers(1, 60, 300)]   # many small
    out.append(rng.integers(0, 1 << 16, 4096 // 2, dtype=np.uint16))                       # exactly one buffer
    out.append(rng.standard_normal((3, 5, 7)).astype(np.float32))
    return out


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


for cls in (Uploader, LateUploader):
    for threads in (1, 3):
        up = cls(staging_bytes=4096, buffers=2, threads=threads)
        hosts = arrays()
        devs = [up.to_device(h) for h in hosts]
        # stacked rows into one device array, the way CudaOps.params stacks weights
        parts = [rng.integers(0, 1 << 16, (r, 96), dtype=np.uint16) for r in (5, 40, 1, 17)]
        stacked = cuda.device_array((sum(p.shape[0] for p in parts), 96), np.uint16)
        row = 0
        for p in parts:
            up.to_device(p, out=stacked[row:row + p.shape[0]])
            row += p.shape[0]
        stats = up.finish()
        for h, d in zip(hosts, devs):
            want = bits(h)
            got = d.copy_to_host()
            assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape)
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
        assert np.array_equal(stacked.copy_to_host(), np.concatenate(parts))
        nbytes = sum(h.nbytes for h in hosts) + sum(p.nbytes for p in parts)
        assert stats["bytes"] == nbytes and stats["arrays"] == len(hosts) + len(parts), stats
        assert stats["copies"] >= nbytes // 4096
        # the buffers are reused after finish, and a wait-for-each call still works
        again = rng.standard_normal(3000).astype(np.float32)
        assert np.array_equal(up.to_device(again, wait=True).copy_to_host(), again)
        up.close()
        print("ok", cls.__name__, threads, stats["copies"], "copies")

# a planted control: a late copy whose buffer is refilled without waiting for its event is caught
class Careless(LateUploader):
    def _rotate(self):
        self._current = (self._current + 1) % self.buffers
        self._cursor = 0

up = Careless(staging_bytes=4096, buffers=2, threads=1)
h = rng.integers(0, 1 << 16, 10_000, dtype=np.uint16)
d = up.to_device(h)
up.finish()
assert not np.array_equal(d.copy_to_host(), h), "the late stream does not catch an early refill"
print("ok careless uploader caught")

try:
    Uploader(staging_bytes=4096).to_device(np.zeros(10, np.float32), out=cuda.device_array(9, np.float32))
except ValueError as e:
    print("ok size mismatch:", e)
else:
    raise AssertionError("a wrong-sized out was accepted")

# CudaOps through the shared uploader: 2-D as bf16 bits, the rest float32, stacks by rows
import sys
sys.path.insert(0, "tests")
from moss_cli.ops.cuda.table import CudaOps
from sim_util import cuda_ops_expected, cuda_ops_weights
cuda_upload._SHARED = Uploader(staging_bytes=4096, buffers=2, threads=2)
ops = CudaOps()
stored = cuda_ops_weights(rng)
expected = cuda_ops_expected(stored)
for name in ("w2", "f2", "b1", "f3"):
    got = ops.param(stored, name).copy_to_host()
    assert got.dtype == expected[name].dtype and np.array_equal(got, expected[name]), name
st = ops.params(stored, ["q", "w2", "k"])
want = expected["stack"]
assert st.sizes == (70, 40, 9) and np.array_equal(st.weight.copy_to_host(), want)
assert cuda_upload._SHARED.stats()["arrays"] == 7, "CudaOps did not upload through the shared uploader"
print("ok cuda ops")

# preload: the feeder holds back until released; preload returns at once, a weight taken before the release
# waits for its copies, and every taken weight holds its bytes
import threading
class HeldBack(Uploader):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.fed = threading.Event(), []

    def to_device_later(self, host, out=None):
        out, queued = super().to_device_later(host, out)
        out.copy_to_device(np.full(out.shape, 0x7FC0 if out.dtype == np.uint16 else np.nan, out.dtype))  # unfilled
        return out, queued

    def _send(self, src, dst):
        self.gate.wait()
        self.fed.append(src.size)
        super()._send(src, dst)

def preloaded(ops_class):
    import sys
    up = cuda_upload._SHARED = HeldBack(staging_bytes=4096, buffers=2, threads=2)
    ops = ops_class()
    before = sys.getswitchinterval()
    ops.preload(stored, ["f3", ("q", "w2", "k"), "w2"])
    assert up.fed == [] and len(ops._landing) == 3, "preload waited for the feeder"
    # weights in flight: the interpreter hands the GIL round at SWITCH_S; the caller's interval once landed
    assert sys.getswitchinterval() == cuda_upload.SWITCH_S != before, sys.getswitchinterval()
    threading.Timer(0.2, up.gate.set).start()
    got = ops.param(stored, "f3").copy_to_host(), ops.params(stored, ["q", "w2", "k"]).weight.copy_to_host()
    up.finish()
    assert sys.getswitchinterval() == before, "the uploader did not put the switch interval back"
    return got

f3, st = preloaded(CudaOps)
assert np.array_equal(f3, stored["f3"]) and np.array_equal(st, want), "a preloaded weight differs"
print("ok preload")
# control: an op table that takes a preloaded weight without waiting for its copies reads it unfilled
class Hasty(CudaOps):
    def _landed(self, key):
        self._landing.pop(key, None)
f3, st = preloaded(Hasty)
assert not np.array_equal(f3, stored["f3"]), "taking a weight before its copies is not caught"
print("ok hasty taker caught")
print("all uploads equal")
'''


def test_uploader_copies_bit_for_bit_in_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "all uploads equal" in done.stdout
