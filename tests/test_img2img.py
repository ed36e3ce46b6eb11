"""Image-to-image and inpainting on the tiny checkpoint against a statement of diffusers' pipelines in torch:
FlowMatchEulerDiscreteScheduler holding the MOSS schedule (reference.schedule, shift 1 as MOSSImageScheduler
builds its base), FluxImg2ImgPipeline.get_timesteps for the cut, scale_noise on torch.randn's noise for the
start, scheduler.step and FluxInpaintPipeline's kept-region update for every transition, and the float64 DiT
statement (reference.dit) for every velocity.

Sigmas, noise, start latents, latent mask and every transition: bit for bit. Velocities: test_cases'
VELOCITY_GATE. The kept region: the image's latents exactly, and an all-kept picture equals diffusers' decode
of the picture's latents within test_vae's pixel gate. `--strength 1` without a mask: text-to-image's bytes.
"""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux_img2img import FluxImg2ImgPipeline
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
from PIL import Image

from cli_util import run
from moss_cli.checkpoint import EMBEDDED
from moss_cli.safetensors_io import load
from moss_cli.sampler import skipped
from reference import dit, schedule as reference_schedule
from test_cases import VELOCITY_GATE
from test_vae import official_decode

SEED, STEPS, GUIDANCE, SHIFT = 7, 6, 3.0, 5.0
OPTIONS = ["--seed", SEED, "--steps", STEPS, "--guidance", GUIDANCE, "--shift", SHIFT, "--quiet"]
STRENGTHS = [0.5, 0.7, 1.0]


def rel(a, ref):
    return float(np.abs(np.asarray(a, np.float64) - ref).max() / np.abs(ref).max())


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def write_png(path, array, mode):
    Image.fromarray(array, mode).save(path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The ENC, the picture (64x64 from a 70x75 PNG), its IMAGE, masks, and the text-to-image LAT."""
    tmp = tmp_path_factory.mktemp("img2img")
    rng = np.random.default_rng(5)
    yy, xx = np.mgrid[0:75, 0:70]
    smooth = np.stack([128 + 100 * np.sin(xx / 9 + c) * np.cos(yy / 7 - c) for c in range(3)], -1)
    write_png(tmp / "in.png", np.clip(smooth + 20 * rng.standard_normal(smooth.shape), 0, 255).astype(np.uint8), "RGB")
    half = np.zeros((75, 70), np.uint8)
    half[:, 35:] = 255
    write_png(tmp / "mask.png", half, "L")
    write_png(tmp / "black.png", np.zeros((75, 70), np.uint8), "L")
    for command in [("moss-encode", "--prompt", "a red fox in snow", "--out", tmp / "p.enc", "--quiet"),
                    ("moss-encode-image", tmp / "in.png", "--out", tmp / "in.lat", "--quiet"),
                    ("moss-denoise", tmp / "p.enc", *OPTIONS, "--width", 64, "--height", 64, "--out", tmp / "t2i.lat")]:
        r = run(*command)
        assert r.code == 0, r.stderr
    return tmp


def denoise(files, name, strength, mask=None):
    extra = ["--mask", files / mask] if mask else []
    r = run("moss-denoise", files / "p.enc", *OPTIONS, "--init", files / "in.lat", "--strength", strength, *extra,
            "--trace", files / f"{name}.trace", "--out", files / f"{name}.lat")
    assert r.code == 0, r.stderr
    trace, _ = load(files / f"{name}.trace")
    lat, meta = load(files / f"{name}.lat")
    return trace, lat["latents"], meta


def diffusers_cut(steps, strength):
    """(scheduler, cut timesteps): the MOSS schedule in diffusers' scheduler, cut by get_timesteps."""
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    scheduler.set_timesteps(sigmas=reference_schedule.sigmas(steps, shift=SHIFT)[:-1].tolist())

    class Pipe:                                     # get_timesteps reads only self.scheduler
        pass
    pipe = Pipe()
    pipe.scheduler = scheduler
    timesteps, _ = FluxImg2ImgPipeline.get_timesteps(pipe, len(scheduler.timesteps), strength, "cpu")
    return scheduler, timesteps


def diffusers_start(strength, image_latents):
    """(scheduler, cut timesteps, torch noise, start latents) as FluxImg2ImgPipeline sets them up."""
    scheduler, timesteps = diffusers_cut(STEPS, strength)
    noise = torch.randn(image_latents.shape, generator=torch.Generator().manual_seed(SEED), dtype=torch.float32)
    start = scheduler.scale_noise(image_latents, timesteps[:1], noise)
    return scheduler, timesteps, noise, start


def diffusers_mask(path):
    """FluxInpaintPipeline's mask: the mask processor at the picture's size, nearest to the VAE's grid, the
    latent channels, then the FLUX.2 patchify."""
    processor = VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=32, do_normalize=False, do_binarize=True,
                                  do_convert_grayscale=True)
    m = processor.preprocess(Image.open(path), height=64, width=64)
    return Flux2Pipeline._patchify_latents(F.interpolate(m, size=(8, 8)).repeat(1, 32, 1, 1))


@pytest.fixture(scope="module")
def statement(files):
    """The float64 DiT statement and the ENC's texts refined by it."""
    folder = EMBEDDED / "transformer"
    sd, cfg = dit.load_weights(folder), json.loads((folder / "config.json").read_text())
    rows, _ = load(files / "p.enc")
    texts = [dit.text_refiner(sd, cfg, np.array(rows[f"{role}_rows"])) for role in ("prompt", "negative")]
    return dit.Statement(sd, cfg), *texts


def reference_velocity(statement, x, t, skip):
    st, cond, uncond = statement
    mod, head = st.conditioning(t)
    x = torch.as_tensor(x, dtype=torch.float64)
    c, u = st.velocity(x, mod, head, cond), st.velocity(x, mod, head, uncond, skip)
    return (u + GUIDANCE * (c - u)).numpy()


@pytest.mark.parametrize("strength", [0.3, 0.5, 0.7, 0.999, 1.0])
def test_sigmas_noise_and_start_latents_are_diffusers_bit_for_bit(files, strength):
    trace, _, meta = denoise(files, f"s{strength}", strength)
    image = torch.from_numpy(np.array(load(files / "in.lat")[0]["latents"]))
    scheduler, timesteps, noise, start = diffusers_start(strength, image)
    cut = scheduler.sigmas[scheduler.begin_index:].numpy()
    np.testing.assert_array_equal(bits(trace["sigmas"]), bits(cut))
    np.testing.assert_array_equal(bits(trace["noise"]), bits(noise))
    np.testing.assert_array_equal(bits(trace["latents.000"]), bits(start))
    assert len(cut) - 1 == len(timesteps) == sum(k.startswith("velocity.") for k in trace)
    if strength < 1:
        np.testing.assert_array_equal(trace["init"], image.numpy())
        assert meta["moss.strength"] == repr(strength) and meta["moss.init_sha256"]


@pytest.mark.parametrize("steps", [1, 2, 7, 28, 50])
def test_cut_equals_get_timesteps_for_every_strength(steps):
    from moss_cli.schedule import cut, sigmas
    for strength in np.linspace(0.01, 1, 100).tolist() + [1 / 3, 2 / 3, 0.1, 0.3, 0.7, 0.9]:
        scheduler, timesteps = diffusers_cut(steps, strength)
        ours = cut(sigmas(steps, shift=SHIFT), strength)
        np.testing.assert_array_equal(bits(ours), bits(scheduler.sigmas[scheduler.begin_index:]), err_msg=strength)
        assert len(ours) - 1 == len(timesteps) >= 1


def test_steps_are_cut_as_get_timesteps_does(files):
    """Of N steps, strength s runs the last N - int(N - N s) (get_timesteps): 6 steps at 0.5 run the last 3."""
    runs = {s: denoise(files, f"c{s}", s)[0] for s in (0.5, 0.7, 0.999)}
    full = reference_schedule.sigmas(STEPS, shift=SHIFT)
    n = len(full) - 1
    assert [len(runs[s]["sigmas"]) - 1 for s in (0.5, 0.7, 0.999)] == [n - int(n - n * s) for s in (0.5, 0.7, 0.999)]
    np.testing.assert_array_equal(runs[0.5]["sigmas"], full[-4:])


@pytest.mark.parametrize("mask", [None, "mask.png"], ids=["img2img", "inpaint"])
def test_every_transition_is_diffusers_step_and_every_velocity_the_dit_statement(files, statement, mask):
    trace, final, meta = denoise(files, f"t-{mask}", 0.7, mask)
    image = torch.from_numpy(np.array(load(files / "in.lat")[0]["latents"]))
    scheduler, timesteps, noise, x = diffusers_start(0.7, image)
    if mask:
        m = diffusers_mask(files / mask)
        np.testing.assert_array_equal(trace["mask"], m.numpy())
        assert 0 < m.mean() < 1 and meta["moss.mask_sha256"]
    n = len(timesteps)
    for i, t in enumerate(timesteps):
        np.testing.assert_array_equal(bits(trace[f"latents.{i:03d}"]), bits(x), err_msg=f"latents entering step {i}")
        skip = skipped(i, n, (22,))
        v = trace[f"velocity.{i:03d}"]
        assert rel(v, reference_velocity(statement, x, float(t), skip)) <= VELOCITY_GATE, i
        x = scheduler.step(torch.from_numpy(np.array(v)), t, x, return_dict=False)[0]
        if mask:                                    # FluxInpaintPipeline's update after each step
            proper = image if i == n - 1 else scheduler.scale_noise(image, torch.tensor([timesteps[i + 1]]), noise)
            x = (1 - m) * proper + m * x
    np.testing.assert_array_equal(bits(final), bits(x))
    if mask:
        kept = m.numpy() == 0
        np.testing.assert_array_equal(final[kept], image.numpy()[kept])
        assert not np.array_equal(final[~kept], image.numpy()[~kept])


def test_strength_one_without_a_mask_is_text_to_image_byte_for_byte(files):
    r = run("moss-denoise", files / "p.enc", *OPTIONS, "--init", files / "in.lat", "--strength", 1,
            "--out", files / "one.lat")
    assert r.code == 0 and "this is text-to-image" in r.stderr
    assert (files / "one.lat").read_bytes() == (files / "t2i.lat").read_bytes()
    common = ["--prompt", "a red fox in snow", *OPTIONS]
    r = run("moss-image", *common, "--width", 64, "--height", 64, "--picture", files / "t2i.png")
    assert r.code == 0, r.stderr
    r = run("moss-image", *common, "--init-image", files / "in.png", "--strength", 1, "--picture", files / "one.png")
    assert r.code == 0, r.stderr
    assert (files / "one.png").read_bytes() == (files / "t2i.png").read_bytes()


def test_moss_image_equals_the_chain_and_a_kept_picture_is_the_source_decode(files):
    r = run("moss-image", "--prompt", "a red fox in snow", *OPTIONS, "--init-image", files / "in.png", "--strength",
            0.7, "--mask", files / "mask.png", "--picture", files / "inpaint.png", "--keep", files / "keep")
    assert r.code == 0, r.stderr
    _, chained, _ = denoise(files, "chain", 0.7, "mask.png")
    assert (files / "keep" / "image.lat").read_bytes() == (files / "in.lat").read_bytes()
    np.testing.assert_array_equal(load(files / "keep" / "latents.lat")[0]["latents"], chained)
    r = run("moss-image", "--prompt", "a red fox in snow", *OPTIONS, "--init-image", files / "in.png", "--strength",
            0.7, "--mask", files / "black.png", "--picture", files / "kept.png")
    assert r.code == 0, r.stderr
    vae = AutoencoderKLFlux2.from_pretrained(EMBEDDED / "vae", torch_dtype=torch.float32).eval()
    ref = official_decode(vae, np.array(load(files / "in.lat")[0]["latents"]), torch.float32).clamp(-1, 1)
    pil = VaeImageProcessor(vae_scale_factor=16).postprocess(ref, output_type="pil")[0]
    diff = np.abs(np.asarray(Image.open(files / "kept.png")).astype(int) - np.asarray(pil).astype(int))
    assert diff.max() <= 1 and np.mean(diff > 0) <= 1e-3
    params = json.loads(Image.open(files / "kept.png").text["parameters"])
    assert params["strength"] == 0.7 and params["picture_sha256"] and params["mask_sha256"]
