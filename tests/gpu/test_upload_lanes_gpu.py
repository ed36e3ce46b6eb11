"""The native upload lanes with the real driver (moss_cli/memory/lanes.py): arrays of every kind uploaded bit for
bit through lanes of small slots (many slot turns, slots shared by small arrays, stacked rows through `out=`),
a stream 0 kernel reading an array as soon as its future completes (the lanes' streams are blocking streams),
and the process-wide uploader on a GPU being the lanes."""

import ml_dtypes
import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")
if not cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from moss_cli.memory import upload as cuda_upload                     # noqa: E402
from moss_cli.memory.lanes import LaneUploader         # noqa: E402


@cuda.jit
def _plus_one(x, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = x[i] + 1.0


def test_lanes_upload_bit_for_bit_and_order_before_stream_zero():
    rng = np.random.default_rng(0)
    up = LaneUploader(lanes=3, slots=2, slot_bytes=1 << 16)
    hosts = [rng.integers(0, 1 << 16, 300_000, dtype=np.uint16).reshape(600, 500),
             rng.standard_normal((37, 129)).astype(np.float32),
             rng.standard_normal((640, 48)).astype(ml_dtypes.bfloat16),
             rng.standard_normal((300, 200)).astype(np.float32).T]
    hosts += [rng.standard_normal(int(n)).astype(np.float32) for n in rng.integers(1, 3000, 300)]
    devs = [cuda.as_cuda_array(up.to_device_later(h)[0]) for h in hosts]     # the driver's buffers, as numba's
    parts = [rng.integers(0, 1 << 16, (r, 96), dtype=np.uint16) for r in (5, 400, 1, 170)]
    stacked = cuda.device_array((sum(p.shape[0] for p in parts), 96), np.uint16)
    row = 0
    for p in parts:
        up.to_device_later(p, out=stacked[row:row + p.shape[0]])
        row += p.shape[0]
    big = rng.standard_normal(1 << 20).astype(np.float32)
    dev, queued = up.to_device_later(big)
    dev = cuda.as_cuda_array(dev)
    queued.result()                      # queued, maybe not done: a stream 0 kernel must still see every value
    out = cuda.device_array_like(dev)
    _plus_one[(big.size + 255) // 256, 256](dev, out)
    assert np.array_equal(out.copy_to_host(), big + np.float32(1.0))
    stats = up.finish()
    for h, d in zip(hosts, devs):
        want = np.ascontiguousarray(h)
        want = want.view(np.uint16) if want.dtype.name == "bfloat16" else want
        assert np.array_equal(d.copy_to_host().view(np.uint8), want.view(np.uint8))
    assert np.array_equal(stacked.copy_to_host(), np.concatenate(parts))
    assert stats["arrays"] == len(hosts) + len(parts) + 1 and stats["landed_at"] is not None
    up.close()


def test_the_process_uploader_on_a_gpu_is_the_lanes():
    assert cuda_upload.USE_LANES and isinstance(cuda_upload.uploader(), LaneUploader)
