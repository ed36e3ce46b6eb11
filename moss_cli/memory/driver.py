"""The CUDA driver through ctypes, as the upload lanes use it: no numba.cuda import, so a process can start
sending weights to the GPU before the kernel library (numba.cuda, nvmath, cuDNN) has been imported.

The context is the device's primary context, the one numba takes later (numba retains the same primary
context of the same device), so device memory allocated here is numba's to read: `DeviceBuffer` describes it
through __cuda_array_interface__ and `numba.cuda.as_cuda_array` wraps it without a copy, keeping the buffer
(and so the allocation) alive as long as any view of it lives.

    drv = driver()                          # cuInit, the primary context of device 0 current on this thread
    buf = drv.empty((rows, cols), np.uint16)     # cuMemAlloc; buf[2:5] a row view; freed with the last view
    stage = drv.staging(nbytes)             # page-locked host bytes (cuMemHostAlloc) as a numpy uint8 array
"""

import ctypes
import threading
import weakref

import numpy as np

from ..errors import DeviceError

EVENT_DISABLE_TIMING = 0x2             # cuEventCreate's flag: an event for ordering only, cheaper to record
STREAM_DEFAULT = 0x0                   # cuStreamCreate's flag: a blocking stream (the legacy stream 0 waits for it)
CC_MAJOR, CC_MINOR = 75, 76            # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR


def _c_function(lib, name, restype, *argtypes):
    """lib's `name` as a fresh ctypes function object (its own argtypes, not the library's cached attribute)."""
    function = lib[name]
    function.restype, function.argtypes = restype, list(argtypes)
    return function


# the driver's entry points the upload lanes' compiled loop calls: attribute -> (name, argument types); each
# returns a CUresult (int)
LANE_CALLS = {"htod": ("cuMemcpyHtoDAsync_v2", (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint64)),
              "record": ("cuEventRecord", (ctypes.c_uint64, ctypes.c_uint64)),
              "wait": ("cuEventSynchronize", (ctypes.c_uint64,))}


def libc_memcpy():
    """libc's memcpy (destination, source, bytes as integers) as a ctypes function of its own."""
    u64 = ctypes.c_uint64
    return _c_function(ctypes.CDLL(None), "memcpy", u64, u64, u64, ctypes.c_size_t)


class Driver:
    """The CUDA driver and libc through ctypes, on device `ordinal`'s primary context (`open`: now; else the
    entry points only, until open())."""

    def __init__(self, ordinal=0, open=True):
        u64, p64, status = ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise DeviceError(f"the CUDA driver (libcuda.so.1) is not found ({e})") from None
        f = lambda name, *args: _c_function(lib, name, status, *args)   # noqa: E731
        for attr, (name, args) in LANE_CALLS.items():
            setattr(self, attr, f(name, *args))
        self._stream_sync = f("cuStreamSynchronize", u64)
        self._set_current = f("cuCtxSetCurrent", u64)
        self._alloc = f("cuMemAlloc_v2", p64, ctypes.c_size_t)
        self._free = f("cuMemFree_v2", u64)
        self._host_alloc = f("cuMemHostAlloc", p64, ctypes.c_size_t, ctypes.c_uint)
        self._host_free = f("cuMemFreeHost", u64)
        self._new_stream = f("cuStreamCreate", p64, ctypes.c_uint)
        self._new_event = f("cuEventCreate", p64, ctypes.c_uint)
        self._mem_info = f("cuMemGetInfo_v2", p64, p64)
        self.memcpy = libc_memcpy()
        self._init = f("cuInit", ctypes.c_uint)
        self._device_get = f("cuDeviceGet", ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        self._attribute = f("cuDeviceGetAttribute", ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int)
        self._retain = f("cuDevicePrimaryCtxRetain", p64, ctypes.c_int)
        self.ordinal, self.context, self.compute_capability = ordinal, None, None
        if open:
            self.open()

    def open(self):
        """cuInit, then device `ordinal`'s primary context, current on this thread (the driver calls release
        the GIL: another thread may import meanwhile)."""
        self._check(self._init(0), "cuInit")
        device, ctx = ctypes.c_int(), ctypes.c_uint64()
        self._check(self._device_get(ctypes.byref(device), self.ordinal), "cuDeviceGet")
        cc = []
        for which in (CC_MAJOR, CC_MINOR):
            value = ctypes.c_int()
            self._check(self._attribute(ctypes.byref(value), which, device), "cuDeviceGetAttribute")
            cc.append(value.value)
        self.compute_capability = tuple(cc)
        self._check(self._retain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        self.context = ctx.value
        self.activate()
        return self

    @staticmethod
    def _check(status, call):
        if status != 0:
            raise DeviceError(f"{call} failed with CUDA driver status {status}")

    def activate(self):
        """Make the primary context current on the calling thread."""
        self._check(self._set_current(self.context), "cuCtxSetCurrent")

    def memory_info(self):
        """(free, total) bytes of the device."""
        free, total = ctypes.c_uint64(), ctypes.c_uint64()
        self._check(self._mem_info(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return free.value, total.value

    def staging(self, nbytes):
        """nbytes of page-locked host memory as a numpy uint8 array (freed with the array)."""
        ptr = ctypes.c_uint64()
        self._check(self._host_alloc(ctypes.byref(ptr), max(1, int(nbytes)), 0), "cuMemHostAlloc")
        return np.asarray(_Pinned(self, ptr.value, int(nbytes)))

    def new_stream(self):
        stream = ctypes.c_uint64()
        self._check(self._new_stream(ctypes.byref(stream), STREAM_DEFAULT), "cuStreamCreate")
        return stream.value

    def new_event(self):
        event = ctypes.c_uint64()
        self._check(self._new_event(ctypes.byref(event), EVENT_DISABLE_TIMING), "cuEventCreate")
        return event.value

    def stream_sync(self, stream):
        self._check(self._stream_sync(stream), "cuStreamSynchronize")

    def empty(self, shape, dtype):
        """A DeviceBuffer of this shape and dtype (cuMemAlloc; uninitialised)."""
        shape = tuple(int(n) for n in shape)
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        ptr = ctypes.c_uint64()
        status = self._alloc(ctypes.byref(ptr), max(1, nbytes))
        if status != 0:
            free, total = self.memory_info()
            raise DeviceError(f"cuMemAlloc of {nbytes / 1e9:.2f} GB failed with CUDA driver status {status} "
                              f"({free / 1e9:.1f} of the GPU's {total / 1e9:.1f} GB free)")
        buf = DeviceBuffer(shape, dtype, ptr.value)
        weakref.finalize(buf, self._free, ptr.value).atexit = False   # at exit the driver takes it all back
        return buf

    @staticmethod
    def address(array):
        return array.__cuda_array_interface__["data"][0]


class _Pinned:
    """Page-locked host bytes as a numpy array's base: freed (cuMemFreeHost) when the last array on it goes."""

    def __init__(self, driver, ptr, nbytes):
        self._free, self.ptr = driver._host_free, ptr
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}

    def __del__(self):
        self._free(self.ptr)


class DeviceBuffer:
    """A C-contiguous device array from Driver.empty (or a row range of one), described by
    __cuda_array_interface__ for numba.cuda.as_cuda_array; `owner` keeps the allocation of a view alive."""

    def __init__(self, shape, dtype, ptr, owner=None):
        self.shape, self.dtype, self.ptr, self.owner = tuple(shape), np.dtype(dtype), int(ptr), owner
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False), "version": 3,
                "strides": None}

    def is_c_contiguous(self):
        return True

    def __getitem__(self, rows):
        """A row range (a slice of the first axis, step 1): a view sharing the allocation."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("a DeviceBuffer takes a slice of its rows, step 1")
        start, stop, _ = rows.indices(self.shape[0])
        stop = max(start, stop)
        row_bytes = self.nbytes // self.shape[0] if self.shape[0] else 0
        return DeviceBuffer((stop - start,) + self.shape[1:], self.dtype, self.ptr + start * row_bytes,
                            owner=self.owner or self)


_DRIVER = None
_LOCK = threading.Lock()


def driver(opened=None):
    """The process's Driver (made on first use: cuInit and the primary context); `opened`: a Driver the caller
    opened, to be the process's from now on."""
    global _DRIVER
    with _LOCK:
        if opened is not None and _DRIVER is None:
            _DRIVER = opened
        if _DRIVER is None:
            _DRIVER = Driver()
        return _DRIVER
