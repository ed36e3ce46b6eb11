"""The VAE decoder and pixel rounding against diffusers' AutoencoderKLFlux2 and VaeImageProcessor."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLFlux2
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
from safetensors.numpy import load_file

from moss_cli import vae
from moss_cli.errors import ArtifactError
from moss_cli.ops import numpy_ops

# the demo checkpoint's shape, and one where every decoder width differs (shortcut in every up block but the first)
TINY = dict(block_out_channels=[8, 16, 32, 32], decoder_block_out_channels=[8, 16, 24, 24], norm_num_groups=4,
            latent_channels=32, layers_per_block=2, patch_size=[2, 2], batch_norm_eps=1e-4)
SKEWED = dict(block_out_channels=[8, 16, 16, 32], decoder_block_out_channels=[4, 8, 12, 16], norm_num_groups=4,
              latent_channels=32, layers_per_block=1)
SMALL = dict(block_out_channels=[128, 256, 512, 512], decoder_block_out_channels=[96, 192, 384, 384])


def randomize(model, seed):
    """Random values in every float tensor, bn.running_var positive, so no tensor keeps its default init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            if name == "bn.running_var":
                t.copy_(torch.rand(t.shape, generator=g) * 1.5 + 0.25)
            elif t.ndim >= 2:
                t.copy_(torch.randn(t.shape, generator=g) / t[0].numel() ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(0.2 * torch.randn(t.shape, generator=g))
    return model


@pytest.fixture(scope="module", params=[TINY, SKEWED], ids=["tiny", "skewed"])
def saved(request, tmp_path_factory):
    """(diffusers model, tensors and config read back from save_pretrained as a checkpoint reader would)."""
    model = randomize(AutoencoderKLFlux2(**request.param).eval(), seed=1)
    folder = tmp_path_factory.mktemp("vae")
    model.save_pretrained(folder)
    tensors = load_file(folder / "diffusion_pytorch_model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    return model, tensors, config


def official_decode(model, latents, dtype):
    """The FLUX.2 pipeline's decode: BN de-normalisation on 128 channels, unpatchify, vae.decode(z).sample."""
    with torch.no_grad():
        z = torch.from_numpy(latents).to(dtype)
        mean = model.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(model.bn.running_var.view(1, -1, 1, 1) + model.config.batch_norm_eps)
        z = Flux2Pipeline._unpatchify_latents(z * std + mean)
        return model.decode(z).sample


def test_expected_tensors_are_diffusers_names_and_shapes(saved):
    _, tensors, config = saved
    expected = vae.expected_tensors(config)
    assert {k: tuple(tensors[k].shape) for k in expected} == expected
    unread = {k for k in tensors if k not in expected and not k.startswith("encoder.")}
    assert unread == {"quant_conv.weight", "quant_conv.bias", "bn.num_batches_tracked"}


def test_expected_tensors_of_the_small_decoder():
    with torch.device("meta"):
        model = AutoencoderKLFlux2(**SMALL)
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = vae.expected_tensors(dict(model.config))
    assert {k: state[k] for k in expected} == expected
    assert sum(k.startswith("decoder.") for k in expected) == 138
    assert expected["decoder.conv_in.weight"] == (384, 32, 3, 3)
    assert expected["decoder.up_blocks.3.resnets.0.conv_shortcut.weight"] == (96, 192, 1, 1)


def test_float32_decode_matches_diffusers(saved):
    model, tensors, config = saved
    latents = np.random.default_rng(0).standard_normal((1, 128, 4, 6)).astype(np.float32)
    ref = official_decode(model, latents, torch.float32)
    decoder = vae.Decoder(numpy_ops(np.float32), tensors, config)
    raw = decoder.raw(latents)
    image = decoder(latents)
    assert raw.dtype == image.dtype == np.float32 and image.shape == (3, 64, 96)
    assert np.abs(raw - ref[0].numpy()).max() <= 1e-5
    assert 0.01 < np.mean(np.abs(raw) > 1) < 0.2          # the clamp is exercised, most pixels are not clamped
    assert np.abs(image - ref.clamp(-1, 1)[0].numpy()).max() <= 1e-5

    pil = VaeImageProcessor(vae_scale_factor=16).postprocess(ref.clamp(-1, 1), output_type="pil")[0]
    diff = np.abs(vae.to_pixels(image).astype(int) - np.asarray(pil).astype(int))
    assert diff.max() <= 1 and np.mean(diff > 0) <= 1e-3


def test_planted_group_norm_epsilon_fails_the_float32_gate(saved, monkeypatch):
    """Control: every GroupNorm's epsilon x10 moves the raw decode by 6-8e-5, past the 1e-5 gate above
    (measured error 3.8-4.8e-6)."""
    model, tensors, config = saved
    latents = np.random.default_rng(0).standard_normal((1, 128, 4, 6)).astype(np.float32)
    ref = official_decode(model, latents, torch.float32)
    monkeypatch.setattr(vae, "NORM_EPS", 10 * vae.NORM_EPS)
    raw = vae.Decoder(numpy_ops(np.float32), tensors, config).raw(latents)
    assert np.abs(raw - ref[0].numpy()).max() > 3e-5


def test_float64_decode_matches_diffusers_in_double(saved):
    model, tensors, config = saved
    latents = np.random.default_rng(1).standard_normal((1, 128, 3, 5))
    ref = official_decode(model.double(), latents, torch.float64)
    model.float()
    raw = vae.Decoder(numpy_ops(np.float64), tensors, config).raw(latents)
    assert raw.dtype == np.float64
    assert np.abs(raw - ref[0].numpy()).max() <= 5e-14        # measured 6.4e-15 and 9.8e-15


def test_latents_of_the_wrong_shape_are_an_artifact_error(saved):
    _, tensors, config = saved
    decoder = vae.Decoder(numpy_ops(np.float32), tensors, config)
    with pytest.raises(ArtifactError, match=r"\[1, 128, h, w\]"):
        decoder(np.zeros((1, 32, 4, 4), np.float32))


def test_to_pixels_rounds_half_to_even_like_diffusers_postprocess():
    # float32 neighbours of the 255 rounding boundaries x with (x*0.5+0.5)*255 = k + 0.5, plus out-of-range values
    k = np.arange(255)
    boundary = (2 * (k + 0.5) / 255 - 1).astype(np.float32)
    up, down = [boundary], [boundary]
    for _ in range(40):
        up.append(np.nextafter(up[-1], np.float32(2)))
        down.append(np.nextafter(down[-1], np.float32(-2)))
    x = np.stack(down[:0:-1] + up, axis=1)                  # 81 consecutive float32 values around each boundary
    x = np.concatenate([x.ravel(), np.float32([-1, 1, -1.5, 2, 0, -0.0])])
    x = np.resize(x, 3 * 72 * 288).reshape(3, 72, 288)
    scaled = (x * np.float32(0.5) + np.float32(0.5)) * np.float32(255)
    ties = scaled[(scaled % 1 == 0.5) & (np.abs(x) <= 1)]
    assert (ties % 2 < 1).any() and (ties % 2 > 1).any()   # ties that round down and ties that round up
    pil = VaeImageProcessor(vae_scale_factor=16).postprocess(torch.from_numpy(x)[None], output_type="pil")[0]
    assert np.array_equal(vae.to_pixels(x), np.asarray(pil))


@pytest.mark.parametrize("kernel,padding,shape", [(3, 1, (5, 7, 9)), (1, 0, (4, 6, 3)), (3, 0, (3, 8, 5))])
def test_conv2d_matches_torch(kernel, padding, shape):
    rng = np.random.default_rng(2)
    x, w, b = rng.normal(size=shape), rng.normal(size=(6, shape[0], kernel, kernel)), rng.normal(size=6)
    ref = F.conv2d(torch.tensor(x)[None], torch.tensor(w), torch.tensor(b), padding=padding)[0].numpy()
    assert np.abs(numpy_ops(np.float64).conv2d(x, w, b, padding) - ref).max() < 1e-12


def test_conv2d_splits_rows_into_bands_without_changing_the_result(monkeypatch):
    rng = np.random.default_rng(3)
    x, w, b = rng.normal(size=(4, 11, 6)), rng.normal(size=(5, 4, 3, 3)), rng.normal(size=5)
    ops = numpy_ops(np.float64)
    whole = ops.conv2d(x, w, b, 1)
    monkeypatch.setattr("moss_cli.ops.numpy.conv.IM2COL_BUDGET", 4 * 9 * 8 * 3)   # 3 rows of the padded width 8 per band
    assert np.abs(ops.conv2d(x, w, b, 1) - whole).max() < 1e-13


def test_group_norm_and_upsample_match_torch():
    rng = np.random.default_rng(4)
    x, w, b = rng.normal(2.0, 3.0, size=(12, 5, 7)), rng.normal(size=12), rng.normal(size=12)
    ops = numpy_ops(np.float64)
    ref = F.group_norm(torch.tensor(x)[None], 4, torch.tensor(w), torch.tensor(b), eps=1e-6)[0].numpy()
    assert np.abs(ops.group_norm(x, 4, w, b, 1e-6) - ref).max() < 1e-12
    up = F.interpolate(torch.tensor(x)[None], scale_factor=2.0, mode="nearest")[0].numpy()
    assert np.array_equal(ops.upsample_nearest2x(x), up)
