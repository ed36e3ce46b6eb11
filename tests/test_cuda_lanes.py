"""The native upload lanes (moss_cli/memory/lanes.py) on the CPU: the compiled loop `run_lane` runs as on the GPU,
with a fake driver whose "device" is host memory and whose copies run only when an event recorded behind them is
waited for or their stream synchronized (as an asynchronous copy may). Uploaded arrays equal the host arrays bit
for bit (larger than a slot, exactly a slot, many small ones sharing slots, bf16, non-contiguous, stacked rows
through `out=`); a future completes only once its copies are queued, a failed driver call raises in the caller, a
woken lane gathers pieces and a waiting caller cuts that short; every copy to the device reads a staging slot.
Control: a loop that refills a slot without waiting for its event is caught."""

import threading

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("numba", reason="numba is not installed")
from moss_cli.memory import lanes as cuda_lanes                      # noqa: E402
from moss_cli.memory.lanes import LaneUploader         # noqa: E402
from fake_driver import FakeDriver                       # noqa: E402


def arrays(rng):
    out = [rng.integers(0, 1 << 16, 10_000, dtype=np.uint16).reshape(100, 100),          # 5 slots' worth
           rng.standard_normal((37, 129)).astype(np.float32),                             # not a multiple of 256
           rng.standard_normal((64, 48)).astype(ml_dtypes.bfloat16),                      # bf16 -> its bits
           rng.standard_normal((30, 20)).astype(np.float32).T,                            # not contiguous
           rng.integers(0, 1 << 16, 4096 // 2, dtype=np.uint16)]                          # exactly one slot
    out += [rng.standard_normal(int(n)).astype(np.float32) for n in rng.integers(1, 60, 200)]   # many small
    return out


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def upload_all(driver, lanes=3, slots=2):
    rng = np.random.default_rng(0)
    up = LaneUploader(lanes=lanes, slots=slots, slot_bytes=4096, driver=driver)
    hosts = arrays(rng)
    devs = [up.to_device_later(h)[0] for h in hosts]
    parts = [rng.integers(0, 1 << 16, (r, 96), dtype=np.uint16) for r in (5, 40, 1, 17)]
    stacked = driver.empty((sum(p.shape[0] for p in parts), 96), np.uint16)
    row = 0
    for p in parts:                     # stacked rows into one array, the way CudaOps.params stacks weights
        up.to_device_later(p, out=stacked[row:row + p.shape[0]])
        row += p.shape[0]
    stats = up.finish()
    up.close()
    same = all(np.array_equal(d.view(np.uint8), bits(h).view(np.uint8)) for h, d in zip(hosts, devs))
    return same and np.array_equal(stacked, np.concatenate(parts)), stats, hosts, parts


@pytest.mark.parametrize("lanes,slots", [(1, 2), (3, 2), (2, 3)])
def test_lanes_upload_every_byte(lanes, slots):
    driver = FakeDriver()
    same, stats, hosts, parts = upload_all(driver, lanes, slots)
    assert same and not driver.stray_reads
    nbytes = sum(h.nbytes for h in hosts) + sum(p.nbytes for p in parts)
    assert stats["bytes"] == nbytes and stats["arrays"] == len(hosts) + len(parts), stats
    assert stats["copies"] >= nbytes // 4096 and stats["landed_at"] is not None


def test_control_a_slot_refilled_before_its_copies_ran_is_caught():
    same, _, _, _ = upload_all(FakeDriver(careless=True))
    assert not same


def test_a_future_completes_only_once_its_copies_are_queued():
    gate = threading.Event()
    driver = FakeDriver(gate=gate)
    up = LaneUploader(lanes=2, slots=2, slot_bytes=4096, driver=driver)
    host = np.arange(5000, dtype=np.float32)
    dev, queued = up.to_device_later(host)             # returns while the lanes are held at their first copy
    assert not queued.done()
    with pytest.raises(TimeoutError):
        queued.result(timeout=0.05)
    gate.set()
    queued.result()
    assert queued.done() and driver.calls == -(-host.nbytes // 4096)
    up.finish()
    assert np.array_equal(dev, host)
    up.close()


def test_a_failed_driver_call_raises_in_the_waiting_caller():
    up = LaneUploader(lanes=1, slots=2, slot_bytes=4096, driver=FakeDriver(fail_at=3))
    _, queued = up.to_device_later(np.zeros(10_000, np.float32))
    with pytest.raises(RuntimeError, match="status 700"):
        queued.result()
    with pytest.raises(RuntimeError, match="status 700"):
        up.finish()


def test_a_wrong_sized_out_is_refused():
    up = LaneUploader(lanes=1, slots=2, slot_bytes=4096, driver=FakeDriver())
    with pytest.raises(ValueError, match="not a contiguous array"):
        up.to_device_later(np.zeros(10, np.float32), out=np.zeros(9, np.float32))
    up.close()


def _batches(monkeypatch):
    """Record the number of pieces in each batch a lane takes into its loop."""
    sizes, real = [], cuda_lanes.run_lane

    def counted(pieces, *args):
        sizes.append(pieces.shape[0])
        return real(pieces, *args)
    monkeypatch.setattr(cuda_lanes, "run_lane", counted)
    return sizes


def test_a_lane_gathers_pieces_while_they_are_handed_over(monkeypatch):
    """With no time limit to speak of, a woken lane takes its batch only at GATHER_PIECES, or when a caller waits
    (finish): so handing over many small arrays does not cost a GIL round trip each (a lane that took its pieces
    as soon as it was woken would mostly take one at a time)."""
    sizes = _batches(monkeypatch)
    monkeypatch.setattr(cuda_lanes, "GATHER_S", 3600.0)
    monkeypatch.setattr(cuda_lanes, "GATHER_PIECES", 4)
    up = LaneUploader(lanes=1, slots=2, slot_bytes=4096, driver=FakeDriver())
    hosts = [np.full(10, i, np.float32) for i in range(10)]
    devs = [up.to_device_later(h)[0] for h in hosts]
    up.finish()
    assert sum(sizes) == 10 and all(n >= 4 for n in sizes[:-1]) and len(sizes) <= 3, sizes
    assert all(np.array_equal(d, h) for d, h in zip(devs, hosts))
    up.close()


def test_a_waiting_caller_cuts_the_gathering_short(monkeypatch):
    """A lane gathering towards GATHER_PIECES takes what it has as soon as a caller waits for one of them."""
    sizes = _batches(monkeypatch)
    monkeypatch.setattr(cuda_lanes, "GATHER_S", 3600.0)
    monkeypatch.setattr(cuda_lanes, "GATHER_PIECES", 1000)
    up = LaneUploader(lanes=2, slots=2, slot_bytes=4096, driver=FakeDriver())
    host = np.arange(100, dtype=np.float32)
    dev, queued = up.to_device_later(host)
    queued.result(timeout=120)         # a liveness bound: without the cut the lane would wait an hour
    up.finish()
    assert np.array_equal(dev, host) and sizes == [1]
    up.close()


def test_the_lanes_time_their_waits_for_slots():
    """slot_wait_s sums the lanes' waits for a slot's copies: with each wait held 5 ms by the driver, at least
    5 ms a wait (the waits counted by the driver)."""
    class Slow(FakeDriver):
        def _wait(self, event):
            with self.lock:
                self.waits += 1
            threading.Event().wait(0.005)
            return super()._wait(event)
    driver = Slow()
    driver.waits = 0
    same, stats, _, _ = upload_all(driver, lanes=2, slots=2)
    assert same and driver.waits > 0
    assert stats["slot_wait_s"] >= 0.005 * driver.waits, (stats["slot_wait_s"], driver.waits)
