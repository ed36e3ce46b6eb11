"""Starting from a picture, the bad inputs: each is one error line, a non-zero exit and no output file."""

import io
import json

import numpy as np
import pytest
from PIL import Image

from cli_util import copy_model, run, single_error
from moss_cli.safetensors_io import load


def png(size, mode="RGB", fmt="PNG"):
    w, h = size
    a = (np.random.default_rng(0).random((h, w, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(a).convert(mode).save(out, fmt)
    return out.getvalue()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("errors")
    (tmp / "in.png").write_bytes(png((64, 48)))
    (tmp / "mask.png").write_bytes(png((64, 48), "L"))
    (tmp / "small_mask.png").write_bytes(png((32, 48), "L"))
    (tmp / "trunc.png").write_bytes(png((64, 48))[:300])
    (tmp / "anim.gif").write_bytes(png((64, 48), fmt="GIF"))
    (tmp / "text.png").write_bytes(b"not a picture at all\n")
    (tmp / "tiny.png").write_bytes(png((10, 40)))
    for command in [("moss-encode", "--prompt", "a fox", "--out", tmp / "p.enc", "--quiet"),
                    ("moss-encode-image", tmp / "in.png", "--out", tmp / "in.lat", "--quiet")]:
        r = run(*command)
        assert r.code == 0, r.stderr
    other = copy_model(tmp)
    config = json.loads((other / "vae" / "config.json").read_text())
    config["sample_size"] = 512                     # a different model: its fingerprint differs
    (other / "vae" / "config.json").write_text(json.dumps(config))
    r = run("moss-encode-image", tmp / "in.png", "--model", other, "--out", tmp / "other.lat", "--quiet")
    assert r.code == 0, r.stderr
    return tmp


DENOISE = ["--seed", "1", "--steps", "2", "--quiet"]


def fails(files, command, *args, says):
    out = files / "out.file"
    r = run(command, *args, "--out" if command != "moss-image" else "--picture",
            out if command != "moss-image" else files / "out.png")
    line = single_error(r)
    assert says in line, line
    assert not out.exists() and not (files / "out.png").exists()
    assert not list(files.glob(".out*"))            # no temporary left behind either
    return line


@pytest.mark.parametrize("name,says", [("trunc.png", "truncated or corrupt picture"),
                                       ("text.png", "not a PNG, JPEG or WebP picture"),
                                       ("anim.gif", "not a PNG, JPEG or WebP picture"),
                                       ("missing.png", "no such file"),
                                       ("tiny.png", "too small")])
def test_an_unreadable_picture(files, name, says):
    fails(files, "moss-encode-image", files / name, "--quiet", says=says)
    fails(files, "moss-image", "--prompt", "a fox", *DENOISE, "--init-image", files / name, says=says)


def test_a_size_not_a_multiple_of_16(files):
    fails(files, "moss-encode-image", files / "in.png", "--width", "50", "--quiet", says="multiple of 16")


def test_a_mask_of_another_size(files):
    says = "the mask is 32x48, the picture 64x48"
    fails(files, "moss-denoise", files / "p.enc", *DENOISE, "--init", files / "in.lat", "--mask",
          files / "small_mask.png", says=says)
    fails(files, "moss-image", "--prompt", "a fox", *DENOISE, "--init-image", files / "in.png", "--mask",
          files / "small_mask.png", says=says)


@pytest.mark.parametrize("strength", ["0", "-0.1", "1.5", "nan"])
def test_a_strength_outside_zero_to_one(files, strength):
    fails(files, "moss-denoise", files / "p.enc", *DENOISE, "--init", files / "in.lat", "--strength", strength,
          says="must be in (0, 1]")
    fails(files, "moss-image", "--prompt", "a fox", *DENOISE, "--init-image", files / "in.png", "--strength",
          strength, says="must be in (0, 1]")


def test_a_strength_that_leaves_no_step(files):
    fails(files, "moss-denoise", files / "p.enc", *DENOISE, "--init", files / "in.lat", "--strength", "1e-20",
          says="leaves none of the 2 steps to run")


def test_an_image_of_another_model(files):
    fails(files, "moss-denoise", files / "p.enc", *DENOISE, "--init", files / "other.lat", says="made with another model")


def test_another_stage_given_as_the_image(files):
    fails(files, "moss-denoise", files / "p.enc", *DENOISE, "--init", files / "p.enc", says="is an ENC file, expected IMAGE")


def test_a_mask_or_strength_without_a_picture(files):
    fails(files, "moss-denoise", files / "p.enc", *DENOISE, "--mask", files / "mask.png", says="--mask needs a picture")
    fails(files, "moss-image", "--prompt", "a fox", *DENOISE, "--mask", files / "mask.png", says="--mask needs a picture")
    fails(files, "moss-denoise", files / "p.enc", *DENOISE, "--strength", "0.5", says="--strength needs a picture")


def test_a_size_that_contradicts_the_image(files):
    fails(files, "moss-denoise", files / "p.enc", *DENOISE, "--init", files / "in.lat", "--width", "128",
          says="was encoded at 64x48")


def test_device_cuda_without_a_gpu_is_one_line(files):
    """The VAE encoder runs on the GPU (tests/gpu/test_vae_encoder_gpu.py); here there is none to run on."""
    from moss_cli.device import gpu_status
    if gpu_status()[0]:
        pytest.skip("this machine has a usable GPU")
    fails(files, "moss-encode-image", files / "in.png", "--device", "cuda", says="--device cuda: ")
    assert load(files / "in.lat")[1]["moss.device"] == "cpu"        # auto chose the CPU



def test_two_inputs_on_stdin_are_a_usage_error(files):
    picture = (files / "in.png").read_bytes()
    for command, args in (("moss-image", ["--prompt", "a fox", "--init-image", "-", "--mask", "-"]),
                          ("moss-image", ["--prompt-file", "-", "--init-image", "-"]),
                          ("moss-denoise", [files / "p.enc", "--init", "-", "--mask", "-"]),
                          ("moss-denoise", ["-", "--init", "-"])):
        out = ["--picture", files / "out.png"] if command == "moss-image" else ["--out", files / "out.file"]
        r = run(command, *args, *DENOISE, *out, stdin=picture)
        assert "cannot both be stdin" in single_error(r) and r.code == 2, r.stderr
    assert not (files / "out.png").exists() and not (files / "out.file").exists()


def test_a_picture_is_turned_upright_by_its_exif_orientation_as_diffusers_load_image_does(tmp_path):
    """Stored 80x48 with orientation 6 (turn 90 degrees clockwise to show): read as the 48x80 picture it shows,
    pixel for pixel PIL.ImageOps.exif_transpose's; without the tag, as stored (the control)."""
    from PIL import ImageOps
    from moss_cli import picture
    a = (np.random.default_rng(3).random((48, 80, 3)) * 255).astype(np.uint8)
    stored = Image.fromarray(a)
    tagged, plain = io.BytesIO(), io.BytesIO()
    exif = stored.getexif()
    exif[0x0112] = 6
    stored.save(tagged, "PNG", exif=exif)
    stored.save(plain, "PNG")
    turned = picture.from_bytes(tagged.getvalue(), "tagged")
    assert turned.size == (48, 80) and turned.target() == (48, 80)
    want = ImageOps.exif_transpose(Image.open(io.BytesIO(tagged.getvalue())))
    assert np.array_equal(np.array(turned.image), np.array(want))
    assert picture.from_bytes(plain.getvalue(), "plain").size == (80, 48)
    assert turned.sha256 == __import__("hashlib").sha256(tagged.getvalue()).hexdigest()     # of the file's bytes


def test_an_animated_webp_is_refused_and_a_16_bit_gray_picture_keeps_its_values(tmp_path):
    """An animated WebP was read as its first frame, silently; a 16-bit grayscale PNG came out nearly white
    through pillow's own conversion (the control below): now its top 8 bits."""
    from moss_cli import picture
    from moss_cli.errors import PictureError
    frames = [Image.fromarray(np.full((48, 64, 3), v, np.uint8)) for v in (0, 255)]
    anim = io.BytesIO()
    frames[0].save(anim, "WEBP", save_all=True, append_images=frames[1:], duration=100)
    with pytest.raises(PictureError, match="an animated picture \\(2 frames\\)"):
        picture.from_bytes(anim.getvalue(), "anim.webp")
    mpo = io.BytesIO()                    # a camera's JPEG with a second (preview) frame: its first is the picture
    frames[0].save(mpo, "MPO", save_all=True, append_images=frames[1:])
    assert np.array_equal(np.array(picture.from_bytes(mpo.getvalue(), "mpo.jpg").image.convert("RGB")),
                          np.array(Image.open(io.BytesIO(mpo.getvalue())).convert("RGB")))
    a = (np.random.default_rng(1).random((48, 64)) * 65535).astype(np.uint16)
    gray = io.BytesIO()
    Image.fromarray(a).save(gray, "PNG")
    got = picture.from_bytes(gray.getvalue(), "g16").rgb(64, 48)
    want = (a >> 8).astype(np.float32) / np.float32(255) * np.float32(2) - np.float32(1)
    assert all(np.array_equal(got[c], want) for c in range(3))
    clipped = np.array(Image.open(io.BytesIO(gray.getvalue())).convert("RGB"))
    assert (clipped == 255).mean() > 0.9                  # pillow's conversion: what the picture was before
