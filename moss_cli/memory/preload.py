"""Weights on their way to the GPU from a process's first second: the upload lanes started before the kernel
library is imported.

A GPU process spends close to a second importing numba.cuda, nvmath and cuDNN's frontend and making the CUDA
context before its first op table exists, and until then no weight moved. `start(component)` runs as soon as the
checkpoint is open: it takes the CUDA context through the driver itself (memory.driver, ctypes), allocates every
weight the component's GPU graph reads (a stack as one allocation, its parts in order) and hands each to the
process's lanes (memory.lanes.process_lanes) in the order the first pass reads them, then returns; the copies run
while the kernel library is imported. CudaOps then `take`s each weight instead of sending it again: the same
bytes (memory.host_weights.stored_form), the same future (its copies queued, so later stream 0 work reads them).

    start(checkpoint.component("text_encoder"))     # returns at once
    ...                                              # import the kernel library, make the op tables
    handed = take(tensors, name)                     # (device buffer, future) or None; once per weight
"""

import threading

import numpy as np

from .driver import DeviceBuffer
from .lanes import ALIGN, process_lanes
from .host_weights import stack_forms, stored_form
from .plan import streamed_name

_HANDED = {}          # (id(tensors), name or tuple of names) -> (tensors, device buffer, future, bytes)
MARKS = {}            # the last preload's time.perf_counter() marks (stages.preload_gpu_weights writes them)
_LOCK = threading.Lock()


def weight_names(component):
    """The names (a tuple: one stack) a component's GPU graph reads, in its first pass's order; the tensors
    the graph reads from the host (the encoder's token embedding table) are not among them."""
    if component.name == "text_encoder":
        from ..encoder import Qwen35Encoder
        return Qwen35Encoder(None, component.tensors, component.config).weight_names()
    if component.name == "transformer":
        from ..transformer import MossTransformer
        return MossTransformer(None, component.tensors, component.config).weight_names()
    raise ValueError(f"no early load for component {component.name!r}")


def start(component, uploader=None, streamed=()):
    """Allocate and hand over every weight of `component` (see the module docstring); returns the bytes handed.
    `uploader`: the lanes to use (a test's), else the process's. The weights share one device allocation
    (each at an ALIGN boundary), so the hand-over makes one driver allocation, not one a weight. `streamed`: the
    layers the memory plan streams, whose matrices stay on the host (memory.window)."""
    up = uploader or process_lanes()
    tensors = component.tensors
    plan, total = [], 0
    for name in weight_names(component):
        if streamed and streamed_name(name, tensors, streamed):
            continue
        with _LOCK:
            if (id(tensors), name) in _HANDED:
                continue
        if isinstance(name, tuple):
            parts = stack_forms([tensors[n] for n in name], name)
            shape, dtype = (sum(p.shape[0] for p in parts), parts[0].shape[1]), parts[0].dtype
        else:
            parts = [stored_form(tensors[name])]
            shape, dtype = parts[0].shape, parts[0].dtype
        plan.append((name, parts, shape, dtype, total))
        total += -(-int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize // ALIGN) * ALIGN
    if not plan:
        return 0
    arena = up.empty((total,), np.uint8)
    handed = 0
    for name, parts, shape, dtype, offset in plan:
        out = _view(arena, offset, shape, dtype)
        if len(parts) == 1:
            _, queued = up.to_device_later(parts[0], out=out)
        else:
            row = 0
            for part in parts:           # the lanes queue one array's pieces in order: the last future stands
                _, queued = up.to_device_later(part, out=out[row:row + part.shape[0]])
                row += part.shape[0]
        with _LOCK:
            _HANDED[(id(tensors), name)] = (tensors, out, queued, out.nbytes)
        handed += out.nbytes
    return handed


def _view(arena, offset, shape, dtype):
    """An array of `shape` and `dtype` at `offset` bytes into the arena: a memory.driver.DeviceBuffer that keeps the
    arena alive, or (a test's fake driver) a numpy view."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if isinstance(arena, np.ndarray):
        return arena[offset:offset + nbytes].view(dtype).reshape(shape)
    return DeviceBuffer(shape, dtype, arena.ptr + offset, owner=arena)


def take(tensors, name):
    """(device buffer, future) of a weight `start` handed over for this tensors mapping, removed from the record;
    None when it was not handed over."""
    with _LOCK:
        entry = _HANDED.pop((id(tensors), name), None)
    return None if entry is None else entry[1:3]


def handed_bytes(tensors):
    """Device bytes allocated for this tensors mapping's weights not yet taken."""
    with _LOCK:
        return sum(entry[3] for key, entry in _HANDED.items() if key[0] == id(tensors))


def discard(uploader=None):
    """Wait for every copy (of `uploader`, else the process's lanes), then drop the weights not taken (their
    device memory is freed with them)."""
    with _LOCK:
        pending = bool(_HANDED)
    if pending:
        (uploader or process_lanes()).finish()
    with _LOCK:
        _HANDED.clear()
