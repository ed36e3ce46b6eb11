"""The CUDA op table's data-movement and elementwise logic (slices, broadcasts, norms over 3-D arrays,
RoPE, the GDN ops, the DiT's ops, the bf16 embedding, flash attention) equals the float64 numpy table, run in
the CUDA simulator.

The cuBLAS products (linear, the "products" attention) are checked on the GPU (tests/gpu)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

SCRIPT = r'''
import numpy as np
import ml_dtypes
from moss_cli.ops import numpy_ops
from moss_cli.ops.cuda import table as cuda_table
from moss_cli.ops.cuda.table import CudaOps
from cuda_kernels.core import from_bf16_bits

rng = np.random.default_rng(0)
gpu = CudaOps()


class Float64Ops:
    """The float64 numpy table, fed float64 copies of the float32 inputs."""
    table = numpy_ops(np.float64)

    def __getattr__(self, name):
        def wide(a):
            if isinstance(a, list):
                return [wide(b) for b in a]
            return a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype == np.float32 else a
        return lambda *args, **kw: getattr(self.table, name)(*[wide(a) for a in args], **kw)


ref = Float64Ops()


def r(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def check(name, got, want, tol=2e-6):
    got = gpu.host(got)
    got = from_bf16_bits(got) if got.dtype == np.uint16 else got.astype(np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= tol, (name, err)
    print("ok", name, f"{err:.1e}")


x3, z3 = r(3, 4, 8), r(3, 4, 8)
w8 = r(8)
x2 = r(3, 24)
row = r(24)
d = lambda a: gpu.array(a)
check("slice axis 2", gpu.slice(d(x3), 2, 2, 6), ref.slice(x3, 2, 2, 6))
check("slice axis 1", gpu.slice(d(x2), 1, 8, 16), ref.slice(x2, 1, 8, 16))
check("transpose", gpu.transpose(d(x3), (1, 0, 2)), ref.transpose(x3, (1, 0, 2)))
check("concat", gpu.concat([d(x3), d(z3)], axis=1), ref.concat([x3, z3], axis=1))
check("reshape", gpu.reshape(d(x3), (12, 8)), ref.reshape(x3, (12, 8)))
check("add row", gpu.add(d(x2), d(row)), ref.add(x2, row))
check("mul row first", gpu.mul(d(row), d(x2)), ref.mul(row, x2))
check("sub", gpu.sub(d(x2), d(x2[::-1].copy())), ref.sub(x2, x2[::-1]))
check("scale", gpu.scale(d(x2), -0.5), ref.scale(x2, -0.5))
for op in ("sigmoid", "silu", "tanh", "exp", "softplus"):
    check(op, getattr(gpu, op)(d(x2 * 8)), getattr(ref, op)(x2 * 8), 1e-5)
check("rms_norm 3-D", gpu.rms_norm(d(x3), d(w8), 1e-6, offset=1.0), ref.rms_norm(x3, w8, 1e-6, offset=1.0), 1e-5)
check("l2_norm", gpu.l2_norm(d(x3), 1e-6), ref.l2_norm(x3, 1e-6), 1e-5)
check("gated_rms_norm", gpu.gated_rms_norm(d(x3), d(z3), d(w8), 1e-6), ref.gated_rms_norm(x3, z3, w8, 1e-6), 1e-5)
cos, sin = np.cos(r(3, 2)), np.sin(r(3, 2))
check("rope", gpu.rope(d(x3), d(cos), d(sin)), ref.rope(x3, cos, sin), 1e-5)
cw = r(24, 4)
check("causal_conv1d", gpu.causal_conv1d(d(x2), d(cw)), ref.causal_conv1d(x2, cw), 1e-5)
q = r(6, 2, 8) * 0.3
k = r(6, 2, 8)
k /= np.linalg.norm(k, axis=-1, keepdims=True)
v, g, beta = r(6, 4, 4), -np.abs(r(6, 4)), 1 / (1 + np.exp(-r(6, 4)))
check("gated_delta_rule recurrent", gpu.gated_delta_rule(d(q), d(k), d(v), d(g), d(beta), form="recurrent"),
      ref.gated_delta_rule(q, k, v, g, beta, form="recurrent"), 1e-5)
gpu.chunk_from = 0        # the chunked form: products from TF32 inputs (2^-10)
check("gated_delta_rule chunked tf32", gpu.gated_delta_rule(d(q), d(k), d(v), d(g), d(beta)),
      ref.gated_delta_rule(q, k, v, g, beta, form="recurrent"), 2 ** -8)
gpu.chunk_from = cuda_table.CHUNK_FROM
# the fused ops; "operand" results are bf16 bits (relative error up to 2^-8)
check("rms_norm operand", gpu.rms_norm(d(x3), d(w8), 1e-6, offset=1.0, operand=True),
      ref.rms_norm(x3, w8, 1e-6, offset=1.0), 2 ** -8)
wide = d(np.concatenate([x2, x2 * 4, row[None].repeat(3, 0)], axis=1))
gate, up = wide[:, 24:48], wide[:, 48:72]        # column blocks, as a stacked product leaves them
check("swiglu", gpu.swiglu(gate, up), ref.swiglu(x2 * 4, np.broadcast_to(row, (3, 24))), 1e-5)
check("swiglu operand", gpu.swiglu(gate, up, operand=True), ref.swiglu(x2 * 4, np.broadcast_to(row, (3, 24))),
      2 ** -8)
check("reshape of a column block", gpu.reshape(gate, (3, 3, 8)), (x2 * 4).reshape(3, 3, 8))
check("l2_norm scaled", gpu.l2_norm(d(x3), 1e-6, scale=0.3), ref.l2_norm(x3, 1e-6, scale=0.3), 1e-5)
zw = gpu.reshape(d(np.concatenate([x2, z3.reshape(3, 32)], axis=1))[:, 24:], (3, 4, 8))
check("gated_rms_norm strided z operand", gpu.gated_rms_norm(d(x3), zw, d(w8), 1e-6, operand=True),
      ref.gated_rms_norm(x3, z3, w8, 1e-6), 2 ** -8)
qs, ks = gpu.split(d(x2), (8, 16))
check("split", ks, ref.split(x2, (8, 16))[1])
check("l2_norm of split heads", gpu.l2_norm(gpu.reshape(ks, (3, 2, 8)), 1e-6, scale=0.5),
      ref.l2_norm(x2[:, 8:].reshape(3, 2, 8), 1e-6, scale=0.5), 1e-5)
q4, g4 = gpu.split(d(np.concatenate([x3, z3], axis=2)), (8, 8))     # [query | gate] per head
check("rms_norm of split heads", gpu.rms_norm(q4, d(w8), 1e-6, offset=1.0), ref.rms_norm(x3, w8, 1e-6, offset=1.0),
      1e-5)
check("sigmoid_gate operand", gpu.sigmoid_gate(d(x3), g4, operand=True), ref.sigmoid_gate(x3, z3), 2 ** -8)
ab = r(3, 11) * 8
a_log, dt_bias = np.log(np.abs(r(4)) + 1), r(4)
got = gpu.gdn_gates(d(ab)[:, 1:5], d(ab)[:, 5:9], d(a_log), d(dt_bias))
want = ref.gdn_gates(ab[:, 1:5], ab[:, 5:9], a_log, dt_bias)
check("gdn_gates g", got[0], want[0], 1e-5)
check("gdn_gates beta", got[1], want[1], 1e-5)
check("causal_conv1d silu, strided x", gpu.causal_conv1d(wide[:, 24:48], d(cw), activate=True),
      ref.causal_conv1d(x2 * 4, cw, activate=True), 1e-5)
gpu.attention_form = "flash"      # bf16 q, k, v and probabilities on the tensor cores' statement
qa, kva = r(6, 4, 16), d(r(6, 64))
ka, va = gpu.reshape(kva[:, :32], (6, 2, 16)), gpu.reshape(kva[:, 32:], (6, 2, 16))
check("attention flash, strided k v", gpu.attention(d(qa), ka, va, 0.25, causal=True),
      ref.attention(qa, gpu.host(ka), gpu.host(va), 0.25, causal=True), 2 ** -6)
gpu.attention_form = "products"
xr, wr = r(3, 2, 32), r(32)           # rows of 32 with 8 rotated pairs: the fused kernel's registers hold both
cr, sr = np.cos(r(3, 8)), np.sin(r(3, 8))
check("rms_norm_rope fused", gpu.rms_norm_rope(d(xr), d(wr), d(cr), d(sr), 1e-6, offset=1.0),
      ref.rms_norm_rope(xr, wr, cr, sr, 1e-6, offset=1.0), 1e-5)
check("rms_norm_rope apart", gpu.rms_norm_rope(d(x3), d(w8), d(cos), d(sin), 1e-6, offset=1.0),
      ref.rms_norm_rope(x3, w8, cos, sin, 1e-6, offset=1.0), 1e-5)
full = r(5, 26) * 2                   # [q | k | v] channels of heads (1, 8, 1, 8), then a and b, as in_proj leaves them
a_log1, dt1 = np.log(np.abs(r(1)) + 1), r(1)
want = ref.gdn_inputs(full[:, :24], cw, full[:, 24:25], full[:, 25:26], a_log1, dt1, (1, 8, 1, 8), 1e-6)
for fused in (True, False):
    gpu.fuse_gdn_inputs = fused
    wide5 = d(full)
    got = gpu.gdn_inputs(wide5[:, :24], d(cw), wide5[:, 24:25], wide5[:, 25:26], d(a_log1), d(dt1), (1, 8, 1, 8), 1e-6)
    for name, gv, wv in zip(("q", "k", "v", "g", "beta"), got, want):
        check(f"gdn_inputs {name}, fused={fused}", gv, wv, 1e-5)
table = r(10, 8).astype(ml_dtypes.bfloat16)
ids = np.array([3, 0, 9, 3])
check("embedding bf16", gpu.embedding(table, ids), ref.embedding(table, ids), 0)
wide_table = r(10, 8)                  # a float32 table: its rows rounded to bf16 on the way (as the params are)
check("embedding float32 table", gpu.embedding(wide_table, ids),
      ref.embedding(wide_table.astype(ml_dtypes.bfloat16), ids), 0)
dst = np.zeros((4, 8), np.uint16)
from numba import cuda
assert cuda_table.table_rows(table, ids, out=dst) is dst and (dst == table.view(np.uint16)[ids]).all()
for wrong in (table.view(np.uint16), cuda.to_device(table.view(np.uint16))):   # bits as numbers; on the device
    try:
        cuda_table.table_rows(wrong, ids)
        raise AssertionError("table_rows read a table it must refuse")
    except TypeError:
        pass
# the DiT's ops (cuda_dit): bf16 operands and heads out, the float32 stream updated in place
from numba import cuda
from cuda_kernels.core import to_bf16_bits
bits = cuda.to_device                           # bf16 bits as they are (d() makes float32 arrays)
xd, wd = r(5, 32) * 2, r(32)
shd, scd, gtd = r(1, 32) * 0.5, r(1, 32) * 0.5, r(1, 32) * 0.3
check("norm_modulate", gpu.norm_modulate(d(xd), d(wd), 1e-6, d(shd), d(scd)),
      ref.norm_modulate(xd, wd, 1e-6, shd, scd), 2 ** -8)
ubits = to_bf16_bits(r(5, 32))
xg, yg = gpu.residual_norm_modulate(d(xd), bits(ubits), d(gtd), d(wd), 1e-6, d(shd), d(scd))
xw, yw = ref.residual_norm_modulate(xd, from_bf16_bits(ubits), gtd, wd, 1e-6, shd, scd)
check("residual_norm_modulate stream", xg, xw, 1e-6)
check("residual_norm_modulate operand", yg, yw, 2 ** -8)
both = to_bf16_bits(r(3, 16) * 3)
hid, gat = gpu.split(bits(both), (8, 8))
check("situ of a product's halves", gpu.situ(hid, gat), ref.situ(from_bf16_bits(both)[:, :8], from_bf16_bits(both)[:, 8:]),
      2 ** -8)
qkv = to_bf16_bits(r(3, 96))                    # [q | k | v] of 2 heads of 16
qd, kd, _ = gpu.split(bits(qkv), (32, 32, 32))
wq, wk, cq, sq = r(16), r(16), np.cos(r(3, 8)), np.sin(r(3, 8))
qg, kg = gpu.qk_norm_rope(gpu.reshape(qd, (3, 2, 16)), gpu.reshape(kd, (3, 2, 16)), d(wq), d(wk), d(cq), d(sq), 1e-6)
wide64 = from_bf16_bits(qkv)
qw, kw = ref.qk_norm_rope(wide64[:, :32].reshape(3, 2, 16), wide64[:, 32:64].reshape(3, 2, 16), wq, wk, cq, sq, 1e-6)
check("qk_norm_rope q", qg, qw, 2 ** -8)
check("qk_norm_rope k", kg, kw, 2 ** -8)
# the decoder's ops (cuda_conv): split fp16 products, group norm with silu in its pass, a conv's residual
xc, wc, bc = r(5, 3, 4), r(3, 5, 3, 3) / 6, r(3)
rc = r(3, 3, 4)
check("conv2d 3x3 + residual", gpu.conv2d(d(xc), d(wc), d(bc), 1, residual=d(rc)),
      ref.conv2d(xc, wc, bc, 1, residual=rc), 1e-5)
check("conv2d 3x3 of an upsampling", gpu.conv2d(gpu.upsample_nearest2x(d(xc)), d(wc), d(bc), 1),
      ref.conv2d(ref.upsample_nearest2x(xc), wc, bc, 1), 1e-5)
check("conv2d 1x1 of an upsampling", gpu.conv2d(gpu.upsample_nearest2x(d(xc)), d(wc[:, :, :1, :1].copy()), None, 0),
      ref.conv2d(ref.upsample_nearest2x(xc), wc[:, :, :1, :1], None, 0), 1e-5)
xn, gw, gb = r(8, 3, 4) * 2 + 5, 1 + r(8) * 0.3, r(8) * 0.3
wn = r(3, 8, 3, 3) / 8       # a conv over silu(group_norm(x)), made in the conv's reads on the GPU
check("conv2d of group_norm_silu", gpu.conv2d(gpu.group_norm_silu(d(xn), 4, d(gw), d(gb), 1e-6), d(wn), d(bc), 1),
      ref.conv2d(ref.group_norm_silu(xn, 4, gw, gb, 1e-6), wn, bc, 1), 1e-5)
# the VAE encoder's: the stride-2 downsampling (two-row chunks of its input's phases), the patchify + BN
xd, wd = r(5, 6, 8), r(3, 5, 3, 3) / 6
check("downsample_conv", gpu.downsample_conv(d(xd), d(wd), d(bc)), ref.downsample_conv(xd, wd, bc), 1e-5)
zp, sp, mp = r(32, 4, 6), (1 + rng.random(128)).astype(np.float32), r(128)
packed = np.transpose(zp.reshape(32, 2, 2, 3, 2), (0, 2, 4, 1, 3)).reshape(128, 2, 3)
check("pack_latents", gpu.pack_latents(d(zp), d(sp[:, None, None]), d(mp[:, None, None])),
      (packed.astype(np.float64) - mp[:, None, None]) / sp[:, None, None], 2 ** -22)
# control: a peak bound 64x too small (the statistics' bound with rstd applied twice, at a std of 8) overflows
# the split's fp16 and the same check fails
from cuda_kernels import conv as conv_kernels
real_stats = conv_kernels.group_stats
def shrunk_stats(*args, **kwargs):
    out = real_stats(*args, **kwargs)
    if kwargs.get("peak") is not None:
        kwargs["peak"].copy_to_device(kwargs["peak"].copy_to_host() / 64)
    return out
conv_kernels.group_stats = shrunk_stats
try:
    check("conv2d of group_norm_silu, its peak 64x too small", gpu.conv2d(gpu.group_norm_silu(d(xn), 4, d(gw), d(gb), 1e-6),
          d(wn), d(bc), 1), ref.conv2d(ref.group_norm_silu(xn, 4, gw, gb, 1e-6), wn, bc, 1), 1e-5)
except AssertionError:
    print("ok a peak too small is caught")
else:
    raise AssertionError("a peak 64x too small passed the conv's check")
finally:
    conv_kernels.group_stats = real_stats
print("all ops equal")
'''


def test_cuda_op_table_matches_the_numpy_table_in_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "all ops equal" in done.stdout
