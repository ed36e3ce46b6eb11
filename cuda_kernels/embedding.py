"""Embedding gather: rows of a bf16 table (uint16 bits on the device) widened to float32."""

import numpy as np
from numba import cuda

from .core import BLOCK, Case, from_bf16_bits, jit, to_bf16_bits, widen


def _make_embedding(control):
    @jit
    def embedding(table, ids, out):
        t, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        row = t if control else ids[t]
        for i in range(tid, table.shape[1], nt):
            out[t, i] = widen(table[row, i])
    return embedding


_embedding = {c: _make_embedding(c) for c in (False, True)}


def embedding(table, ids, out, stream=0, control=False):
    """out[t] = float32(table[ids[t]]); table uint16 [V, D] bf16 bits, ids int32 [L], out [L, D]."""
    _embedding[control][ids.shape[0], BLOCK, stream](table, ids, out)


def embedding_reference(table_bits, ids):
    return from_bf16_bits(table_bits)[np.asarray(ids)]


def _make(rng, size):
    vocab, d, n = (20, 40, 5) if size == "tiny" else (32768, 4096, 1000)
    return {"table": to_bf16_bits(rng.standard_normal((vocab, d))),
            "ids": rng.integers(0, vocab, n).astype(np.int32)}


def _run(inp, control):
    table, ids = cuda.to_device(inp["table"]), cuda.to_device(inp["ids"])
    out = cuda.device_array((inp["ids"].size, inp["table"].shape[1]), np.float32)
    embedding(table, ids, out, control=control)
    return out.copy_to_host()


def _ref(inp):
    # widening bf16 to float32 is exact
    ref = embedding_reference(inp["table"], inp["ids"])
    return ref, np.zeros_like(ref)


CASES = [Case("embedding", _make, _run, _ref, notes="control: gathers row t instead of row ids[t]")]
