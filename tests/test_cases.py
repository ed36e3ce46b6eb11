"""The reference cases in cases/: they regenerate exactly from their independent sources, and our
stages agree with them (rows: transformers; noise: torch.randn; DiT: a float64 torch statement; pixels: diffusers)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cli_util import run
from moss_cli.checkpoint import open_checkpoint
from moss_cli.safetensors_io import load
from reference.fingerprint import fingerprint

ROOT = Path(__file__).resolve().parent.parent
CASES = sorted(p for p in (ROOT / "cases").iterdir() if (p / "case.json").is_file())


def rel(a, ref):
    return float(np.abs(a.astype(np.float64) - ref).max() / np.abs(ref).max())


def test_regeneration_reproduces_sha256sums():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "regenerate_cases.py"), "--check"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]


def test_fingerprint_statement_agrees_with_the_checkpoint_reader():
    checkpoint = open_checkpoint(None)
    assert fingerprint(checkpoint.root) == checkpoint.fingerprint


@pytest.fixture(scope="module", params=CASES, ids=lambda p: p.name)
def case(request, tmp_path_factory):
    folder = request.param
    spec = json.loads((folder / "case.json").read_text())
    tmp = tmp_path_factory.mktemp(folder.name)
    args = ["--seed", spec["seed"], "--steps", spec["steps"], "--guidance", spec["guidance"],
            "--width", spec["width"], "--height", spec["height"], "--shift", spec["shift"],
            "--uncond-skip-layers", ",".join(map(str, spec["uncond_skip_layers"])),
            "--skip-start", spec["skip_start"], "--skip-stop", spec["skip_stop"], "--noise", spec["noise"], "--quiet"]
    steps = [
        ("moss-encode", "--prompt", spec["prompt"], "--negative", spec["negative"], "--out", tmp / "ours.enc", "--quiet"),
        ("moss-denoise", folder / "prompt.enc", *args, "--trace", tmp / "ours.trace", "--out", tmp / "ours.lat"),
        ("moss-decode", folder / "latents.lat", "--out", tmp / "ours.png", "--quiet"),
    ]
    for command in steps:
        r = run(*command)
        assert r.code == 0, r.stderr
    return folder, tmp


def test_ids_equal_and_rows_agree_with_transformers(case):
    folder, tmp = case
    ref, _ = load(folder / "prompt.enc")
    ours, _ = load(tmp / "ours.enc")
    reference = float64_encoder()
    for role in ("prompt", "negative"):
        np.testing.assert_array_equal(ours[f"{role}_ids"], ref[f"{role}_ids"])
        # transformers' float32 rows are up to 1e-5 from exact on this checkpoint (our float64 path
        # measures that); ours are float32 too, so their gap may be the sum. The 1e-5 / 5e-6 gates of
        # the issue are held in test_encoder.py on unit-scale models.
        assert rel(reference(ref[f"{role}_ids"]), ref[f"{role}_rows"]) <= 1.5e-5
        assert rel(ours[f"{role}_rows"], ref[f"{role}_rows"]) <= 3e-5


def float64_encoder():
    from moss_cli import encoder
    from moss_cli.ops import numpy_ops
    component = open_checkpoint(None).component("text_encoder")
    return encoder.Qwen35Encoder(numpy_ops(np.float64), component.tensors, encoder.text_config(component.config))


def test_noise_and_sigmas_are_torchs_bit_for_bit(case):
    folder, tmp = case
    ref, _ = load(folder / "trace.trace")
    ours, _ = load(tmp / "ours.trace")
    for name in ("noise", "sigmas"):
        assert ours[name].dtype == np.float32
        np.testing.assert_array_equal(ours[name].view(np.uint32), ref[name].view(np.uint32))


def test_every_step_agrees_with_the_float64_dit_statement(case):
    folder, tmp = case
    ref, _ = load(folder / "trace.trace")
    ours, _ = load(tmp / "ours.trace")
    steps = sorted(k for k in ref if k.startswith("velocity."))
    assert steps and sorted(k for k in ours if k.startswith("velocity.")) == steps
    for name in steps:
        assert rel(ours[name], ref[name]) <= 1e-4, name
    final_ours, _ = load(tmp / "ours.lat")
    final_ref, _ = load(folder / "latents.lat")
    assert rel(final_ours["latents"], final_ref["latents"]) <= 1e-4


def test_pixels_agree_with_diffusers(case):
    folder, tmp = case
    ours = np.asarray(Image.open(tmp / "ours.png").convert("RGB"), dtype=np.int16)
    ref = np.asarray(Image.open(folder / "picture.png").convert("RGB"), dtype=np.int16)
    assert ours.shape == ref.shape
    diff = np.abs(ours - ref)
    assert diff.max() <= 1 and np.count_nonzero(diff) <= max(1, 0.001 * diff.size)
