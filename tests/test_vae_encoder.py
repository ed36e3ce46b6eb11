"""The VAE encoder and the picture's way in, against diffusers: Flux2ImageProcessor's preprocessing (bit for
bit), AutoencoderKLFlux2.encode's posterior mode with the FLUX.2 pipelines' _patchify_latents and BN
normalisation (float32 gate), the inpainting mask of FluxInpaintPipeline (bit for bit), and moss-encode-image.

Gate: latents relative L2 error, float32, measured 7.9e-7 and 8.3e-7 (tiny and skewed random VAEs), 7.9e-7 to
9.3e-7 on the tiny checkpoint, 1.25e-6 at the real encoder's widths (random weights, 64x96); gate
ENCODE_GATE = 3e-6. Planted controls, each asserted to fail it by 100x
(measured 0.6-0.7): the BN normalisation left out, and the patchify's (i, j) order swapped.
"""

import hashlib
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLFlux2
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
from PIL import Image

from cli_util import run
from moss_cli import picture, vae
from moss_cli.checkpoint import EMBEDDED, open_checkpoint
from moss_cli.ops import numpy_ops
from moss_cli.safetensors_io import load
from test_vae import SKEWED, SMALL, TINY, randomize

ENCODE_GATE = 3e-6


def rel_l2(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def official_encode(model, image, dtype=torch.float32):
    """Flux2Pipeline._encode_vae_image: the posterior's mode (sample_mode="argmax"), _patchify_latents, then
    (z - bn.running_mean) / sqrt(bn.running_var + batch_norm_eps)."""
    with torch.no_grad():
        z = model.encode(torch.as_tensor(image, dtype=dtype)[None]).latent_dist.mode()
        z = Flux2Pipeline._patchify_latents(z)
        mean = model.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(model.bn.running_var.view(1, -1, 1, 1) + model.config.batch_norm_eps)
        return ((z - mean) / std).numpy()


@pytest.fixture(scope="module", params=[TINY, SKEWED], ids=["tiny", "skewed"])
def random_vae(request):
    model = randomize(AutoencoderKLFlux2(**request.param).eval(), seed=1)
    return model, {k: v.numpy() for k, v in model.state_dict().items()}, dict(model.config)


def an_image(h=64, w=96, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, (3, h, w)).astype(np.float32)


def test_expected_encoder_tensors_are_diffusers_names_and_shapes(random_vae):
    _, tensors, config = random_vae
    expected = vae.expected_encoder_tensors(config)
    assert {k: tuple(tensors[k].shape) for k in expected} == expected
    assert {k for k in tensors if k.startswith("encoder.")} <= set(expected)
    assert "quant_conv.weight" in expected and "bn.running_var" in expected


def test_float32_encode_matches_diffusers(random_vae):
    model, tensors, config = random_vae
    image = an_image()
    ref = official_encode(model, image)
    ours = vae.Encoder(numpy_ops(np.float32), tensors, config)(image)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (1, 128, 4, 6)
    assert rel_l2(ours, ref) <= ENCODE_GATE


def test_float32_encode_at_the_real_widths_matches_diffusers():
    """The real VAE's encoder widths (128, 256, 512, 512; 32 groups) with random weights of realistic scale."""
    model = randomize(AutoencoderKLFlux2(**SMALL).eval(), seed=4)
    image = an_image(64, 96, seed=2)
    ours = vae.Encoder(numpy_ops(np.float32), {k: v.numpy() for k, v in model.state_dict().items()},
                       dict(model.config))(image)
    assert rel_l2(ours, official_encode(model, image)) <= ENCODE_GATE


def test_float64_encode_matches_diffusers_in_double(random_vae):
    model, tensors, config = random_vae
    image = an_image(seed=1).astype(np.float64)
    ref = official_encode(model.double(), image, torch.float64)
    model.float()
    ours = vae.Encoder(numpy_ops(np.float64), tensors, config)(image)
    assert rel_l2(ours, ref) <= 1e-13          # measured 1.8e-15 and 1.9e-15


def _planted(encoder, image, bn=True, swap=False):
    """The encoder's own mode, then a wrong patchify or no BN normalisation."""
    z = encoder.mode(image)
    c, hh, ww = z.shape
    order = (0, 4, 2, 1, 3) if swap else (0, 2, 4, 1, 3)
    z = z.reshape(c, hh // 2, 2, ww // 2, 2).transpose(order).reshape(1, 4 * c, hh // 2, ww // 2)
    return (z - encoder.bn_mean[None]) / encoder.bn_std[None] if bn else z


@pytest.mark.parametrize("bug", [dict(bn=False), dict(swap=True)], ids=["bn_left_out", "patchify_swapped"])
def test_planted_encoder_bugs_fail_the_gate(random_vae, bug):
    model, tensors, config = random_vae
    image = an_image()
    ref = official_encode(model, image)
    encoder = vae.Encoder(numpy_ops(np.float32), tensors, config)
    assert rel_l2(_planted(encoder, image), ref) <= ENCODE_GATE       # the unplanted statement passes
    assert rel_l2(_planted(encoder, image, **bug), ref) > 100 * ENCODE_GATE


# --- the picture's preprocessing ------------------------------------------------------------------

def picture_bytes(mode, size=(90, 70), fmt="PNG", seed=0):
    rng = np.random.default_rng(seed)
    w, h = size
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2, "P": 1}[mode]
    a = (rng.random((h, w, channels)) * 255).astype(np.uint8)
    if mode == "P":
        image = Image.fromarray(a[..., 0], "L").convert("P")
    elif channels == 1:
        image = Image.fromarray(a[..., 0], mode)
    else:
        image = Image.fromarray(a, mode)
    out = io.BytesIO()
    image.save(out, fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return out.getvalue()


def _read(tmp_path, data, name="in.png"):
    path = tmp_path / name
    path.write_bytes(data)
    return picture.read(path)


@pytest.mark.parametrize("mode,fmt", [("RGB", "PNG"), ("RGBA", "PNG"), ("L", "PNG"), ("LA", "PNG"), ("P", "PNG"),
                                      ("RGB", "JPEG"), ("L", "JPEG"), ("RGBA", "WEBP")])
def test_rgb_equals_flux2_image_processor_bit_for_bit(tmp_path, mode, fmt):
    data = picture_bytes(mode, fmt=fmt)
    pic = _read(tmp_path, data)
    assert pic.sha256 == hashlib.sha256(data).hexdigest()
    w, h = pic.target()
    assert (w, h) == (80, 64)                       # floored to multiples of 16
    ref = Flux2ImageProcessor(vae_scale_factor=16).preprocess(Image.open(io.BytesIO(data)))[0].numpy()
    ours = pic.rgb(w, h)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (3, 64, 80)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))
    ref = Flux2ImageProcessor(vae_scale_factor=16).preprocess(Image.open(io.BytesIO(data)), height=48, width=96)
    np.testing.assert_array_equal(pic.rgb(*pic.target(96, 48)), ref[0].numpy())


def inpaint_mask_processor():
    """FluxInpaintPipeline's mask_processor (vae_scale_factor 8 * 2)."""
    return VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=32, do_normalize=False, do_binarize=True,
                             do_convert_grayscale=True)


def mask_bytes(size=(90, 70), mode="L"):
    w, h = size
    a = np.zeros((h, w), np.uint8)
    a[10:50, 20:70] = 255
    a[55:, :30] = 127                               # gray: binarised to 0 (127/255 < 0.5)
    a[60:, 60:] = 128                               # and to 1
    image = Image.fromarray(a, "L").convert(mode)
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
def test_mask_and_latent_mask_equal_flux_inpaint_bit_for_bit(tmp_path, mode):
    data = mask_bytes(mode=mode)
    m = _read(tmp_path, data, "mask.png")
    ref = inpaint_mask_processor().preprocess(Image.open(io.BytesIO(data)), height=64, width=80)
    ours = m.mask(80, 64)
    np.testing.assert_array_equal(ours, ref[0, 0].numpy())
    assert set(np.unique(ours)) == {0.0, 1.0}
    # prepare_mask_latents: nearest to the VAE's grid (H/8, W/8), the latent channels, then the FLUX.2 patchify
    grid = F.interpolate(ref, size=(64 // 8, 80 // 8)).repeat(1, 32, 1, 1)
    packed = Flux2Pipeline._patchify_latents(grid).numpy()
    np.testing.assert_array_equal(picture.latent_mask(ours, 128), packed)


# --- the stage on the tiny checkpoint --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_vae():
    model = AutoencoderKLFlux2.from_pretrained(EMBEDDED / "vae", torch_dtype=torch.float32).eval()
    return model


def test_moss_encode_image_matches_diffusers_on_the_tiny_checkpoint(tmp_path, tiny_vae):
    data = picture_bytes("RGBA", size=(100, 70), seed=3)
    (tmp_path / "in.png").write_bytes(data)
    r = run("moss-encode-image", tmp_path / "in.png", "--out", tmp_path / "in.lat", "--quiet")
    assert r.code == 0, r.stderr
    tensors, meta = load(tmp_path / "in.lat")
    image = Flux2ImageProcessor(vae_scale_factor=16).preprocess(Image.open(io.BytesIO(data)))[0].numpy()
    ref = official_encode(tiny_vae, image)
    assert tensors["latents"].shape == ref.shape == (1, 128, 4, 6)
    assert rel_l2(tensors["latents"], ref) <= ENCODE_GATE
    assert meta["moss.stage"] == "encode-image"
    assert meta["moss.model"] == open_checkpoint().fingerprint
    assert meta["moss.picture_sha256"] == hashlib.sha256(data).hexdigest()
    assert (meta["moss.width"], meta["moss.height"], meta["moss.picture_width"], meta["moss.picture_height"]) == \
        ("96", "64", "100", "70")
    assert meta["moss.resample"] == "lanczos"


def test_moss_encode_image_at_a_given_size_and_through_stdout(tmp_path, tiny_vae):
    data = picture_bytes("L", size=(50, 40), fmt="JPEG")
    (tmp_path / "in.jpg").write_bytes(data)
    r = run("moss-encode-image", tmp_path / "in.jpg", "--width", "64", "--height", "32", "--out", "-", "--quiet")
    assert r.code == 0, r.stderr
    from moss_cli.safetensors_io import loads
    tensors, meta = loads(r.stdout)
    image = Flux2ImageProcessor(vae_scale_factor=16).preprocess(Image.open(io.BytesIO(data)), height=32, width=64)
    assert rel_l2(tensors["latents"], official_encode(tiny_vae, image[0].numpy())) <= ENCODE_GATE
    assert tensors["latents"].shape == (1, 128, 2, 4)
