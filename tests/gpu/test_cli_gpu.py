"""On a GPU: the commands with --device cuda on the tiny checkpoint give the same bytes from process to
process, and moss-image equals the chained commands."""

import subprocess
import sys

import pytest

import cuda_kernels

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")


def _run(*args):
    r = subprocess.run([sys.executable, "-c", "import sys; from moss_cli.cli import %s as c; sys.argv[0] = 'x'; c()"
                        % args[0], *args[1:]], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    return r


def test_gpu_latents_are_byte_identical_between_processes_and_moss_image_equals_the_chain(tmp_path):
    enc, a, b = tmp_path / "p.enc", tmp_path / "a.lat", tmp_path / "b.lat"
    _run("encode_command", "--prompt", "a red fox", "--device", "cuda", "--out", str(enc))
    for lat in (a, b):
        r = _run("denoise_command", str(enc), "--seed", "7", "--steps", "3", "--device", "cuda", "--out", str(lat))
        assert b"device cuda" in r.stderr
    assert a.read_bytes() == b.read_bytes()
    png = tmp_path / "chain.png"
    _run("decode_command", str(a), "--device", "auto", "--out", str(png))
    keep = tmp_path / "keep"
    _run("image_command", "--prompt", "a red fox", "--seed", "7", "--steps", "3", "--device", "auto",
         "--picture", str(tmp_path / "one.png"), "--keep", str(keep))
    assert (keep / "latents.lat").read_bytes() == a.read_bytes()
    assert (tmp_path / "one.png").read_bytes() == png.read_bytes()
