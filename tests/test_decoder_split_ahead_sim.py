"""The decoder's split weights made on a host thread from its construction on (DecoderOps.split_ahead), in the
CUDA simulator on the tiny checkpoint with the kernels skipped: every split the first decode asks for was made
ahead, and each equals, bit for bit, the split of the device weight copied back to the host (the route it
replaces)."""

from sim_util import simulated_lines

SCRIPT = r'''
import sys
import numpy as np
from numba import cuda
sys.path.insert(0, "scripts")
from pool_plan import skip_work
from moss_cli.checkpoint import open_checkpoint
from moss_cli.ops.cuda import conv as cuda_conv
from moss_cli.gpu.decoder import CudaDecoder

skip_work()
vae = open_checkpoint().component("vae")
asked = []
split = cuda_conv.ConvCudaOps._split_weight


def spy(self, w, form="matrix"):
    out = split(self, w, form)
    bits, peak = cuda_conv.split_weight_bits(w.copy_to_host(), form)   # the D2H route
    asked.append(np.array_equal(out[0].copy_to_host(), bits) and out[1].copy_to_host()[0] == peak)
    return out


cuda_conv.ConvCudaOps._split_weight = spy
for ahead in (True, False):
    dec = CudaDecoder(vae.tensors, vae.config, graphs=False, split_ahead=ahead)
    dec._run(cuda.to_device(np.zeros((128, 3, 2), np.float32)))
    print("ahead" if ahead else "asked", len(asked), all(asked), dec.ops.late_splits, len(dec.ops._ahead))
    asked.clear()
'''


def test_the_decoders_splits_are_made_ahead_and_equal_the_device_weights_splits():
    ahead, asked = [line.split() for line in simulated_lines(SCRIPT)]
    n = int(ahead[1])
    assert n >= 10 and ahead == ["ahead", str(n), "True", "0", "0"]     # every split ahead, none left unused
    assert asked == ["asked", str(n), "True", str(n), "0"]              # control: without split_ahead, all late
