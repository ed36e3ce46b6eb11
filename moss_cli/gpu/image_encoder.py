"""The VAE encoder on the GPU: an image [3, H, W] in [-1, 1] -> packed, BN-normalised latents [1, 128, H/16,
W/16], float32-accurate.

vae.Encoder's graph on the decoder's op table (DecoderOps: every matrix float32, convolutions, projections and
the mid-block attention as split fp16 products); the downsamplers' stride-2 convs as tap products over their
input's 2x2 phases (ops.cuda.conv.downsample_conv). The image's copy in, the encoder, the posterior's mode, the
patchify and the BN normalisation (ops.cuda.conv.pack_latents) are one CUDA graph per image size.
"""

import numpy as np
from numba import cuda

from cuda_kernels.core import SIMULATED

from ..vae import Encoder
from .capture import Graphs
from .decoder import DecoderOps, capture_sized


class EncoderOps(DecoderOps):
    """DecoderOps splitting the VAE encoder's weights ahead (quant_conv's mean half, a slice, when first read)."""

    prefixes = ("encoder.",)


class CudaImageEncoder:
    """CudaImageEncoder(tensors, config)(image float32 [3, H, W]) -> latents float32 [1, 128, H/16, W/16], within
    float32 roundings of vae.Encoder(numpy_ops(), tensors, config)(image). Weights go to the device once;
    `graphs=False` runs the ops eagerly (the simulator's way); the split weights are made on host threads from
    here on (`split_ahead`). The graphs of the KEEP_GRAPHS picture sizes encoded last are kept."""

    KEEP_GRAPHS = 4

    def __init__(self, tensors, config, graphs=True, split_ahead=True):
        self.ops = EncoderOps()
        self.encoder = Encoder(self.ops, tensors, config)
        if tuple(self.encoder.c["patch"]) != (2, 2):
            raise ValueError(f"the GPU encoder packs 2x2 patches, not {self.encoder.c['patch']}")
        self.graphs = graphs and not SIMULATED
        self._captured = Graphs(self.KEEP_GRAPHS)
        if split_ahead:
            self.ops.split_ahead(tensors)

    def _run(self, image):
        """The ops of one encode from a device image [3, H, W]; returns the device latents [128, H/16, W/16]."""
        e = self.encoder
        return self.ops.pack_latents(e.mode(image), e.bn_std, e.bn_mean)

    def __call__(self, image):
        image = np.ascontiguousarray(self.encoder.check(image), dtype=np.float32)
        if not self.graphs:
            return self.ops.host(self._run(cuda.to_device(image)))[None]
        made = self._captured.get(image.shape, lambda: capture_sized(self.ops, self._run, image.shape))
        return made.replay(image)[None]
