"""A weight's bytes as the GPU op table stores them, made on the host without numba: 2-D matrices as bf16 bits
(uint16; bf16 checkpoints' bits as they are, float ones rounded to nearest even), every other tensor float32
(bf16 widened exactly). CudaOps.param and memory.preload both send these bytes, so a weight handed over at process
start is the weight CudaOps would have made."""

import numpy as np


def is_bf16(dtype):
    return np.dtype(dtype).name == "bfloat16"


def stored_form(value):
    """The host array whose bytes the GPU keeps for a checkpoint tensor (see the module docstring)."""
    host = np.asarray(value)
    if host.ndim == 2:
        if is_bf16(host.dtype):
            return host.view(np.uint16)
        import ml_dtypes
        return np.asarray(host, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    if is_bf16(host.dtype):
        return (np.asarray(host.view(np.uint16), dtype=np.uint32) << 16).view(np.float32)
    return np.asarray(host, dtype=np.float32)


def stack_forms(values, names):
    """The stored forms of a stack's parts (2-D, one width: their rows are stacked into one bf16 matrix)."""
    parts = [stored_form(v) for v in values]
    if any(p.ndim != 2 for p in parts) or len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"{names}: a stack needs 2-D parts of one width")
    return parts


def host_bytes(host, out=None):
    """`host` as the C-contiguous array whose bytes are sent (bf16 as its uint16 bits), checked against `out`:
    None, or a C-contiguous device array (or a test's numpy stand-in) of as many bytes."""
    host = np.asarray(host)
    if is_bf16(host.dtype):
        host = host.view(np.uint16)
    if not host.flags.c_contiguous:
        host = np.ascontiguousarray(host)
    if out is not None:
        contiguous = out.is_c_contiguous() if hasattr(out, "is_c_contiguous") else out.flags.c_contiguous
        if out.size * out.dtype.itemsize != host.nbytes or not contiguous:
            raise ValueError(f"out ({out.dtype} {tuple(out.shape)}) is not a contiguous array of the "
                             f"{host.nbytes} bytes of a {host.dtype} {host.shape} host array")
    return host
