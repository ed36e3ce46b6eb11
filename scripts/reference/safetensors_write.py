"""A deterministic safetensors writer (the library's Rust side writes metadata in hash order)."""

import json
import struct

import numpy as np

DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.int32): "I32",
          np.dtype(np.int64): "I64", np.dtype(np.uint8): "U8"}


def dumps(tensors, metadata):
    """Tensors in name order, header JSON with sorted keys, padded with spaces to 8 bytes."""
    header, chunks, offset = {"__metadata__": dict(metadata)}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(chunks)
