"""The bf16 bits of the 2-D weights an op table holds, read back on the test's own path (independent of the LoRA
merge's): resident rows (CudaOps.param, or a stack's rows from params) or a streamed layer's pinned arena."""

import numpy as np


def device_bits(ops, tensors, names):
    """{name: bf16 bits} of every 2-D weight of NAMES (a graph's weight_names(), stacks as tuples) as OPS holds it."""
    window, out = ops.window, {}
    for entry in names:
        parts = entry if isinstance(entry, tuple) else (entry,)
        if np.ndim(tensors[parts[0]]) != 2:
            continue
        if window is not None and entry in window.layout:
            layer, offset, (rows, cols), _ = window.layout[entry]
            bits = window.host[layer][offset:offset + rows * cols * 2].view(np.uint16).reshape(rows, cols)
        else:
            held = ops.params(tensors, entry).weight if isinstance(entry, tuple) else ops.param(tensors, entry)
            bits = held.copy_to_host()
        row = 0
        for part in parts:
            out[part] = np.array(bits[row:row + tensors[part].shape[0]])
            row += tensors[part].shape[0]
    return out
