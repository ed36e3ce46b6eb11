"""On a GPU: the decoder's graph made on a host thread while the DiT's step graphs replay (a capture thrown
away plans its blocks, nothing of it runs on the GPU: CudaDecoder.graph_maker, CudaDenoiser.sample's
`beside`) changes no byte: the latents equal those of a trajectory with nothing beside it, and the pixels
those of the decoder's own eager pass and capture.

What makes that safe is that the graph's making writes nothing on the GPU, where the pool's free blocks are
the DiT's (the two share them, memory.pool): every free block is filled with a pattern first, and after the
making each still holds it. The planted control is the bug the dry pass exists to avoid, the eager pass
(capture_sized without `dry`), which the same check catches."""

import numpy as np
import pytest

import cuda_kernels

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")

H, W = 8, 8          # latent tokens: a 128x128 picture
STEPS = 6


@pytest.fixture(scope="module")
def checkpoint():
    from moss_cli.checkpoint import open_checkpoint
    return open_checkpoint()


def _trajectory(checkpoint, beside_of):
    """(latents, the decoder, its pixels of those latents, the denoiser's timings): the tiny checkpoint's DiT
    and decoder made fresh, `beside_of(decoder)` the function run beside the steps (or None)."""
    from moss_cli.gpu.decoder import CudaDecoder
    from moss_cli.gpu.denoiser import CudaDenoiser
    from moss_cli.schedule import sigmas
    comp, vae = checkpoint.component("transformer"), checkpoint.component("vae")
    dit = CudaDenoiser(comp.tensors, comp.config)
    dit.upload()
    decoder = CudaDecoder(vae.tensors, vae.config)
    rng = np.random.default_rng(7)
    cond = dit.prepare_text(rng.standard_normal((7, 32)).astype(np.float32))
    uncond = dit.prepare_text(rng.standard_normal((5, 32)).astype(np.float32))
    noise = rng.standard_normal((1, 128, H, W)).astype(np.float32)
    out = dit.sample(noise, sigmas(STEPS, shift=3.0), cond, uncond, 3.0, beside=beside_of(decoder))
    return out, decoder, decoder.decode(out), dit.timings


def test_the_decoder_graph_made_beside_the_steps_changes_no_byte(checkpoint):
    plain, _, plain_pixels, _ = _trajectory(checkpoint, lambda d: None)
    lat, decoder, pixels, timings = _trajectory(checkpoint, lambda d: d.graph_maker((1, 128, H, W)))
    assert decoder.beside_error is None and decoder.made_beside == 1 and "beside_s" in timings
    assert lat.tobytes() == plain.tobytes()
    assert pixels.tobytes() == plain_pixels.tobytes()
    print(f"\nbeside the steps: {timings['beside_s']:.3f} s of host work, {timings['beside_wait_s']:.3f} s waited")


def _free_blocks_kept(make):
    """Whether every block free in the shared pool before make() still holds the pattern written into it."""
    from numba import cuda
    from cuda_kernels.core import DeviceView
    from moss_cli.ops.cuda.table import shared_pool
    pool = shared_pool()
    views = [cuda.as_cuda_array(DeviceView(block.base, (nbytes,), None, "|u1"), sync=False)
             for nbytes, _, block in list(pool._free)]
    assert sum(v.size for v in views) > 1 << 20, "the DiT's run left the pool's blocks to test"
    for v in views:
        v.copy_to_device(np.full(v.size, 0xA5, np.uint8))
    cuda.synchronize()
    make()
    cuda.synchronize()
    return all(bool(np.all(v.copy_to_host() == 0xA5)) for v in views)


def test_making_the_graph_writes_no_free_block_and_an_eager_pass_is_caught(checkpoint):
    from moss_cli.gpu.decoder import CudaDecoder, capture_sized
    _trajectory(checkpoint, lambda d: None)          # the pool holds the DiT's and a decoder's blocks, free
    vae = checkpoint.component("vae")
    dry = CudaDecoder(vae.tensors, vae.config)
    assert _free_blocks_kept(dry.graph_maker((1, 128, H + 2, W)))
    assert dry.beside_error is None and dry.made_beside == 1
    eager = CudaDecoder(vae.tensors, vae.config)
    assert not _free_blocks_kept(lambda: capture_sized(eager.ops, eager._run, (128, H + 4, W)))
