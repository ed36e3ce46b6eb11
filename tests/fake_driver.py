"""A stand-in for cuda_driver.Driver on the CPU (the upload lanes' tests): host memory as the device."""

import ctypes
import threading

import numpy as np

from moss_cli.memory import driver as cuda_driver

STATUS, U64 = ctypes.c_int, ctypes.c_uint64


class FakeDriver:
    """Host memory as the device. htod only queues (dst, src, n) on its stream; an event's wait or a stream's
    synchronize runs the queued copies up to that point, reading the staging slot then. `careless`: waits run
    nothing (a loop that does not wait for a slot's event before refilling it sees no difference then, but its
    bytes do)."""

    def __init__(self, careless=False, fail_at=None, gate=None):
        self.queues, self.ran, self.marks = {}, {}, {}
        self.stages, self.stray_reads = [], []      # (address, bytes) of each staging buffer; copies read elsewhere
        self.lock = threading.RLock()
        self.careless, self.fail_at, self.gate = careless, fail_at, gate
        self.calls = 0
        self.memcpy = cuda_driver._c_function(ctypes.CDLL(None), "memcpy", U64, U64, U64, ctypes.c_size_t)
        self.htod = ctypes.CFUNCTYPE(STATUS, U64, U64, ctypes.c_size_t, U64)(self._htod)
        self.record = ctypes.CFUNCTYPE(STATUS, U64, U64)(self._record)
        self.wait = ctypes.CFUNCTYPE(STATUS, U64)(self._wait)
        self._kept, self._ids = [], 0

    def _htod(self, dst, src, n, stream):
        if self.gate is not None:
            self.gate.wait()
        with self.lock:
            self.calls += 1
            if self.fail_at is not None and self.calls >= self.fail_at:
                return 700
            if not any(a <= src and src + n <= a + size for a, size in self.stages):
                self.stray_reads.append((src, n))
            self.queues[stream].append((dst, src, n))
        return 0

    def _record(self, event, stream):
        with self.lock:
            self.marks[event] = (stream, len(self.queues[stream]))
        return 0

    def _wait(self, event):
        if not self.careless:
            self._run(*self.marks[event])
        return 0

    def _run(self, stream, upto):
        with self.lock:
            queue = self.queues[stream]
            while self.ran[stream] < upto:
                ctypes.memmove(*queue[self.ran[stream]])
                self.ran[stream] += 1

    def stream_sync(self, stream):
        self._run(stream, len(self.queues[stream]))

    def activate(self):
        pass

    def staging(self, nbytes):
        stage = np.zeros(nbytes, np.uint8)
        self.stages.append((stage.ctypes.data, nbytes))
        return stage

    def _id(self):
        self._ids += 1
        return self._ids

    def new_stream(self):
        stream = self._id()
        self.queues[stream], self.ran[stream] = [], 0
        return stream

    def new_event(self):
        return self._id()

    def empty(self, shape, dtype):
        out = np.empty(shape, dtype)
        out.view(np.uint8)[...] = 0xA5            # unfilled bytes, unlike any array below
        return out

    @staticmethod
    def address(array):
        return array.ctypes.data
