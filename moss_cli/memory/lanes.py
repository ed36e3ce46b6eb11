"""Host weights to the GPU in native lanes: the copies need the GIL only between batches.

The feeder uploader (memory.upload.Uploader) takes the GIL around every host copy, every driver call and every
hand-off to its copy threads. While the caller's thread runs Python (a component's first pass: kernels loaded,
products planned, graphs captured) each of those waits for the GIL, and the weights land late. Here each of
LANES threads runs one compiled loop (`run_lane`, numba `njit(nogil=True)`) over every piece it has been handed,
calling libc's memcpy and the CUDA driver (cuMemcpyHtoDAsync, cuEventRecord, cuEventSynchronize) through their C
entry points, so a lane takes the GIL once a batch, not once a piece.

A lane owns SLOTS pinned staging slots of SLOT_BYTES and one blocking stream (work queued later on the legacy
default stream waits for its copies, as with the feeder). Its loop copies a piece into the current slot
(pieces smaller than what is left of it share the slot, each at an ALIGN boundary), queues the slot's bytes to
the device, and when a piece does not fit records an event behind the slot and moves to the next, waiting for
that slot's own event first. An array is cut into pieces of at most SLOT_BYTES, each handed to the lane with the
fewest bytes so far; `done[lane]` counts the pieces each lane has queued, and an array's future completes once
every lane has queued the pieces it was handed up to that array's last. A woken lane gathers pieces for up to
GATHER_S (or GATHER_PIECES, GATHER_BYTES) before it takes the GIL for its batch, so while the caller hands a
component's weights over one by one the lanes do not take the GIL from it at every piece; a caller waiting
for an array (`result`, `finish`) cuts the gathering short.

    up = LaneUploader()                  # the same API as memory.upload.Uploader
    dev, queued = up.to_device_later(host)     # at once; queued.result() once its copies are queued
    up.finish()                          # every copy done; the stats

The driver's calls go through memory.driver.Driver (ctypes: nothing here imports numba.cuda, so a process starts
its lanes before the kernel library is imported, memory.preload); a test gives a fake driver whose copies run only
when an event or a synchronize forces them, so a slot refilled before its copies ran shows.
"""

import ctypes
import os
import threading
import time

import numpy as np
from numba import njit

from .driver import LANE_CALLS, _c_function, libc_memcpy
from .host_weights import host_bytes

LANES = min(8, os.cpu_count() or 1)   # lane threads
SLOTS = 3                              # pinned staging slots a lane
SLOT_BYTES = 16 << 20                  # one slot; the largest piece
ALIGN = 256                            # each piece starts at a multiple of this in its slot
POLL_S = 0.0002                        # a waiting future looks at the lanes' counts this often
GATHER_S = 0.01                        # a woken lane waits this long for more pieces (or for these many:)
GATHER_PIECES = 32
GATHER_BYTES = 64 << 20
IDLE, GATHER, RUN = 0, 1, 2            # a lane thread: waiting for work, gathering pieces, in its loop
CLOCK_MONOTONIC = 1                    # clock_gettime's clock for the lanes' slot waits


@njit(nogil=True, cache=True)
def run_lane(pieces, stage, slot_bytes, events, stream, state, done, lane, memcpy, htod, record, wait, clock, stamp):
    """Queue every piece (rows: device address, host address, bytes) to the device in order, through this
    lane's slots.

    stage: the address of the lane's first slot (the others follow, slot_bytes apart); events: one per slot;
    state: [current slot, bytes of it used, then per slot 1 while an event recorded behind it is unwaited, then
    the nanoseconds spent waiting for slots], kept between calls; clock: libc's clock_gettime, stamp its
    timespec (two int64); done[lane] += 1 after each piece's copy is queued. Returns 0, or the first nonzero
    status of a driver call (the state then tells where it stopped)."""
    slots = events.shape[0]
    cur = state[0]
    used = state[1]
    for i in range(pieces.shape[0]):
        nbytes = pieces[i, 2]
        if used + nbytes > slot_bytes:
            status = record(events[cur], stream)
            if status != 0:
                return status
            state[2 + cur] = 1
            cur = (cur + 1) % slots
            used = 0
            state[0] = cur
            state[1] = 0
            if state[2 + cur] != 0:
                clock(CLOCK_MONOTONIC, stamp.ctypes.data)
                began = stamp[0] * 1_000_000_000 + stamp[1]
                status = wait(events[cur])
                if status != 0:
                    return status
                clock(CLOCK_MONOTONIC, stamp.ctypes.data)
                state[2 + slots] += stamp[0] * 1_000_000_000 + stamp[1] - began
                state[2 + cur] = 0
        at = stage + cur * slot_bytes + used
        memcpy(at, pieces[i, 1], nbytes)
        status = htod(pieces[i, 0], at, nbytes, stream)
        if status != 0:
            return status
        used += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        state[1] = used
        done[lane] += 1
    return 0


_CLOCK = _c_function(ctypes.CDLL(None), "clock_gettime", ctypes.c_int, ctypes.c_int, ctypes.c_uint64)


class Queued:
    """An array's copies queued (the future `to_device_later` returns): result() waits for them."""

    def __init__(self, uploader, need):
        self._up, self._need = uploader, need

    def done(self):
        return bool((self._up._done >= self._need).all())

    def result(self, timeout=None):
        if self.done():
            return
        up = self._up
        limit = None if timeout is None else time.perf_counter() + timeout
        with up._lock:
            up._hurry_lanes(1)
        try:
            while not self.done():
                if up._error is not None:
                    raise up._error
                if limit is not None and time.perf_counter() > limit:
                    raise TimeoutError("the lanes did not queue this array's copies in time")
                time.sleep(POLL_S)
        finally:
            with up._lock:
                up._hurry -= 1


class LaneUploader:
    """host arrays -> device arrays through `lanes` native lanes of `slots` pinned slots of `slot_bytes`."""

    def __init__(self, lanes=None, slots=None, slot_bytes=None, driver=None):
        self.lanes = max(1, int(LANES if lanes is None else lanes))
        self.slots = int(SLOTS if slots is None else slots)
        if self.slots < 2:
            raise ValueError("a lane needs at least two staging slots to overlap copies")
        self.slot_bytes = -(-int(SLOT_BYTES if slot_bytes is None else slot_bytes) // ALIGN) * ALIGN
        self.driver = driver
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)      # progress and errors (finish waits on it)
        self._hurry = 0                                     # callers waiting for copies: lanes gather no longer
        self._threads = None
        self._error = None
        self.reset_stats()

    # --- the API (as memory.upload.Uploader's) ---------------------------------------------------------
    def to_device(self, host, out=None, wait=False):
        """A device array holding `host`'s bytes (shape and dtype kept; bf16 is taken as its uint16 bits),
        returned once its copies are queued (after every array handed over before it). memory.upload.Uploader
        takes this method too.

        `out`: a C-contiguous device array of the same number of bytes to copy into (a row slice of a
        stacked weight, say); returned. `wait`: return only after the copy has finished (`finish`).
        """
        out, queued = self.to_device_later(host, out)
        queued.result()
        if wait:
            self.finish()
        return out

    def to_device_later(self, host, out=None):
        """(device array, future) at once; the future completes when every copy of `host` is queued (stream 0
        work queued after that runs after them). Until then nothing may read the device array, nor `host` change.
        Without `out` the array is the driver's (on a GPU a memory.driver.DeviceBuffer, which
        numba.cuda.as_cuda_array wraps without a copy)."""
        host = host_bytes(host, out)
        self._start()
        if out is None:
            out = self.driver.empty(host.shape, host.dtype)
        src = host.reshape(-1).view(np.uint8)
        dst = self.driver.address(out) if host.nbytes else 0
        with self._cond:
            if self._error is not None:
                raise self._error
            begin = 0
            while begin < src.size:
                take = min(self.slot_bytes, src.size - begin)
                lane = int(np.argmin(self._lane_bytes))
                self._pending[lane].append((dst + begin, src.ctypes.data + begin, take, src))
                self._pending_bytes[lane] += take
                self._handed[lane] += 1
                self._lane_bytes[lane] += take
                self._idle[lane] = False
                if self._phase[lane] == IDLE or (self._phase[lane] == GATHER and self._gathered(lane)):
                    self._wake[lane].notify()
                begin += take
            need = self._handed.copy()
            self.arrays += 1
            self.bytes += src.size
        return out, Queued(self, need)

    def empty(self, shape, dtype):
        """An uninitialised device array from the lanes' driver (parts go into its rows through `out=`)."""
        self._start()
        return self.driver.empty(shape, dtype)

    def finish(self):
        """Block until every array handed over is on the device; the stats so far."""
        if self._threads is None:
            return self.stats()
        start = time.perf_counter()
        with self._cond:
            self._hurry_lanes(1)
            try:
                # every piece queued, and every lane past its own synchronize (landed_at set once they all are)
                while not ((self._done >= self._handed).all() and all(self._idle)) and self._error is None:
                    self._cond.wait(0.01)
            finally:
                self._hurry -= 1
            if self._error is not None:
                raise self._error
        for stream in self._streams:
            self.driver.stream_sync(stream)
        self.wait_s += time.perf_counter() - start
        if self.began is not None:
            self.seconds = time.perf_counter() - self.began
        return self.stats()

    def stats(self):
        """bytes and arrays sent, device copies queued, seconds from the first array to the last `finish`,
        bytes per second; host_s and host_cpu_s: the lanes' wall and CPU seconds inside their loops (copies
        into the slots, driver calls, waits for a slot), summed over the lanes; wait_s: finish's waits for the
        lanes and the device; landed_at: time.perf_counter() when every lane had last run out of work and found
        its copies done; slot_wait_s: the lanes' seconds waiting for a slot's copies to the device before
        refilling it, summed over the lanes."""
        copies = int(self._done.sum()) - self._copies_before if self._threads is not None else 0
        slot_wait_ns = self._slot_wait_ns() - self._slot_wait_before
        return {"bytes": self.bytes, "arrays": self.arrays, "copies": copies, "seconds": self.seconds,
                "bytes_per_s": self.bytes / self.seconds if self.seconds else None, "host_s": self.host_s,
                "host_cpu_s": self.host_cpu_s, "wait_s": self.wait_s, "landed_at": self.landed_at,
                "slot_wait_s": slot_wait_ns / 1e9,
                "staging_bytes": self.slot_bytes, "buffers": self.slots, "threads": self.lanes}

    def reset_stats(self):
        self.bytes = self.arrays = 0
        self.host_s = self.host_cpu_s = self.wait_s = self.seconds = 0.0
        self.began = self.landed_at = None
        self._copies_before = int(self._done.sum()) if self._threads is not None else 0
        self._slot_wait_before = self._slot_wait_ns()

    def _slot_wait_ns(self):
        """The lanes' nanoseconds waiting for slots so far (each lane's state keeps its own, last)."""
        return sum(int(state[-1]) for state in self._states) if self._threads is not None else 0

    def thread_ids(self):
        """The lane threads' kernel thread ids (for /proc/self/task/ID), [] before the first array."""
        return [thread.native_id for thread in self._threads or []]

    def close(self):
        """Finish, then stop the lanes (started again on next use)."""
        if self._threads is None:
            return
        self.finish()
        with self._cond:
            self._closing = True
            for wake in self._wake:
                wake.notify()
        for thread in self._threads:
            thread.join()
        self._threads = None

    # --- the lanes ---------------------------------------------------------------------------------------
    def prepare(self):
        """Make the lanes' pinned slots, streams, events and threads now (else on first use)."""
        with self._lock:
            self._start(timing=False)

    def _start(self, timing=True):
        if self.began is None and timing:
            self.began = time.perf_counter()
        if self._threads is not None:
            return
        if self.driver is None:
            from .driver import driver
            self.driver = driver()
        n = self.lanes
        self._stage = self.driver.staging(n * self.slots * self.slot_bytes)
        base = self._stage.ctypes.data
        self._bases = [base + lane * self.slots * self.slot_bytes for lane in range(n)]
        self._streams = [self.driver.new_stream() for _ in range(n)]
        self._events = [np.array([self.driver.new_event() for _ in range(self.slots)], np.int64) for _ in range(n)]
        self._states = [np.zeros(3 + self.slots, np.int64) for _ in range(n)]
        self._stamps = [np.zeros(2, np.int64) for _ in range(n)]
        self._done = np.zeros(n, np.int64)        # pieces queued, per lane (written only by that lane's loop)
        self._handed = np.zeros(n, np.int64)      # pieces handed over, per lane
        self._lane_bytes = np.zeros(n, np.int64)
        self._pending = [[] for _ in range(n)]
        self._pending_bytes = [0] * n
        self._phase = [RUN] * n
        self._wake = [threading.Condition(self._lock) for _ in range(n)]
        self._idle = [True] * n
        self._closing = False
        self._threads = [threading.Thread(target=self._lane_main, args=(lane,), name=f"upload-lane{lane}",
                                          daemon=True) for lane in range(n)]
        for thread in self._threads:
            thread.start()

    def _gathered(self, lane):
        """Enough pieces wait for this lane to take them now."""
        return len(self._pending[lane]) >= GATHER_PIECES or self._pending_bytes[lane] >= GATHER_BYTES

    def _hurry_lanes(self, step):
        """(The lock held.) A caller waits for copies: gathering lanes take what they have at once."""
        self._hurry += step
        for lane, wake in enumerate(self._wake):
            if self._phase[lane] == GATHER:
                wake.notify()

    def _lane_main(self, lane):
        driver = self.driver
        driver.activate()
        wake = self._wake[lane]
        while True:
            with self._lock:
                self._phase[lane] = IDLE
                while not self._pending[lane] and not self._closing:
                    wake.wait()
                self._phase[lane] = GATHER            # more pieces are likely on their way: take them together
                until = time.perf_counter() + GATHER_S
                while not (self._closing or self._hurry or self._gathered(lane)):
                    left = until - time.perf_counter()
                    if left <= 0:
                        break
                    wake.wait(left)
                self._phase[lane] = RUN
                if not self._pending[lane]:
                    return
                batch, self._pending[lane] = self._pending[lane], []
                self._pending_bytes[lane] = 0
            pieces = np.array([piece[:3] for piece in batch], np.int64)
            wall, cpu = time.perf_counter(), time.thread_time()
            status = run_lane(pieces, self._bases[lane], self.slot_bytes, self._events[lane], self._streams[lane],
                              self._states[lane], self._done, lane, driver.memcpy, driver.htod, driver.record,
                              driver.wait, _CLOCK, self._stamps[lane])
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            del batch                         # the bytes are in the slots now
            with self._cond:
                self.host_s += wall
                self.host_cpu_s += cpu
                if status != 0:
                    self._error = RuntimeError(f"upload lane {lane}: a CUDA driver call failed with status {status}")
                    self._cond.notify_all()
                    return
                idle = not self._pending[lane]
            if idle:                          # nothing more for now: wait for this lane's copies, note the time
                driver.stream_sync(self._streams[lane])
                with self._cond:
                    if not self._pending[lane]:
                        self._idle[lane] = True
                        if all(self._idle):
                            self.landed_at = time.perf_counter()
                    self._cond.notify_all()


def warm(driver):
    """Load (or compile) run_lane for these driver entry points, copying nothing: the lanes' first batch then
    starts copying at once. The entry points need no context, so this may run while another thread opens it."""
    run_lane(np.zeros((0, 3), np.int64), 0, 1, np.zeros(SLOTS, np.int64), 0, np.zeros(3 + SLOTS, np.int64),
             np.zeros(1, np.int64), 0, driver.memcpy, driver.htod, driver.record, driver.wait, _CLOCK,
             np.zeros(2, np.int64))


def warm_without_gpu():
    """warm() on a machine without a GPU or driver (an image's build step): libc's memcpy stands in for each
    driver entry point, declared with the driver's prototypes, so the loop compiles to the code the product
    runs and is kept in numba's cache; given no pieces, it calls none of them."""
    libc = ctypes.CDLL(None)
    stand_in = {attr: _c_function(libc, "memcpy", ctypes.c_int, *args) for attr, (_, args) in LANE_CALLS.items()}
    warm(type("StandIn", (), dict(stand_in, memcpy=libc_memcpy())))


_PROCESS = None


def process_lanes():
    """The process's lanes (memory.upload.uploader() on a GPU, and memory.preload's), made on first use."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = LaneUploader()
    return _PROCESS
