"""The VAE encoder's GPU path (CudaImageEncoder: vae.Encoder on the decoder's op table, the downsamplers as tap
products over their input's phases, the patchify and BN normalisation on the device) in the CUDA simulator on
the tiny checkpoint at the smallest picture, 16x16, against the numpy encoder.

Gate: latents relative L2 error against the numpy float32 encoder, measured 5.8e-7, and against float64,
3.0e-7 (the numpy float32 encoder is 4.6e-7 from float64 there); gate 1.5e-6 (the numpy float32 side moves
with the machine's BLAS). Planted control at the stage level: the patchify's (i, j) order swapped in the
device kernel (measured 0.50), asserted to fail the gate by 100x. The kernels' seams
between chunks of rows are the contract's (cuda_kernels.conv: two-row chunks); here one chunk a conv keeps the
run near 30 s.
"""

from sim_util import simulated_lines

GATE = 1.5e-6

SCRIPT = r'''
import numpy as np
from numba import cuda
from cuda_kernels import conv
from moss_cli import vae
from moss_cli.checkpoint import open_checkpoint
from moss_cli.ops import numpy_ops
from moss_cli.gpu.image_encoder import CudaImageEncoder

conv.TAP_BYTES = 1 << 22
comp = open_checkpoint().component("vae")
image = np.random.default_rng(0).uniform(-1, 1, (3, 16, 16)).astype(np.float32)
enc = CudaImageEncoder(comp.tensors, comp.config, graphs=False)
kept = {}
pack = enc.ops.pack_latents


def keeping(z, std, mean):
    kept["args"] = (z, std, mean)
    return pack(z, std, mean)


enc.ops.pack_latents = keeping
got = enc(image)
z, std, mean = kept["args"]
out = cuda.device_array(got.shape[1:], np.float32)
conv.pack_latents(z, std.reshape(std.size), mean.reshape(mean.size), out, control=True)
swapped = out.copy_to_host()[None]


def rel(a, ref):
    return float(np.linalg.norm(np.float64(a) - ref) / np.linalg.norm(ref))


f32 = vae.Encoder(numpy_ops(np.float32), comp.tensors, comp.config)(image)
f64 = vae.Encoder(numpy_ops(np.float64), comp.tensors, comp.config)(image.astype(np.float64))
print("shape", *got.shape, got.dtype)
print("errors", rel(got, f32), rel(got, f64), rel(f32, f64), rel(swapped, f32))
print("splits", enc.ops.late_splits, len(enc.ops._ahead))
'''


def test_gpu_encoder_ops_match_the_numpy_encoder_and_a_swapped_patchify_fails():
    lines = {line.split()[0]: line.split()[1:] for line in simulated_lines(SCRIPT)}
    assert lines["shape"] == ["1", "128", "1", "1", "float32"]
    vs32, vs64, numpy32, swapped = map(float, lines["errors"])
    print(f"relative L2: vs numpy float32 {vs32:.3g}, vs float64 {vs64:.3g} (numpy float32 {numpy32:.3g}); "
          f"patchify swapped {swapped:.3g}")
    assert vs32 <= GATE and vs64 <= GATE
    assert swapped > 100 * GATE
    # every split made ahead on the host thread and used, but quant_conv's mean half (a slice, split when read)
    assert lines["splits"] == ["1", "0"]
