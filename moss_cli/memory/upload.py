"""Host weights to the GPU through pinned staging buffers on a dedicated stream: the Python feeder.

On a GPU the process uploader (`uploader()`) is memory.lanes.LaneUploader, which does the same work in compiled
loops without the GIL and keeps this API; this feeder serves the CUDA simulator and A/B runs (USE_LANES = False).

A memory-mapped tensor is not pinned, so the driver would copy it through its own small staging buffer,
synchronously. Here every array goes through a few fixed pinned buffers (STAGING_BYTES each, BUFFERS of
them): its bytes are copied from the host array (the memory map) into the current buffer by a few
threads (numpy releases the GIL, so page-cache reads and page faults run in parallel), then one
cuMemcpyHtoDAsync moves that piece to the device on the uploader's stream while the next piece is copied
into the next buffer. A buffer is refilled only after the event recorded behind its last copy has fired.
Small arrays are packed one after another into the same buffer (one async copy each), so a thousand norm
weights cost a thousand small copies, not a thousand buffer round trips. The bytes are never converted:
bf16 stays bf16 bits (uint16), float32 stays float32.

Order: the uploader's stream is a blocking stream (numba's cuda.stream()), so work queued later on the
legacy default stream (stream 0, where CudaOps runs eagerly) waits for the copies already queued; any other
stream must call `finish()` before reading an uploaded array. `to_device` returns as
soon as the host array's bytes are in a staging buffer: the host array may go away then.

One feeder thread does all of that, array after array in the order they were handed over, so the caller
need not wait: `to_device_later` returns the device array at once with a future that completes when its
copies are queued (from then on stream 0 work is ordered after them), and a component's whole weight list can
be handed over up front while the caller's thread goes on (kernels, plans) and takes each weight as it
needs it. `to_device` is the same, waiting for its own future.

    up = uploader()                      # the process-wide one (pinned buffers made on first use)
    dev = up.to_device(host)             # a new device array with host's shape and dtype
    up.to_device(host, out=dev_slice)    # into an existing contiguous device array of the same bytes
    dev, queued = up.to_device_later(host)   # at once; queued.result() once the copies must be queued
    up.finish()                          # every queued copy done; returns the stats

The GIL: the feeder and copy threads take it between their pieces and around every driver call. While the
caller's thread runs Python (a component's first pass: kernels loaded, products planned, graphs captured),
a thread that released the GIL waits up to the interpreter's switch interval (5 ms) to get it back. While
arrays are in flight the uploader sets that interval to SWITCH_S, and puts the caller's back when the feeder
runs out of work (None: leave the interpreter's).
"""

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import config, cuda

from .lanes import LaneUploader
from .host_weights import host_bytes

STAGING_BYTES = 128 << 20   # one pinned staging buffer
BUFFERS = 3                 # staging buffers in rotation
THREADS = min(8, os.cpu_count() or 1)   # host copy threads per piece
PIECE_BYTES = 4 << 20       # the smallest host copy handed to a thread
SIMULATED = bool(config.ENABLE_CUDASIM)
ALIGN = 256                 # each packed array starts at a multiple of this in its staging buffer
SWITCH_S = 0.0005           # the interpreter's switch interval while arrays are in flight (None: leave it)


class Uploader:
    """host arrays -> numba device arrays through `buffers` pinned buffers of `staging_bytes` each."""

    def __init__(self, staging_bytes=STAGING_BYTES, buffers=BUFFERS, threads=None):
        if buffers < 2:
            raise ValueError("the uploader needs at least two staging buffers to overlap copies")
        self.staging_bytes = -(-int(staging_bytes) // ALIGN) * ALIGN
        self.buffers = int(buffers)
        self.threads = max(1, int(THREADS if threads is None else threads))
        self._staging = None        # [pinned uint8 arrays], made on first use
        self._events = None         # per buffer: the event recorded behind its last copy, or None
        self._stream = None
        self._pool = None
        self._current = 0           # the buffer being filled
        self._cursor = 0            # bytes of it used since it was last recycled
        self._feeder = None         # the one thread that fills and queues, in hand-over order
        self._futures = []          # hand-overs not yet seen done by finish()
        self._lock = threading.Lock()
        self._handed = self._fed = 0
        self._switch = None         # the interpreter's switch interval before this uploader's, while busy
        self.reset_stats()

    # --- the API -------------------------------------------------------------------------------
    to_device = LaneUploader.to_device      # to_device_later, then wait for its future (the lanes' API too)

    def to_device_later(self, host, out=None):
        """(device array, future) at once: the feeder thread fills the staging buffers from `host` and queues
        the copies after those of every array handed over before; the future completes then (or raises what
        the feeder met). Until it completes, nothing may read the device array, nor may `host` change."""
        host = host_bytes(host, out)
        if out is None:
            out = cuda.device_array(host.shape, host.dtype)
        self._start()
        src = host.reshape(-1).view(np.uint8)
        dst = out.reshape(out.size).view(np.uint8) if host.nbytes else None
        with self._lock:
            if self._handed == self._fed and SWITCH_S is not None and self._switch is None:
                self._switch = sys.getswitchinterval()
                sys.setswitchinterval(SWITCH_S)
            self._handed += 1
        queued = self._feeder.submit(self._feed, src, dst)
        self._futures.append(queued)
        return out, queued

    def finish(self):
        """Block until every array handed over is on the device; the stats so far (see `stats`)."""
        futures, self._futures = self._futures, []
        for queued in futures:          # in order; the first the feeder failed on raises here
            queued.result()
        if self._stream is not None:
            start = time.perf_counter()
            self._stream.synchronize()
            self.wait_s += time.perf_counter() - start
            self._events = [None] * self.buffers      # every buffer is free again
        if self.began is not None:
            self.seconds = time.perf_counter() - self.began
        return self.stats()

    def stats(self):
        """bytes and arrays sent, seconds from the first array to the last `finish`, bytes per second,
        and where the feeder's time went (host_s: copies into staging; wait_s: waiting for the device; feed_s:
        all of its work, driver calls and waits for the GIL included); piece_s and piece_cpu_s: the copy threads'
        seconds inside their copies, wall and CPU, summed over the threads;
        landed_at: time.perf_counter() when the feeder last ran out of work and found every copy done."""
        return {"bytes": self.bytes, "arrays": self.arrays, "copies": self.copies, "seconds": self.seconds,
                "bytes_per_s": self.bytes / self.seconds if self.seconds else None,
                "host_s": self.host_s, "wait_s": self.wait_s, "feed_s": self.feed_s, "piece_s": self.piece_s,
                "piece_cpu_s": self.piece_cpu_s, "landed_at": self.landed_at,
                "staging_bytes": self.staging_bytes, "buffers": self.buffers, "threads": self.threads}

    def reset_stats(self):
        self.bytes = self.arrays = self.copies = 0
        self.host_s = self.wait_s = self.feed_s = self.piece_s = self.piece_cpu_s = 0.0
        self.seconds = 0.0
        self.began = self.landed_at = None

    def close(self):
        """Finish, then free the pinned buffers, the stream and the threads (made again on next use)."""
        self.finish()
        for pool in (self._feeder, self._pool):
            if pool is not None:
                pool.shutdown()
        self._staging = self._events = self._stream = self._pool = self._feeder = None
        self._current = self._cursor = 0

    # --- the pipeline --------------------------------------------------------------------------
    def _start(self):
        if self.began is None:
            self.began = time.perf_counter()
        if self._staging is None:
            self._stream = cuda.stream()
            self._staging = [cuda.pinned_array(self.staging_bytes, np.uint8) for _ in range(self.buffers)]
            self._events = [None] * self.buffers
            self._free = [_event() for _ in range(self.buffers)]
            if self.threads > 1:
                self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="upload")
            self._feeder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="upload-feeder")

    def _feed(self, src, dst):
        """The feeder's job for one array: its pieces through the staging buffers; when no array is left to
        feed, it waits for the copies to finish and notes the time (landed_at)."""
        start = time.perf_counter()
        try:
            if dst is not None:
                self._send(src, dst)
                self.arrays += 1
        finally:
            self.feed_s += time.perf_counter() - start
            with self._lock:
                self._fed += 1
                idle = self._fed == self._handed
                if idle and self._switch is not None:
                    sys.setswitchinterval(self._switch)
                    self._switch = None
        if idle:
            self._stream.synchronize()
            self.landed_at = time.perf_counter()

    def _send(self, src, dst):
        """src (host uint8) -> dst (device uint8 view) in pieces that fit the staging buffers."""
        total, pos = src.size, 0
        while pos < total:
            room = self.staging_bytes - self._cursor
            if room <= 0:
                self._rotate()
                continue
            take = min(room, total - pos)
            begin = self._cursor
            stage = self._staging[self._current][begin:begin + take]
            self._fill(stage, src[pos:pos + take])
            self._copy(dst[pos:pos + take], stage)
            self._cursor = begin + -(-take // ALIGN) * ALIGN
            pos += take
            self.bytes += take

    def _fill(self, stage, src):
        """Host copy src -> stage (pinned), split over the threads when it is large."""
        start = time.perf_counter()
        n = src.size
        parts = min(self.threads, n // PIECE_BYTES) if self._pool is not None else 1
        if parts <= 1:
            spans = [_copied(stage, src)]
        else:
            bounds = [n * i // parts for i in range(parts + 1)]
            spans = list(self._pool.map(lambda i: _copied(stage[bounds[i]:bounds[i + 1]], src[bounds[i]:bounds[i + 1]]),
                                        range(parts)))
        self.host_s += time.perf_counter() - start
        self.piece_s += sum(w for w, _ in spans)
        self.piece_cpu_s += sum(c for _, c in spans)

    def _copy(self, dst, stage):
        """Queue the device copy of a filled staging range on the uploader's stream."""
        dst.copy_to_device(stage, stream=self._stream)
        self.copies += 1

    def _rotate(self):
        """Close the current buffer (an event behind its copies) and move to the next one, waiting until the
        copies that last read it have finished."""
        event = self._free[self._current]
        event.record(self._stream)
        self._events[self._current] = event
        self._current = (self._current + 1) % self.buffers
        self._cursor = 0
        pending = self._events[self._current]
        if pending is not None:
            start = time.perf_counter()
            pending.synchronize()
            self.wait_s += time.perf_counter() - start
            self._events[self._current] = None


def _copied(stage, src):
    """np.copyto(stage, src) (the GIL released); its (wall, thread CPU) seconds."""
    wall, cpu = time.perf_counter(), time.thread_time()
    np.copyto(stage, src)
    return time.perf_counter() - wall, time.thread_time() - cpu


def _event():
    """An event without timing (cheaper to record); the simulator's events take no arguments."""
    return cuda.event() if SIMULATED else cuda.event(timing=False)


_SHARED = None
USE_LANES = not SIMULATED   # the process-wide uploader: native lanes (memory.lanes) on a GPU, this feeder otherwise


def uploader():
    """The process-wide uploader (CudaOps.param and params send weights through it): a memory.lanes.LaneUploader
    where USE_LANES (a GPU), else an Uploader (the simulator; a GPU run that sets USE_LANES = False, for A/B runs)."""
    global _SHARED
    if _SHARED is None:
        if USE_LANES:
            from .lanes import process_lanes
            _SHARED = process_lanes()
        else:
            _SHARED = Uploader()
    return _SHARED
