"""The commands as a user runs them: bytes, pipes, determinism and one-line errors (pipeline.md)."""

import json
import os

import numpy as np
import pytest
from PIL import Image

from cli_util import FAST, copy_model, encode_fixture, run, single_error
from moss_cli.safetensors_io import dumps, load

@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    return encode_fixture(tmp_path_factory)


def test_encode_twice_gives_identical_bytes(tmp_path, enc):
    again = tmp_path / "again.enc"
    assert run("moss-encode", "--prompt", "a red fox in snow", "--out", again, "--quiet").code == 0
    assert again.read_bytes() == enc.read_bytes()
    tensors, meta = load(enc)
    assert meta["moss.stage"] == "encode" and meta["moss.prompt"] == "a red fox in snow"
    assert tensors["prompt_rows"].dtype == np.float32 and tensors["prompt_ids"].dtype == np.int32
    assert tensors["prompt_rows"].shape[0] == tensors["prompt_ids"].shape[0]
    assert "negative_rows" in tensors


def test_encode_to_stdout_equals_file(enc):
    r = run("moss-encode", "--prompt", "a red fox in snow", "--out", "-", "--quiet")
    assert r.code == 0 and r.stdout == enc.read_bytes()


def test_image_equals_chain_through_files_and_pipes(tmp_path):
    common = ["--seed", "42", *FAST]
    keep = tmp_path / "keep"
    keep.mkdir()
    assert run("moss-image", "--prompt", "a red fox", *common, "--picture", tmp_path / "one.png",
               "--keep", keep, "--quiet").code == 0
    assert run("moss-image", "--prompt", "a red fox", *common, "--picture", tmp_path / "two.png",
               "--quiet").code == 0
    assert run("moss-encode", "--prompt", "a red fox", "--out", tmp_path / "p.enc", "--quiet").code == 0
    assert run("moss-denoise", tmp_path / "p.enc", *common, "--out", tmp_path / "p.lat", "--quiet").code == 0
    assert run("moss-decode", tmp_path / "p.lat", "--out", tmp_path / "chain.png", "--quiet").code == 0
    enc = run("moss-encode", "--prompt", "a red fox", "--out", "-", "--quiet")
    lat = run("moss-denoise", "-", *common, "--out", "-", "--quiet", stdin=enc.stdout)
    png = run("moss-decode", "-", "--out", "-", "--quiet", stdin=lat.stdout)
    one = (tmp_path / "one.png").read_bytes()
    assert one == (tmp_path / "two.png").read_bytes() == (tmp_path / "chain.png").read_bytes() == png.stdout
    assert (keep / "prompt.enc").read_bytes() == (tmp_path / "p.enc").read_bytes() == enc.stdout
    assert (keep / "latents.lat").read_bytes() == (tmp_path / "p.lat").read_bytes() == lat.stdout
    picture = Image.open(tmp_path / "one.png")
    assert picture.mode == "RGB" and picture.size == (64, 48)
    params = json.loads(picture.text["parameters"])
    assert params["seed"] == 42 and params["prompt"] == "a red fox" and params["steps"] == 3


def test_trace_holds_noise_sigmas_and_each_step(tmp_path, enc):
    r = run("moss-denoise", enc, "--seed", "7", *FAST, "--trace", tmp_path / "t.trace", "--out",
            tmp_path / "l.lat", "--quiet")
    assert r.code == 0, r.stderr
    trace, meta = load(tmp_path / "t.trace")
    lat, _ = load(tmp_path / "l.lat")
    assert meta["moss.stage"] == "trace"
    np.testing.assert_array_equal(trace["latents.000"], trace["noise"])
    assert trace["sigmas"].shape == (4,) and trace["sigmas"][-1] == 0
    for i in range(3):   # x_{i+1} = x_i + (s_{i+1} - s_i) v_i, in float32
        dt = np.float32(trace["sigmas"][i + 1] - trace["sigmas"][i])
        nxt = trace[f"latents.{i + 1:03d}"] if i < 2 else lat["latents"]
        np.testing.assert_array_equal(nxt, trace[f"latents.{i:03d}"] + dt * trace[f"velocity.{i:03d}"])


def test_full_fifty_steps_work(tmp_path):
    r = run("moss-image", "--prompt", "x", "--seed", "1", "--width", "32", "--height", "32", "--steps", "50",
            "--picture", tmp_path / "p.png", "--quiet")
    assert r.code == 0, r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--width", "100"], "multiple of 16"),
    (["--height", "0"], "multiple of 16"),
    (["--steps", "0"], "at least 1"),
    (["--guidance", "-1"], ">= 0"),
    (["--guidance", "nan"], "finite"),
    (["--guidance", "inf"], "finite"),
])
def test_denoise_rejects_bad_options(tmp_path, enc, args, needle):
    out = tmp_path / "x.lat"
    line = single_error(run("moss-denoise", enc, "--seed", "1", *FAST, *args, "--out", out))
    assert needle in line and not out.exists()


def test_denoise_needs_negative_rows_for_cfg(tmp_path):
    assert run("moss-encode", "--prompt", "p", "--no-negative", "--out", tmp_path / "n.enc", "--quiet").code == 0
    out = tmp_path / "x.lat"
    line = single_error(run("moss-denoise", tmp_path / "n.enc", "--seed", "1", *FAST, "--out", out))
    assert "--no-negative" in line and not out.exists()
    assert run("moss-denoise", tmp_path / "n.enc", "--seed", "1", *FAST, "--guidance", "1", "--out", out,
               "--quiet").code == 0


def test_artifacts_of_another_stage_or_model_or_garbage_are_refused(tmp_path, enc):
    other = copy_model(tmp_path)
    cfg = json.loads((other / "scheduler" / "scheduler_config.json").read_text())
    cfg["num_train_timesteps"] = 1000  # same values, new bytes: still another fingerprint
    (other / "scheduler" / "scheduler_config.json").write_text(json.dumps(cfg, indent=1))
    out = tmp_path / "x.lat"
    assert "another model" in single_error(run("moss-denoise", enc, "--model", other, "--seed", "1", *FAST,
                                                "--out", out))
    (tmp_path / "junk.enc").write_bytes(b"\x00" * 40)
    assert "not a valid" in single_error(run("moss-denoise", tmp_path / "junk.enc", "--seed", "1", "--out", out))
    (tmp_path / "cut.enc").write_bytes(enc.read_bytes()[:-100])
    assert "not a valid" in single_error(run("moss-denoise", tmp_path / "cut.enc", "--seed", "1", "--out", out))
    assert not out.exists()


def test_decode_refuses_wrong_stage_shape_truncation_and_other_vae(tmp_path, enc):
    lat = tmp_path / "l.lat"
    assert run("moss-denoise", enc, "--seed", "3", *FAST, "--out", lat, "--quiet").code == 0
    png = tmp_path / "p.png"
    assert "expected LAT" in single_error(run("moss-decode", enc, "--out", png))
    tensors, meta = load(lat)
    (tmp_path / "bad.lat").write_bytes(dumps({"latents": tensors["latents"][:, :64]}, meta))
    assert "expected float32[1, 128" in single_error(run("moss-decode", tmp_path / "bad.lat", "--out", png))
    (tmp_path / "cut.lat").write_bytes(lat.read_bytes()[:-7])
    assert "not a valid LAT" in single_error(run("moss-decode", tmp_path / "cut.lat", "--out", png))
    other = copy_model(tmp_path)
    cfg = json.loads((other / "vae" / "config.json").read_text())
    cfg["batch_norm_eps"] = 1e-3
    (other / "vae" / "config.json").write_text(json.dumps(cfg))
    assert "another model" in single_error(run("moss-decode", lat, "--model", other, "--out", png))
    assert not png.exists()


def test_unwritable_outputs_fail_before_any_work(tmp_path, enc):
    missing = tmp_path / "no" / "such"
    assert "does not exist" in single_error(run("moss-encode", "--prompt", "p", "--out", missing / "x.enc"))
    lat = tmp_path / "x.lat"
    assert "does not exist" in single_error(run("moss-denoise", enc, "--seed", "1", *FAST, "--trace",
                                                 missing / "t.trace", "--out", lat))
    (tmp_path / "file").write_text("")
    assert "does not exist" in single_error(run("moss-image", "--prompt", "p", "--seed", "1", *FAST,
                                                 "--picture", tmp_path / "file" / "p.png"))
    assert "is a directory" in single_error(run("moss-decode", enc, "--out", tmp_path))
    assert not lat.exists() and not missing.exists()


@pytest.mark.parametrize("breakage,needle", [
    ("no-folder", "does not exist"),
    ("no-component", "vae"),
    ("no-tensor", "layers.3.self_attn.k_norm.weight"),
    ("wrong-shape", "layers.0.mlp.up_proj.weight"),
    ("truncated", "model.safetensors"),
])
def test_encode_names_what_is_wrong_with_the_checkpoint(tmp_path, breakage, needle):
    import shutil
    model = copy_model(tmp_path)
    te = model / "text_encoder" / "model.safetensors"
    if breakage == "no-folder":
        model = tmp_path / "nowhere"
    elif breakage == "no-component":
        shutil.rmtree(model / "vae")
    elif breakage in ("no-tensor", "wrong-shape"):
        tensors, meta = load(te)
        tensors = {k: np.array(v) for k, v in tensors.items()}
        prefix = "model.language_model."
        if breakage == "no-tensor":
            del tensors[prefix + "layers.3.self_attn.k_norm.weight"]
        else:
            w = tensors[prefix + "layers.0.mlp.up_proj.weight"]
            tensors[prefix + "layers.0.mlp.up_proj.weight"] = w[:-1]
        te.write_bytes(dumps(tensors, meta))
    else:
        te.write_bytes(te.read_bytes()[:-1000])
    out = tmp_path / "x.enc"
    line = single_error(run("moss-encode", "--model", model, "--prompt", "p", "--out", out))
    assert needle in line and not out.exists()


def _longest_prompt():
    """The most repeats of "fox " whose templated ids fit the encoder's 4096 (the tiny checkpoint's tokenizer)."""
    from moss_cli.checkpoint import open_checkpoint
    from moss_cli.stages import chat_tokenizer
    tokenizer = chat_tokenizer(open_checkpoint())
    low, high = 1, 8192                  # fits, does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if not tokenizer.encode_prompt("fox " * mid)[1] else (low, mid)
    return "fox " * low, "fox " * high, len(tokenizer.encode_prompt("fox " * low)[0])


def test_a_prompt_over_the_limit_is_refused_before_any_work_and_one_at_it_is_encoded(tmp_path):
    fits, over, n = _longest_prompt()
    assert 4090 <= n <= 4096
    out = tmp_path / "long.enc"
    assert "prompt: over the encoder's 4096 tokens" in single_error(run("moss-encode", "--prompt", over,
                                                                           "--no-negative", "--out", out))
    assert not out.exists()
    r = run("moss-encode", "--prompt", fits, "--no-negative", "--out", out, "--quiet")
    assert r.code == 0 and r.stderr == "", r.stderr
    assert load(out)[0]["prompt_ids"].shape == (n,)
    # moss-image checks every prompt of a file before its first picture
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n" + over + "\n")
    line = single_error(run("moss-image", "--prompt-file", prompts, "--seed", "1", "--steps", "1",
                            "--picture", tmp_path / "p-{line}.png"))
    assert "prompt on line 2 of --prompt-file" in line and not list(tmp_path.glob("p-*.png"))


def test_no_gpu_for_device_cuda_is_one_line(tmp_path):
    from moss_cli.device import gpu_status
    if gpu_status()[0]:
        pytest.skip("a GPU is usable here")
    out = tmp_path / "x.enc"
    assert "--device cuda" in single_error(run("moss-encode", "--prompt", "p", "--device", "cuda", "--out", out))
    assert not out.exists()


def test_readme_demo_makes_a_256_picture(tmp_path):
    r = run("moss-image", "--prompt", "a red fox in the snow", "--seed", "42", "--picture", tmp_path / "fox.png")
    assert r.code == 0, r.stderr
    assert Image.open(tmp_path / "fox.png").size == (256, 256)
    assert "step 8/8" in r.stderr and "sigma" in r.stderr      # the demo defaults, with progress


def test_binary_is_never_written_to_a_terminal():
    import pty
    import subprocess
    from cli_util import BIN
    primary, secondary = pty.openpty()
    p = subprocess.run([str(BIN / "moss-encode"), "--prompt", "p", "--out", "-"], stdout=secondary,
                       stderr=subprocess.PIPE, timeout=60)
    os.close(secondary)
    os.close(primary)
    assert p.returncode != 0 and "stdout is a terminal" in p.stderr.decode()
