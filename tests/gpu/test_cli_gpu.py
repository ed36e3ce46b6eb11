"""On a GPU: the commands with --device cuda on the tiny checkpoint give the same bytes from process to
process, moss-image equals the chained commands, and several seeds in one call give the single calls'
pictures."""

import subprocess
import sys

import pytest

import cuda_kernels

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")


def _run(command, *args):
    r = subprocess.run([sys.executable, "-c", f"import sys; from moss_cli.cli import {command} as c; c()", *args],
                       capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    return r


def test_gpu_commands_are_deterministic_and_moss_image_equals_the_chain_and_its_single_runs(tmp_path):
    enc, a, b, png = tmp_path / "p.enc", tmp_path / "a.lat", tmp_path / "b.lat", tmp_path / "chain.png"
    _run("encode_command", "--prompt", "a red fox", "--device", "cuda", "--out", str(enc))
    for lat in (a, b):
        r = _run("denoise_command", str(enc), "--seed", "7", "--steps", "3", "--device", "cuda", "--out", str(lat))
        assert b"device cuda" in r.stderr
    assert a.read_bytes() == b.read_bytes()
    _run("decode_command", str(a), "--device", "cuda", "--out", str(png))
    keep = tmp_path / "keep"
    _run("image_command", "--prompt", "a red fox", "--seed", "7", "--steps", "3", "--device", "cuda",
         "--picture", str(tmp_path / "one.png"), "--keep", str(keep))
    assert (keep / "latents.lat").read_bytes() == a.read_bytes()
    assert (tmp_path / "one.png").read_bytes() == png.read_bytes()
    _run("image_command", "--prompt", "a red fox", "--seed", "8", "--steps", "3", "--device", "cuda",
         "--picture", str(tmp_path / "eight.png"))
    _run("image_command", "--prompt", "a red fox", "--seed", "7,8", "--steps", "3", "--device", "cuda",
         "--picture", str(tmp_path / "many-{seed}.png"))
    assert (tmp_path / "many-7.png").read_bytes() == png.read_bytes()
    assert (tmp_path / "many-8.png").read_bytes() == (tmp_path / "eight.png").read_bytes()
