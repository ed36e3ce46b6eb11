"""LoRA merged on the GPU: the base weights go up as they do without adapters, then each weight an adapter touches
is merged where it lies, by lora.py's statement: float32(scale * factor) * up[rows] @ down (cuBLAS, float32), the
adapters' deltas summed in float32 in their order, W' = bf16(W + sum) rounded once (cuda_kernels.lora.merge). The
step graphs are unchanged, so a LoRA costs nothing per step.

Where a weight lies: a resident matrix or its rows of a stack (CudaOps.param / params), or a streamed layer's pinned
host arena (cuda_window), which is sent to the device from the base, merged by the same kernels and copied back into
the arena: the memory plan changes no merged byte. A switch to another adapter set (moss-server) first puts every
weight either set touches back to its base bits, sent again from the checkpoint's memory-mapped base into the same
device memory (the captured graphs keep their addresses; nothing else is kept), then merges the new set. A LoKr
delta (a Kronecker product, not a GEMM) and a weight stored as float32 are made on the host as lora.py makes them.

cuBLAS sums a product's rank terms in its own order and numpy in another, so a weight merged here may differ from
the host merge (lora.merge, the CPU's) in a small fraction of its elements, by one bf16 ulp where the float32 sum
lies at a rounding boundary (tests/gpu/test_lora_gpu.py and scripts/gpu_lora.py count them). Every GPU run merges
the same way: GPU pictures are the same across memory plans, processes and the server's switches.
"""

import time

import numpy as np
from numba import cuda

from cuda_kernels import lora as kernels

from .. import lora
from ..memory.host_weights import is_bf16, stored_form

CHUNK = 1 << 24      # elements of a weight merged at once: the float32 delta and running-sum buffers (64 MB each)


def apply(ops, tensors, names, component, merged, adapters):
    """Merge ADAPTERS (lora.Adapter, in order) into COMPONENT's weights as OPS holds them, uploaded from the base
    TENSORS; NAMES: the graph's weight_names() (a stack as a tuple). MERGED: the adapters merged now, whose weights
    go back to their base bits first. Returns (weights written, seconds)."""
    began = time.perf_counter()
    old, new = lora.uses(merged, component), lora.uses(adapters, component)
    places = _places(ops, tensors, names, set(old) | set(new), component)
    work = _Work(new)
    for name, (target, arena) in places.items():
        base, used = tensors[name], new.get(name, ())
        if not is_bf16(base.dtype) or (arena is not None and not used):   # made on the host
            bits = stored_form(lora.merge_one(base, used) if used else base)
            if arena is not None:
                arena[...] = bits
            else:
                _send(bits, target)
            continue
        if arena is not None:
            target = cuda.to_device(stored_form(base))
        elif name in old:
            _send(stored_form(base), target)
        if used:
            work.merge(target, used)
        if arena is not None:
            target.copy_to_host(arena)
    cuda.synchronize()
    return len(places), time.perf_counter() - began


class _Work:
    """The device buffers of one apply: each layer's factors (sent once, dropped after its last weight) and the
    delta and sum buffers of a chunk."""

    def __init__(self, uses):
        self.left = {}
        for used in uses.values():
            for _, layer, _ in used:
                self.left[id(layer)] = self.left.get(id(layer), 0) + 1
        self.factors = {}
        self.delta = self.total = None

    def merge(self, w, used):
        """The uses of one weight (w, bf16 bits on the device, base bits now) merged into it."""
        rows, cols = w.shape
        step = max(1, CHUNK // cols)
        n = min(rows, step) * cols
        if self.delta is None or self.delta.size < n:
            self.delta = cuda.device_array(n, np.float32)
            self.total = cuda.device_array(n, np.float32)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            size = (r1 - r0) * cols
            chunk = w[r0:r1].reshape(size)
            delta, total = self.delta[:size], self.total[:size]
            for j, (scale, layer, i) in enumerate(used):
                alpha = np.float32(scale * layer.factor)
                if layer.kind == "lora":
                    up, down = self._factors(layer)
                    start = layer.rows(i).start
                    kernels.product(up[start + r0:start + r1], down, delta.reshape(r1 - r0, cols), alpha)
                else:
                    delta.copy_to_device(np.ascontiguousarray(lora.scaled(scale, layer, i)[r0:r1]).reshape(size))
                kernels.merge(chunk, delta, total, j == 0, j == len(used) - 1)
        for _, layer, _ in used:
            self.left[id(layer)] -= 1
            if not self.left[id(layer)]:
                self.factors.pop(id(layer), None)

    def _factors(self, layer):
        """(up, down) on the device as stored (bf16 as its bits, float16, float32), float32 if their types differ."""
        if id(layer) not in self.factors:
            up, down = (np.asarray(layer.parts[k]) for k in ("up", "down"))
            if up.dtype != down.dtype or up.dtype.name not in ("bfloat16", "float16", "float32"):
                up, down = up.astype(np.float32), down.astype(np.float32)
            if is_bf16(up.dtype):
                up, down = up.view(np.uint16), down.view(np.uint16)
            self.factors[id(layer)] = tuple(cuda.to_device(np.ascontiguousarray(x)) for x in (up, down))
        return self.factors[id(layer)]


def _places(ops, tensors, names, touched, component):
    """{name: (device rows, None) or (None, the pinned host rows of a streamed layer)} of each touched weight, in
    the graph's order; each resident one readable (its upload landed)."""
    window = ops.window
    out = {}
    for entry in names:
        parts = entry if isinstance(entry, tuple) else (entry,)
        if not touched.intersection(parts):
            continue
        if window is not None and entry in window.layout:
            layer, offset, (_, cols), counts = window.layout[entry]
            arena = window.host[layer]
            for part, rows in zip(parts, counts):
                if part in touched:
                    out[part] = (None, arena[offset:offset + rows * cols * 2].view(np.uint16).reshape(rows, cols))
                offset += rows * cols * 2
            continue
        weight = ops.params(tensors, entry).weight if isinstance(entry, tuple) else ops.param(tensors, entry)
        row = 0
        for part in parts:
            rows = tensors[part].shape[0]
            if part in touched:
                out[part] = (weight[row:row + rows], None)
            row += rows
    missing = sorted(touched - set(out))
    if missing:
        raise RuntimeError(f"LoRA: {component} weights its GPU graph does not read: {', '.join(missing[:3])}")
    return out


def _send(bits, target):
    """Host bits into a resident weight's device rows through the uploader (queued before later stream 0 work)."""
    from ..memory.upload import uploader
    uploader().to_device(bits, out=target)
