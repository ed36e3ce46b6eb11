"""Layers whose matrices stay on the host (the memory plan's streamed layers), read through a device window.

Each streamed layer's 2-D matrices and stacks are laid out in one pinned host arena, in the order its ops ask
for them, and copied whole into one of SLOTS device slots just before the layer's first op. The ops, their
order and the bytes each product reads are the resident model's: only the weights' addresses differ, so a
streamed model gives the same outputs.

A graph's pass is first run eagerly (gpu.capture.planned_capture): there each layer is copied on the compute
stream itself when its first weight is asked for, and the order of the layers is recorded. The capture then
copies layer t+1 on a side stream while layer t computes, into the slot layer t-1 used, after layer t-1's
ops (events): inside the graph the copies overlap the compute, and every copy is waited for before the
graph's end.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import cuda

from cuda_kernels.core import SIMULATED

from .host_weights import stack_forms, stored_form
from .plan import SLOTS, layer_of, streamed_name

ALIGN = 256


def _side_stream():
    """(numba's view of a non-blocking stream for the copies, the object that owns the stream): the owner must
    live as long as the view, or the stream is destroyed under it (the simulator's own stream there)."""
    if SIMULATED:
        stream = cuda.stream()
        return stream, stream
    from cuda.core import Device, StreamOptions
    from ..ops.cuda.table import numba_stream
    owner = Device().create_stream(options=StreamOptions(nonblocking=True))
    return numba_stream(owner), owner


class Window:
    """The streamed layers of one tensors mapping: their host arenas, the device slots, the copy schedule."""

    def __init__(self, tensors, names, layers, slots=SLOTS):
        self.tensors = tensors
        self.layers = frozenset(layers)
        self.layout = {}          # name (or tuple of names) -> (layer, offset, shape, row counts)
        arenas = {}               # layer -> [(offset, parts)]
        size = {}
        for name in names:
            if not streamed_name(name, tensors, self.layers):
                continue          # vectors stay resident: a few kilobytes a layer
            layer = layer_of(name[0] if isinstance(name, tuple) else name)
            parts = stack_forms([tensors[n] for n in name], name) if isinstance(name, tuple) \
                else [stored_form(tensors[name])]
            shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
            offset = size.get(layer, 0)
            self.layout[name] = (layer, offset, shape, tuple(p.shape[0] for p in parts))
            arenas.setdefault(layer, []).append((offset, parts))
            size[layer] = offset + -(-shape[0] * shape[1] * 2 // ALIGN) * ALIGN
        self.bytes = dict(size)
        self.host = {layer: cuda.pinned_array(n, np.uint8) for layer, n in size.items()}
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="window") as pool:
            list(pool.map(lambda item: self._fill(*item), arenas.items()))
        slot = max(size.values(), default=0)
        self.slots = [cuda.device_array(slot, np.uint8) for _ in range(slots if size else 0)]
        self._views = {}
        self._layer = None        # the layer whose weights the current slot holds
        self._t = -1              # uses of streamed layers so far in this pass
        self._uses = None         # the pass's layer order while capturing with prefetch, else None
        self._copied = {}
        self._side = self._side_owner = None
        self.recorded = []

    def _fill(self, layer, items):
        arena = self.host[layer]
        for offset, parts in items:
            for part in parts:
                n = part.nbytes
                arena[offset:offset + n] = np.ascontiguousarray(part).view(np.uint8).reshape(-1)
                offset += n

    @property
    def host_bytes(self):
        return sum(self.bytes.values())

    # --- lookups (CudaOps.param / params) -------------------------------------------------------------
    def view(self, tensors, name, ops):
        """(device array, row counts) of a streamed matrix or stack in the slot its layer is in now, copying the
        layer there first when the pass moves to it; None for a resident weight."""
        if tensors is not self.tensors:
            return None
        entry = self.layout.get(name)
        if entry is None:
            return None
        layer, offset, shape, rows = entry
        if layer != self._layer:
            self._enter(layer, ops)
        slot = self._t % len(self.slots)
        key = (slot, name)
        if key not in self._views:
            n = shape[0] * shape[1] * 2
            self._views[key] = self.slots[slot][offset:offset + n].view(np.uint16).reshape(shape)
        return self._views[key], rows

    def _enter(self, layer, ops):
        self._t += 1
        self._layer = layer
        t, queue = self._t, ops._numba_stream()
        if self._uses is None:          # eager: copied in stream order, the order recorded for the capture
            self.recorded.append(layer)
            self._copy(layer, t, queue)
            return
        if t >= len(self._uses) or self._uses[t] != layer:
            raise RuntimeError(f"streamed layers: the pass asked for layer {layer} as its use {t}, where its eager "
                               f"pass had {self._uses[t] if t < len(self._uses) else 'none'}")
        self._copied.pop(t).wait(queue)
        if t + 1 < len(self._uses):     # the next layer into the other slot once this slot's last user is done
            free = self._event(ops)
            free.record(queue)
            free.wait(self._side)
            self._copy(self._uses[t + 1], t + 1, self._side)
            self._copied[t + 1] = done = self._event(ops)
            done.record(self._side)

    def _copy(self, layer, t, stream):
        host = self.host[layer]
        self.slots[t % len(self.slots)][:host.size].copy_to_device(host, stream=stream)

    def _event(self, ops):
        event = cuda.event() if SIMULATED else cuda.event(timing=False)
        if ops.capturing:
            ops.kept.append(event)       # a graph's event nodes refer to it
        return event

    # --- a pass -----------------------------------------------------------------------------------------
    def begin(self, ops, uses=None):
        """Start a pass: `uses` the layer order its eager pass recorded (copies prefetched on a side stream),
        or None (each layer copied on the compute stream when asked, the order recorded)."""
        self._t, self._layer, self._uses, self.recorded = -1, None, uses, []
        self._copied = {}
        if not uses:
            self._uses = None if uses is None else []
            return
        if self._side is None:
            self._side, self._side_owner = _side_stream()
        fork = self._event(ops)
        fork.record(ops._numba_stream())
        fork.wait(self._side)
        self._copy(uses[0], 0, self._side)
        self._copied[0] = done = self._event(ops)
        done.record(self._side)

    def finish(self):
        """End a pass; returns the layer order it used. Every prefetched copy must have been waited for."""
        if self._copied:
            raise RuntimeError(f"streamed layers: {len(self._copied)} copies were never waited for "
                               f"(the pass used {self._t + 1} of {len(self._uses or ())} planned layers)")
        order = list(self.recorded) if self._uses is None else list(self._uses)
        self._t, self._layer, self._uses = -1, None, None
        return order
