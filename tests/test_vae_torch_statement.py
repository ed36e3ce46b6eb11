"""scripts/reference/vae_decoder.py (the torch statement the GPU decoder benchmark times and takes its float64
reference from) equals diffusers' decode and moss_cli's numpy decoder."""

import numpy as np
import torch
from diffusers import AutoencoderKLFlux2

from moss_cli import vae
from moss_cli.checkpoint import open_checkpoint
from moss_cli.ops import numpy_ops
from reference import vae_decoder
from test_vae import TINY, official_decode, randomize


def test_torch_statement_equals_diffusers_in_float64():
    model = randomize(AutoencoderKLFlux2(**TINY).eval(), seed=2).double()
    latents = np.random.default_rng(3).standard_normal((1, 128, 3, 4))
    ref = official_decode(model, latents, torch.float64)
    t = vae_decoder.weights(model.state_dict(), torch.float64, "cpu")
    with torch.no_grad():
        got = vae_decoder.decode(t, dict(model.config), torch.from_numpy(latents))
    assert got.shape == ref.shape == (1, 3, 48, 64)
    assert (got - ref).abs().max().item() <= 1e-12 * ref.abs().max().item()


def test_torch_statement_equals_the_numpy_decoder_on_the_tiny_checkpoint():
    comp = open_checkpoint().component("vae")
    latents = np.random.default_rng(4).standard_normal((1, 128, 2, 3))
    ours = vae.Decoder(numpy_ops(np.float64), comp.tensors, comp.config).raw(latents)
    t = vae_decoder.weights(comp.tensors, torch.float64, "cpu")
    with torch.no_grad():
        got = vae_decoder.decode(t, comp.config, torch.from_numpy(latents))[0].numpy()
    assert np.abs(got - ours).max() <= 1e-12 * np.abs(ours).max()
    image = np.clip(ours, -1, 1).astype(np.float32)
    assert np.array_equal(vae_decoder.to_pixels(torch.from_numpy(image)[None]), vae.to_pixels(image))
