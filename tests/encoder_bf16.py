"""The GPU encoder's bf16 roundings stated on the CPU, to derive the tiny GPU encoder test's gate.

The CUDA op table (moss_cli/ops/cuda/table.py) computes in float32 with bf16 weights, and rounds to bf16
(unit roundoff u = 2^-8) at these points: every linear's input (the tensor-core operand), the outputs of the
products that only feed elementwise kernels (`narrow=True`: the MLP's gate and up, with narrow_products on),
and flash attention's q, k and v. `Bf16Roundings` is the float64 numpy table with exactly those roundings
and nothing else, so the error of its rows against float64 rows is what those roundings cost after the
network's amplification (on the tiny random checkpoint a single u grows to a few percent of the rows).
Measured with the tiny checkpoint: 0.0248 at L = 5, 0.0471 at L = 70 (relative Frobenius error); the GPU
measured 0.0224 and 0.0509 against the CPU float32 rows (results/h200/tests_gpu-4457221.txt), within 10% of
that. The gate is GATE_FACTOR = 2 times the stated error at each prompt length: room for what the statement
leaves out (bf16 probabilities inside flash attention, TF32 chunks of the delta rule, float32 accumulation
order), and below what removing RoPE does (0.103 at L = 5, 0.159 at L = 70), the planted control.
"""

import ml_dtypes
import numpy as np

from moss_cli.encoder import rope_tables as _rope_tables
from moss_cli.ops.numpy.table import NumpyOps

GATE_FACTOR = 2.0


def bf16(x):
    return np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float64)


class Bf16Roundings(NumpyOps):
    """float64 numpy ops that round where the GPU table rounds to bf16."""

    def __init__(self):
        super().__init__(np.float64)

    def linear(self, x, w, b=None, residual=None, narrow=False):
        y = super().linear(bf16(x), w, b, residual)
        return bf16(y) if narrow and residual is None else y

    def linears(self, x, ws, narrow=False):
        return [self.linear(x, w, narrow=narrow) for w in ws]

    def attention(self, q, k, v, scale, causal=False):
        return super().attention(bf16(q), bf16(k), bf16(v), scale, causal)


def relative(rows, ref):
    return float(np.linalg.norm(np.asarray(rows, np.float64) - ref) / np.linalg.norm(ref))


def float64_rows(component, ids):
    from moss_cli.encoder import Qwen35Encoder
    from moss_cli.ops import numpy_ops
    return Qwen35Encoder(numpy_ops(np.float64), component.tensors, component.config)(ids)


def gate(component, ids, ref=None):
    """(gate, stated bf16 error) for these ids: GATE_FACTOR x the Bf16Roundings rows' error vs float64."""
    from moss_cli.encoder import Qwen35Encoder
    ref = float64_rows(component, ids) if ref is None else ref
    stated = relative(Qwen35Encoder(Bf16Roundings(), component.tensors, component.config)(ids), ref)
    return GATE_FACTOR * stated, stated


def without_rope(length, config):
    """The planted RoPE bug: cos = 1, sin = 0 tables (no rotation), for moss_cli.encoder.rope_tables."""
    cos, sin = _rope_tables(length, config)
    return np.ones_like(cos), np.zeros_like(sin)
