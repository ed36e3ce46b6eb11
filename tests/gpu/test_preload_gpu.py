"""The preload on a GPU (stages.preload_gpu_weights: the CUDA driver through ctypes and the upload lanes,
before the kernel library is used): the encoder's and the transformer's op tables take every weight it handed
over (nothing is left, nothing is sent twice), and each equals, bit for bit, the same weight sent late by a
fresh op table; numba reads the driver's buffers in the same context. Control: one byte changed in a preloaded
weight is caught by the same comparison. (tests/gpu/test_cli_gpu.py holds moss-image to the chained commands,
byte for byte; scripts/gpu_same_artifacts.py holds each command to an earlier tree's.)"""

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")
if not cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from moss_cli import stages                                  # noqa: E402
from moss_cli.checkpoint import open_checkpoint              # noqa: E402
from moss_cli.memory import preload as cuda_preload                        # noqa: E402
from moss_cli.gpu.denoiser import CudaDenoiser          # noqa: E402
from moss_cli.ops.cuda.table import CudaOps, Stacked    # noqa: E402
from moss_cli.gpu.encoder import cuda_encoder


def _host(ops, tensors, name):
    held = ops.params(tensors, name) if isinstance(name, tuple) else ops.param(tensors, name)
    return (held.weight if isinstance(held, Stacked) else held).copy_to_host().view(np.uint8)


def test_preloaded_weights_are_taken_once_and_equal_the_late_uploads():
    checkpoint = open_checkpoint()
    handed, _ = stages.preload_gpu_weights(checkpoint, "cuda")
    enc_comp, dit_comp = checkpoint.component("text_encoder"), checkpoint.component("transformer")
    assert handed == cuda_preload.handed_bytes(enc_comp.tensors) + cuda_preload.handed_bytes(dit_comp.tensors) > 0
    enc = cuda_encoder(enc_comp)
    dit = CudaDenoiser(dit_comp.tensors, dit_comp.config)
    dit.upload()
    assert cuda_preload.handed_bytes(enc_comp.tensors) == cuda_preload.handed_bytes(dit_comp.tensors) == 0
    checked = 0
    for comp, ops, names in ((enc_comp, enc.ops, enc.model.weight_names()),
                             (dit_comp, dit.ops, dit.model.weight_names())):
        late, copy = CudaOps(), dict(comp.tensors)          # another mapping: nothing preloaded for it
        for name in names:
            assert np.array_equal(_host(ops, comp.tensors, name), _host(late, copy, name)), name
            checked += 1
    assert checked == len(enc.model.weight_names()) + len(dit.model.weight_names())
    # control: one byte of a preloaded weight changed on the device
    name = dit.model.weight_names()[-1]
    weight = dit.ops.param(dit_comp.tensors, name)
    bits = weight.copy_to_host()
    bits.reshape(-1)[0] ^= 1
    weight.copy_to_device(bits)
    assert not np.array_equal(_host(dit.ops, dit_comp.tensors, name), _host(CudaOps(), dict(dit_comp.tensors), name))
