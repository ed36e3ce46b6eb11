"""On a GPU: image-to-image and inpainting with --device cuda on the tiny checkpoint against the CPU.

The GPU gets the CPU's start: the cut sigmas, the seeded noise and the start latents bit for bit. Each step's
guided velocity is within test_denoiser_tiny's bf16 GATE of the CPU float32 velocity of the GPU's own
latents_in. Inpainting puts the kept region back exactly as the CPU does (the picture's latents noised to the
next sigma, the picture's latents themselves at the end), so an all-kept picture, its init picture encoded on
the GPU (test_vae_encoder_gpu's GATE from the CPU's encoding), decodes on the GPU to the CPU's picture within
the decoder's pixel gate (test_vae: at most 1 off, in at most 1e-3 of the values).
"""

import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import cuda_kernels
from moss_cli.sampler import skipped

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")

GATE = 8 * 2.0 ** -8            # test_denoiser_tiny's per-step velocity gate
OPTIONS = ["--seed", "7", "--steps", "6", "--guidance", "3", "--quiet"]


def _run(command, *args):
    r = subprocess.run([sys.executable, "-c", f"from moss_cli.cli import {command} as c; c()", *map(str, args)],
                       capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    return r


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("img2img_gpu")
    yy, xx = np.mgrid[0:64, 0:96]
    Image.fromarray(np.stack([128 + 100 * np.sin(xx / 9 + c) * np.cos(yy / 7 - c) for c in range(3)], -1)
                    .astype(np.uint8)).save(tmp / "in.png")
    half = np.zeros((64, 96), np.uint8)
    half[:, 48:] = 255
    Image.fromarray(half).save(tmp / "mask.png")
    Image.fromarray(np.zeros((64, 96), np.uint8)).save(tmp / "black.png")
    _run("encode_command", "--prompt", "a red fox in snow", "--device", "cpu", "--out", tmp / "p.enc", "--quiet")
    _run("encode_image_command", tmp / "in.png", "--out", tmp / "in.lat", "--quiet")
    return tmp


def _denoise(files, device, name, *extra):
    from moss_cli.safetensors_io import load
    _run("denoise_command", files / "p.enc", *OPTIONS, "--init", files / "in.lat", "--strength", "0.7", *extra,
         "--device", device, "--trace", files / f"{name}-{device}.trace", "--out", files / f"{name}-{device}.lat")
    return load(files / f"{name}-{device}.trace")[0], load(files / f"{name}-{device}.lat")[0]["latents"]


def _velocity_errors(files, trace):
    from moss_cli.checkpoint import open_checkpoint
    from moss_cli.ops import numpy_ops
    from moss_cli.safetensors_io import load
    from moss_cli.sampler import guided
    from moss_cli.schedule import timesteps
    from moss_cli.transformer import MossTransformer
    comp = open_checkpoint().component("transformer")
    cpu = MossTransformer(numpy_ops(np.float32), comp.tensors, comp.config)
    rows = load(files / "p.enc")[0]
    cond, uncond = cpu.prepare_text(rows["prompt_rows"]), cpu.prepare_text(rows["negative_rows"])
    ts = timesteps(trace["sigmas"])
    n = len(ts)
    errs = []
    for i in range(n):
        x, t = trace[f"latents.{i:03d}"], float(ts[i])
        skip = skipped(i, n, (22,))
        ref = guided(np.asarray(cpu.velocity(x, t, cond), np.float32),
                     np.asarray(cpu.velocity(x, t, uncond, skip), np.float32), 3.0)
        v = trace[f"velocity.{i:03d}"]
        errs.append(float(np.linalg.norm(v - ref) / np.linalg.norm(ref)))
    return errs


@pytest.mark.parametrize("mask", [None, "mask.png"], ids=["img2img", "inpaint"])
def test_the_gpu_starts_where_the_cpu_does_and_keeps_the_kept_region(files, mask):
    from moss_cli.safetensors_io import load
    from moss_cli.schedule import scale_noise
    extra = ["--mask", files / mask] if mask else []
    gpu, final = _denoise(files, "cuda", f"run-{mask}", *extra)
    cpu, _ = _denoise(files, "cpu", f"run-{mask}", *extra)
    for name in ("sigmas", "noise", "latents.000", "init") + (("mask",) if mask else ()):
        np.testing.assert_array_equal(gpu[name].view(np.uint32), cpu[name].view(np.uint32), err_msg=name)
    errs = _velocity_errors(files, gpu)
    print(f"{mask or 'img2img'}: per-step velocity relative error {['%.3g' % e for e in errs]}, gate {GATE:.3g}")
    assert max(errs) <= GATE
    if mask:
        image, m, noise, sig = load(files / "in.lat")[0]["latents"], gpu["mask"], gpu["noise"], gpu["sigmas"]
        kept = m == 0
        n = len(sig) - 1
        for i in range(1, n):
            np.testing.assert_array_equal(gpu[f"latents.{i:03d}"][kept], scale_noise(image, sig[i], noise)[kept])
        np.testing.assert_array_equal(final[kept], image[kept])


def test_an_all_kept_picture_decodes_on_the_gpu_to_the_cpus_picture(files):
    from moss_cli.safetensors_io import load
    from test_vae_encoder_gpu import GATE, rel_l2
    pictures, images = {}, {}
    for device in ("cuda", "cpu"):
        out = files / f"kept-{device}.png"
        _run("image_command", "--prompt", "a red fox in snow", *OPTIONS, "--init-image", files / "in.png",
             "--strength", "0.7", "--mask", files / "black.png", "--device", device, "--picture", out,
             "--keep", files / f"kept-{device}")
        pictures[device] = np.asarray(Image.open(out)).astype(int)
        images[device] = load(files / f"kept-{device}" / "image.lat")
    assert images["cuda"][1]["moss.device"] == "cuda" and images["cpu"][1]["moss.device"] == "cpu"
    err = rel_l2(images["cuda"][0]["latents"], images["cpu"][0]["latents"])
    diff = np.abs(pictures["cuda"] - pictures["cpu"])
    print(f"init picture's latents GPU vs CPU: relative L2 {err:.3g}; pixels off by one {np.mean(diff > 0):.2e}")
    assert err <= GATE
    assert diff.max() <= 1 and np.mean(diff > 0) <= 1e-3
