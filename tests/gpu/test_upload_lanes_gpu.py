"""The native upload lanes with the real driver (moss_cli/ops/cuda_lanes.py): arrays of every kind uploaded bit for
bit through lanes of small slots (many slot turns, slots shared by small arrays, stacked rows through `out=`),
a stream 0 kernel reading an array as soon as its future completes (the lanes' streams are blocking streams),
the process-wide uploader on a GPU being the lanes, and (the DIRECT option) a mapped file's views copied straight
from its registered map."""

import ml_dtypes
import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")
if not cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from moss_cli.ops import cuda_upload                     # noqa: E402
from moss_cli.ops.cuda_lanes import LaneUploader         # noqa: E402


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
    devs = [up.to_device_later(h)[0] for h in hosts]
    parts = [rng.integers(0, 1 << 16, (r, 96), dtype=np.uint16) for r in (5, 400, 1, 170)]
    stacked = cuda.device_array((sum(p.shape[0] for p in parts), 96), np.uint16)
    row = 0
    for p in parts:
        up.to_device_later(p, out=stacked[row:row + p.shape[0]])
        row += p.shape[0]
    big = rng.standard_normal(1 << 20).astype(np.float32)
    dev, queued = up.to_device_later(big)
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


def test_mapped_arrays_copied_straight_from_their_registered_map(tmp_path):
    """A file's map registered with the real driver (read-only, in chunks): its views land bit for bit, the
    copies read the map itself, and finish hands every chunk back."""
    import mmap
    from moss_cli.ops import cuda_lanes
    rng = np.random.default_rng(2)
    path = tmp_path / "weights.bin"
    path.write_bytes(rng.integers(0, 256, 6 << 20, dtype=np.uint8).tobytes())
    with open(path, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    whole = np.frombuffer(view, np.uint8)
    hosts = [whole[8:(2 << 20) + 8].view(np.uint16), whole[(2 << 20) + 100:(5 << 20) + 3], whole[5 << 20:]]
    old = cuda_lanes.REG_BYTES
    cuda_lanes.REG_BYTES = 1 << 20
    try:
        up = LaneUploader(lanes=2, slots=2, slot_bytes=1 << 18, direct=True)
        up._start()
        with up._lock:
            up._map_chunk(hosts[0])
        up.wait_registered()
        devs = [up.to_device_later(h)[0] for h in hosts]
        stats = up.finish()
        up.close()
    finally:
        cuda_lanes.REG_BYTES = old
    assert stats["register_failures"] == 0, stats
    assert stats["direct_bytes"] == sum(h.nbytes for h in hosts), stats
    for h, d in zip(hosts, devs):
        assert np.array_equal(d.copy_to_host(), h)
