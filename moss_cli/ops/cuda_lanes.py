"""Host weights to the GPU in native lanes: the copies need the GIL only between batches.

The feeder uploader (cuda_upload.Uploader) takes the GIL around every host copy, every driver call and every
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

With `direct` (DIRECT), an array that is a view of a memory-mapped file (a safetensors map) is copied to the
device straight from the map, without the slot: each map is registered with the driver (cuMemHostRegister,
read-only) in chunks of REG_BYTES by REG_THREADS threads as soon as the uploader first sees it, and a lane
copies a piece directly when its chunk is registered by the time the lane reaches it, through its slots
otherwise. After `finish` no copy reads a registered chunk (their maps' later arrays take the slots), but the
chunks are handed back (cuMemHostUnregister) only by `close`: `finish` is called while a graph is captured,
and a call that may synchronize the device must not run then.

    up = LaneUploader()                  # the same API as cuda_upload.Uploader
    dev, queued = up.to_device_later(host)     # at once; queued.result() once its copies are queued
    up.finish()                          # every copy done; the stats

The driver's calls go through `Driver`; a test gives a fake one whose copies run only when an event or a
synchronize forces them, so a slot refilled before its copies ran shows.
"""

import collections
import ctypes
import mmap
import os
import threading
import time

import numpy as np
from numba import njit

from .cuda_upload import Uploader, host_bytes

LANES = min(8, os.cpu_count() or 1)   # lane threads
SLOTS = 3                              # pinned staging slots a lane
SLOT_BYTES = 16 << 20                  # one slot; the largest piece
ALIGN = 256                            # each piece starts at a multiple of this in its slot
POLL_S = 0.0002                        # a waiting future looks at the lanes' counts this often
GATHER_S = 0.01                        # a woken lane waits this long for more pieces (or for these many:)
GATHER_PIECES = 32
GATHER_BYTES = 64 << 20
IDLE, GATHER, RUN = 0, 1, 2            # a lane thread: waiting for work, gathering pieces, in its loop
DIRECT = False                         # copy mapped files' bytes to the device straight from their maps (off: on an
                                       # H100 the first step came no sooner, and the maps stay page-locked: BENCHMARKS.md)
REG_BYTES = 256 << 20                  # a map is registered in chunks of this many bytes (a multiple of pages)
REG_THREADS = 4                        # threads registering chunks
MAX_CHUNKS = 1 << 16                   # chunks an uploader can register (16 TB of maps)
UNREGISTERED, REGISTERED, RETIRED = 0, 1, 2    # a chunk: not (yet) registered, copies may read it, handed back


@njit(nogil=True, cache=True)
def run_lane(pieces, stage, slot_bytes, events, stream, state, done, lane, memcpy, htod, record, wait, chunks,
             direct):
    """Queue every piece (rows: device address, host address, bytes, chunk) to the device in order: straight
    from the host where its chunk (>= 0) is REGISTERED in `chunks` when the lane reaches it, else through
    this lane's slots.

    stage: the address of the lane's first slot (the others follow, slot_bytes apart); events: one per slot;
    state: [current slot, bytes of it used, then per slot 1 while an event recorded behind it is unwaited],
    kept between calls; done[lane] += 1 after each piece's copy is queued (and direct[lane] += its bytes when
    it went straight from the host). Returns 0, or the first nonzero
    status of a driver call (the state then tells where it stopped)."""
    slots = events.shape[0]
    cur = state[0]
    used = state[1]
    for i in range(pieces.shape[0]):
        nbytes = pieces[i, 2]
        chunk = pieces[i, 3]
        if chunk >= 0 and chunks[chunk] == REGISTERED:     # the driver reads the host bytes where they are
            status = htod(pieces[i, 0], pieces[i, 1], nbytes, stream)
            if status != 0:
                return status
            done[lane] += 1
            direct[lane] += nbytes
            continue
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
                status = wait(events[cur])
                if status != 0:
                    return status
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


def _c_function(lib, name, restype, *argtypes):
    """lib's `name` as a fresh ctypes function object (its own argtypes, not the library's cached attribute)."""
    function = lib[name]
    function.restype, function.argtypes = restype, list(argtypes)
    return function


class Driver:
    """The CUDA driver and libc through ctypes, as the lanes use them; device arrays are numba's."""

    def __init__(self):
        from numba import cuda
        self._cuda = cuda
        u64, status = ctypes.c_uint64, ctypes.c_int
        lib = ctypes.CDLL("libcuda.so.1")
        self.htod = _c_function(lib, "cuMemcpyHtoDAsync_v2", status, u64, u64, ctypes.c_size_t, u64)
        self.record = _c_function(lib, "cuEventRecord", status, u64, u64)
        self.wait = _c_function(lib, "cuEventSynchronize", status, u64)
        self._stream_sync = _c_function(lib, "cuStreamSynchronize", status, u64)
        self.memcpy = _c_function(ctypes.CDLL(None), "memcpy", u64, u64, u64, ctypes.c_size_t)
        self._register = _c_function(lib, "cuMemHostRegister_v2", status, u64, ctypes.c_size_t, ctypes.c_uint)
        self._unregister = _c_function(lib, "cuMemHostUnregister", status, u64)
        self._kept = []             # numba's stream and event objects, alive as long as the driver

    def activate(self):
        """Make the process's CUDA context current on the calling (lane) thread."""
        self._cuda.current_context()

    def staging(self, nbytes):
        return self._cuda.pinned_array(nbytes, np.uint8)

    def new_stream(self):
        stream = self._cuda.stream()
        self._kept.append(stream)
        return _handle(stream)

    def new_event(self):
        event = self._cuda.event(timing=False)
        self._kept.append(event)
        return _handle(event)

    def stream_sync(self, stream):
        _check(self._stream_sync(stream), "cuStreamSynchronize")

    def register(self, address, nbytes):
        """Page-lock host memory the device only reads (a read-only map); the driver's status."""
        return self._register(address, nbytes, 8)      # CU_MEMHOSTREGISTER_READ_ONLY

    def unregister(self, address):
        return self._unregister(address)

    def empty(self, shape, dtype):
        return self._cuda.device_array(shape, dtype)

    @staticmethod
    def address(array):
        return array.__cuda_array_interface__["data"][0]


def _handle(obj):
    """A numba stream's or event's driver handle as an integer (NVIDIA binding objects or ctypes pointers)."""
    handle = obj.handle
    try:
        return int(handle)
    except TypeError:
        return int(handle.value or 0)


def _check(status, call):
    if status != 0:
        raise RuntimeError(f"{call} failed with CUDA driver status {status}")


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

    def __init__(self, lanes=None, slots=None, slot_bytes=None, driver=None, direct=None):
        self.lanes = max(1, int(LANES if lanes is None else lanes))
        self.slots = int(SLOTS if slots is None else slots)
        if self.slots < 2:
            raise ValueError("a lane needs at least two staging slots to overlap copies")
        self.slot_bytes = -(-int(SLOT_BYTES if slot_bytes is None else slot_bytes) // ALIGN) * ALIGN
        self.driver = driver
        self.direct = DIRECT if direct is None else bool(direct)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)      # progress and errors (finish waits on it)
        self._hurry = 0                                     # callers waiting for copies: lanes gather no longer
        self._threads = None
        self._error = None
        self.reset_stats()

    # --- the API (as cuda_upload.Uploader's) ---------------------------------------------------------
    to_device = Uploader.to_device      # to_device_later, then wait for the future (and with wait, finish)

    def to_device_later(self, host, out=None):
        """(device array, future) at once; the future completes when every copy of `host` is queued (stream 0
        work queued after that runs after them). Until then nothing may read the device array, nor `host` change."""
        host = host_bytes(host, out)
        self._start()
        if out is None:
            out = self.driver.empty(host.shape, host.dtype)
        src = host.reshape(-1).view(np.uint8)
        dst = self.driver.address(out) if host.nbytes else 0
        with self._cond:
            if self._error is not None:
                raise self._error
            first, offset = self._map_chunk(host) if self.direct and src.size else (-1, 0)
            begin = 0
            while begin < src.size:
                take = min(self.slot_bytes, src.size - begin)
                chunk = -1
                if first >= 0:      # pieces end at chunk boundaries: each is read from one registered range
                    at = offset + begin
                    take = min(take, REG_BYTES - at % REG_BYTES)
                    chunk = first + at // REG_BYTES
                    self._want(chunk)
                lane = int(np.argmin(self._lane_bytes))
                self._pending[lane].append((dst + begin, src.ctypes.data + begin, take, chunk, src))
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
        self._retire()
        self.wait_s += time.perf_counter() - start
        if self.began is not None:
            self.seconds = time.perf_counter() - self.began
        return self.stats()

    def stats(self):
        """bytes and arrays sent, device copies queued, seconds from the first array to the last `finish`,
        bytes per second; host_s and host_cpu_s: the lanes' wall and CPU seconds inside their loops (copies
        into the slots, driver calls, waits for a slot), summed over the lanes; wait_s: finish's waits for the
        lanes and the device; landed_at: time.perf_counter() when every lane had last run out of work and found
        its copies done."""
        copies = int(self._done.sum()) - self._copies_before if self._threads is not None else 0
        return {"bytes": self.bytes, "arrays": self.arrays, "copies": copies, "seconds": self.seconds,
                "bytes_per_s": self.bytes / self.seconds if self.seconds else None, "host_s": self.host_s,
                "host_cpu_s": self.host_cpu_s, "wait_s": self.wait_s, "landed_at": self.landed_at,
                "staging_bytes": self.slot_bytes, "buffers": self.slots, "threads": self.lanes,
                "direct_bytes": int(self._direct.sum()) - self._direct_before if self._threads is not None else 0,
                "registered_bytes": self.registered_bytes, "register_s": self.register_s,
                "register_failures": self.register_failures, "unregister_s": self.unregister_s}

    @staticmethod
    def describe_direct(stats):
        """The direct copies' share and the registration's cost in `stats`, as a clause ("" when no map was
        registered)."""
        if not stats.get("registered_bytes") and not stats.get("register_failures"):
            return ""
        return (f"; {stats['direct_bytes'] / 1e9:.2f} GB straight from the maps, {stats['registered_bytes'] / 1e9:.2f}"
                f" GB registered in {stats['register_s']:.2f} s summed over the registering threads, "
                f"{stats['register_failures']} failed")

    def reset_stats(self):
        self.bytes = self.arrays = 0
        self.host_s = self.host_cpu_s = self.wait_s = self.seconds = 0.0
        self.began = self.landed_at = None
        self._copies_before = int(self._done.sum()) if self._threads is not None else 0
        self._direct_before = int(self._direct.sum()) if self._threads is not None else 0
        self.registered_bytes = self.register_failures = 0
        self.register_s = self.unregister_s = 0.0

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
            self._cond.notify_all()          # the registrars
        for thread in self._threads + self._registrars:
            thread.join()
        start = time.perf_counter()
        for address in self._registered:         # (no copy reads them since finish, which close called)
            self.driver.unregister(address)
        self.unregister_s += time.perf_counter() - start
        self._registered = []
        self._threads = None

    # --- the lanes ---------------------------------------------------------------------------------------
    def _start(self):
        if self.began is None:
            self.began = time.perf_counter()
        if self._threads is not None:
            return
        if self.driver is None:
            self.driver = Driver()
        n = self.lanes
        self._stage = self.driver.staging(n * self.slots * self.slot_bytes)
        base = self._stage.ctypes.data
        self._bases = [base + lane * self.slots * self.slot_bytes for lane in range(n)]
        self._streams = [self.driver.new_stream() for _ in range(n)]
        self._events = [np.array([self.driver.new_event() for _ in range(self.slots)], np.int64) for _ in range(n)]
        self._states = [np.zeros(2 + self.slots, np.int64) for _ in range(n)]
        self._done = np.zeros(n, np.int64)        # pieces queued, per lane (written only by that lane's loop)
        self._handed = np.zeros(n, np.int64)      # pieces handed over, per lane
        self._lane_bytes = np.zeros(n, np.int64)
        self._pending = [[] for _ in range(n)]
        self._pending_bytes = [0] * n
        self._phase = [RUN] * n
        self._wake = [threading.Condition(self._lock) for _ in range(n)]
        self._idle = [True] * n
        self._closing = False
        self._chunks = np.zeros(MAX_CHUNKS, np.int32)   # per chunk of a map: UNREGISTERED, REGISTERED, RETIRED
        self._direct = np.zeros(n, np.int64)            # bytes each lane copied straight from a registered map
        self._maps = {}                                 # id(map) -> (map, address, bytes, first chunk)
        self._next_chunk = 0
        self._to_register = {}                          # chunk -> (address, bytes), in the order first seen
        self._urgent = collections.deque()              # chunks a piece handed over reads, in that order
        self._registered = []                           # addresses of the chunks registered, for close to hand back
        self._registrars = []
        self._registering = 0                           # registrations in flight
        self._threads = [threading.Thread(target=self._lane_main, args=(lane,), name=f"upload-lane{lane}",
                                          daemon=True) for lane in range(n)]
        for thread in self._threads:
            thread.start()

    def _map_chunk(self, host):
        """(The lock held.) (first chunk of its map, offset of host's bytes in the map) when `host` is a view of
        a memory-mapped file (its chunks then queued for registration when the map is new), else (-1, 0)."""
        root = host
        while root is not None and not isinstance(root, mmap.mmap):
            root = root.obj if isinstance(root, memoryview) else getattr(root, "base", None)
        if root is None or root.closed:
            return -1, 0
        known = self._maps.get(id(root))
        if known is None:
            size = len(root)
            address = np.frombuffer(root, np.uint8).ctypes.data if size else 0
            count = -(-size // REG_BYTES)
            if not size or self._next_chunk + count > MAX_CHUNKS:
                return -1, 0
            known = self._maps[id(root)] = (root, address, size, self._next_chunk)
            for k in range(count):
                self._to_register[self._next_chunk + k] = (address + k * REG_BYTES,
                                                           min(REG_BYTES, size - k * REG_BYTES))
            self._next_chunk += count
            if not self._registrars:
                self._registrars = [threading.Thread(target=self._registrar_main, name=f"upload-register{i}",
                                                     daemon=True) for i in range(REG_THREADS)]
                for thread in self._registrars:
                    thread.start()
            self._cond.notify_all()
        _, address, size, first = known
        offset = host.ctypes.data - address
        if offset < 0 or offset + host.nbytes > size:
            return -1, 0
        return first, offset

    def wait_registered(self):
        """Block until no chunk waits for its registration or is being registered (benchmarks, tests)."""
        with self._cond:
            while (self._to_register or self._registering) and not self._closing:
                self._cond.wait()

    def _want(self, chunk):
        """(The lock held.) A piece handed over reads `chunk`: register it before the chunks no piece reads yet."""
        if chunk in self._to_register and (not self._urgent or self._urgent[-1] != chunk):
            self._urgent.append(chunk)

    def _registrar_main(self):
        """Register queued chunks (the lanes copy from one once it is REGISTERED) until closing."""
        driver = self.driver
        driver.activate()
        while True:
            with self._cond:
                while not self._to_register and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                while self._urgent and self._urgent[0] not in self._to_register:
                    self._urgent.popleft()      # registered already
                chunk = self._urgent.popleft() if self._urgent else next(iter(self._to_register))
                address, nbytes = self._to_register.pop(chunk)
                self._registering += 1
            start = time.perf_counter()
            status = driver.register(address, nbytes)
            took = time.perf_counter() - start
            with self._cond:
                self._registering -= 1
                self._cond.notify_all()
                self.register_s += took
                if status != 0:
                    self.register_failures += 1       # its pieces go through the slots
                    continue
                self.registered_bytes += nbytes
                self._registered.append(address)
                if self._chunks[chunk] == UNREGISTERED:       # (not retired while it was being registered)
                    self._chunks[chunk] = REGISTERED

    def _retire(self):
        """(Every copy done.) No copy reads a registered chunk from now on, and none is registered any more: their
        maps' later arrays go through the slots; close hands the registered ones back."""
        with self._cond:
            self._chunks[:self._next_chunk] = RETIRED
            self._to_register.clear()
            self._urgent.clear()

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
            pieces = np.array([piece[:4] for piece in batch], np.int64)
            wall, cpu = time.perf_counter(), time.thread_time()
            status = run_lane(pieces, self._bases[lane], self.slot_bytes, self._events[lane], self._streams[lane],
                              self._states[lane], self._done, lane, driver.memcpy, driver.htod, driver.record,
                              driver.wait, self._chunks, self._direct)
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            del batch                         # the bytes are in the slots now, or read from maps self._maps keeps
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
