"""The reference cases in cases/: they regenerate exactly from their independent sources, and our
stages agree with them (rows: transformers in float64; noise: torch.randn; DiT: a float64 torch statement;
pixels: diffusers).

Gates (max relative error), measured on tiny-fox and set at 2-5x:
  rows, float32 path (moss-encode)       measured 8.1e-6  gate ROWS32_GATE = 2e-5
  rows, float64 path                     measured 3.4e-8  gate ROWS64_GATE = 1e-7 (the cases hold float32)
  velocity per step, float32 (trace)     measured 1.2e-6  gate VELOCITY_GATE = 4e-6
  velocity per step, float64 path        measured 5.6e-8  gate VELOCITY64_GATE = 2e-7
  final latents (moss-denoise)           measured 7.0e-7  gate LATENTS_GATE = 2.5e-6
Planted controls, each asserted to fail its gate here: the encoder's final-norm eps x10 (rows, float64 path:
1.0e-6), every DiT RMSNorm's eps x10 (moss_cli.transformer.EPS, velocity up to 1.8e-5) and the time sinusoid
in float32 (moss_cli.transformer.time_sinusoid, up to 2.0e-5), on both DiT paths.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cli_util import run
from planted import final_norm_eps_x10, time_sinusoid_float32
from moss_cli.checkpoint import open_checkpoint
from moss_cli.safetensors_io import load
from reference.fingerprint import fingerprint

ROOT = Path(__file__).resolve().parent.parent
CASES = sorted(p for p in (ROOT / "cases").iterdir() if (p / "case.json").is_file())
ROWS32_GATE = 2e-5
ROWS64_GATE = 1e-7
VELOCITY_GATE = 4e-6
VELOCITY64_GATE = 2e-7
LATENTS_GATE = 2.5e-6


def rel(a, ref):
    return float(np.abs(a.astype(np.float64) - ref).max() / np.abs(ref).max())


def test_regeneration_reproduces_sha256sums():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "regenerate_cases.py"), "--check"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]


def test_fingerprint_statement_agrees_with_the_checkpoint_reader():
    checkpoint = open_checkpoint(None)
    assert fingerprint(checkpoint.root) == checkpoint.fingerprint


def denoise_options(spec):
    """moss-denoise's options for a case (its case.json)."""
    return ["--seed", spec["seed"], "--steps", spec["steps"], "--guidance", spec["guidance"],
            "--width", spec["width"], "--height", spec["height"], "--shift", spec["shift"],
            "--uncond-skip-layers", ",".join(map(str, spec["uncond_skip_layers"])),
            "--skip-start", spec["skip_start"], "--skip-stop", spec["skip_stop"], "--noise", spec["noise"], "--quiet"]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: p.name)
def case(request, tmp_path_factory):
    folder = request.param
    spec = json.loads((folder / "case.json").read_text())
    tmp = tmp_path_factory.mktemp(folder.name)
    args = denoise_options(spec)
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
    encoder = float64_encoder()
    for role in ("prompt", "negative"):
        np.testing.assert_array_equal(ours[f"{role}_ids"], ref[f"{role}_ids"])
        assert rel(encoder(ref[f"{role}_ids"]), ref[f"{role}_rows"]) <= ROWS64_GATE
        assert rel(ours[f"{role}_rows"], ref[f"{role}_rows"]) <= ROWS32_GATE


@pytest.mark.parametrize("folder", CASES, ids=lambda p: p.name)
def test_planted_final_norm_eps_fails_the_rows_gate(folder):
    ref, _ = load(folder / "prompt.enc")
    encoder = float64_encoder()
    final_norm_eps_x10(encoder.ops, encoder.tensors)
    assert rel(encoder(ref["prompt_ids"]), ref["prompt_rows"]) > 3 * ROWS64_GATE


@pytest.mark.parametrize("folder", CASES, ids=lambda p: p.name)
def test_planted_norm_epsilon_fails_the_float32_rows_gate(folder):
    """Control for ROWS32_GATE: every RMSNorm with epsilon 1e-5 (a common default, where the config says 1e-6)
    moves the float32 rows by ~0.3; the final norm's epsilon x10 above (1e-6) stays under the float32 path's own
    error, so it controls the float64 gate only."""
    from moss_cli import encoder
    from moss_cli.ops import numpy_ops
    ref, _ = load(folder / "prompt.enc")
    component = open_checkpoint(None).component("text_encoder")
    config = dict(encoder.text_config(component.config), rms_norm_eps=1e-5)
    planted = encoder.Qwen35Encoder(numpy_ops(np.float32), component.tensors, config)
    assert rel(planted(ref["prompt_ids"]), ref["prompt_rows"]) > 3 * ROWS32_GATE


def float64_encoder(dtype=np.float64):
    from moss_cli import encoder
    from moss_cli.ops import numpy_ops
    component = open_checkpoint(None).component("text_encoder")
    return encoder.Qwen35Encoder(numpy_ops(dtype), component.tensors, encoder.text_config(component.config))


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
        assert rel(ours[name], ref[name]) <= VELOCITY_GATE, name
    final_ours, _ = load(tmp / "ours.lat")
    final_ref, _ = load(folder / "latents.lat")
    assert rel(final_ours["latents"], final_ref["latents"]) <= LATENTS_GATE


def step_velocities(folder, dtype):
    """Each step's guided velocity, computed in-process from the case's own latents.NNN."""
    from moss_cli.ops import numpy_ops
    from moss_cli.schedule import timesteps
    from moss_cli.transformer import MossTransformer
    spec = json.loads((folder / "case.json").read_text())
    rows, _ = load(folder / "prompt.enc")
    trace, _ = load(folder / "trace.trace")
    component = open_checkpoint(None).component("transformer")
    model = MossTransformer(numpy_ops(dtype), component.tensors, component.config)
    cond, uncond = model.prepare_text(rows["prompt_rows"]), model.prepare_text(rows["negative_rows"])
    n, ts, g = spec["steps"], timesteps(trace["sigmas"]), spec["guidance"]
    out = {}
    for i in range(n):
        x, t = trace[f"latents.{i:03d}"], float(ts[i])
        skip = set(spec["uncond_skip_layers"]) if spec["skip_start"] <= i / n < spec["skip_stop"] else set()
        c, u = model.velocity(x, t, cond), model.velocity(x, t, uncond, skip)
        out[f"velocity.{i:03d}"] = u + g * (c - u)      # the sampler's guidance, in the path's dtype
    return out, trace


def worst_step(folder, dtype):
    ours, trace = step_velocities(folder, dtype)
    return max(rel(v, trace[name]) for name, v in ours.items())


@pytest.mark.parametrize("folder", CASES, ids=lambda p: p.name)
def test_float64_dit_path_agrees_with_every_step(folder):
    assert worst_step(folder, np.float64) <= VELOCITY64_GATE


@pytest.mark.parametrize("folder", CASES, ids=lambda p: p.name)
@pytest.mark.parametrize("bug", [("EPS", 1e-5), ("time_sinusoid", time_sinusoid_float32)],
                         ids=["norm_eps_x10", "time_sinusoid_float32"])
def test_planted_dit_bugs_fail_the_velocity_gates(folder, bug, monkeypatch):
    from moss_cli import transformer
    monkeypatch.setattr(transformer, *bug)
    assert worst_step(folder, np.float32) > VELOCITY_GATE
    assert worst_step(folder, np.float64) > 3 * VELOCITY64_GATE


@pytest.mark.parametrize("folder", CASES, ids=lambda p: p.name)
def test_planted_dit_bug_through_moss_denoise_fails_the_trace_and_latents_gates(folder, tmp_path, monkeypatch):
    """The same norm-epsilon plant, run through moss-denoise itself (the path the trace and LAT gates above
    hold): every step's velocity and the final latents must fail their gates."""
    from moss_cli import cli, transformer
    spec = json.loads((folder / "case.json").read_text())
    monkeypatch.setattr(transformer, "EPS", 1e-5)
    args = [str(a) for a in (folder / "prompt.enc", *denoise_options(spec), "--device", "cpu",
                             "--trace", tmp_path / "planted.trace", "--out", tmp_path / "planted.lat")]
    cli._denoise.main(args, standalone_mode=False)
    ref, _ = load(folder / "trace.trace")
    planted, _ = load(tmp_path / "planted.trace")
    steps = sorted(k for k in ref if k.startswith("velocity."))
    assert min(rel(planted[name], ref[name]) for name in steps) > VELOCITY_GATE
    final_ref, _ = load(folder / "latents.lat")
    final, _ = load(tmp_path / "planted.lat")
    assert rel(final["latents"], final_ref["latents"]) > 3 * LATENTS_GATE


def test_pixels_agree_with_diffusers(case):
    folder, tmp = case
    ours = np.asarray(Image.open(tmp / "ours.png").convert("RGB"), dtype=np.int16)
    ref = np.asarray(Image.open(folder / "picture.png").convert("RGB"), dtype=np.int16)
    assert ours.shape == ref.shape
    diff = np.abs(ours - ref)
    assert diff.max() <= 1 and np.count_nonzero(diff) <= max(1, 0.001 * diff.size)
