"""The commands as a new user meets them: literal paths in progress, --keep, output names, help texts,
option conflicts, seeds, full disks, and the small messages (pipeline.md)."""

import errno
import json
import os
import re
import signal
import subprocess

import numpy as np
import pytest
from PIL import Image

from cli_util import BIN, FAST, copy_model, encode_fixture, run, single_error
from moss_cli.safetensors_io import load

@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    return encode_fixture(tmp_path_factory)


def _warnings(r):
    return [line for line in r.stderr.splitlines() if ": warning:" in line]


# --- 1: text from the user or the disk is printed literally ------------------------------------

@pytest.mark.parametrize("name", ["a[/b]c", "[red]m", "x :smile: y"])
def test_model_paths_with_markup_are_printed_literally(tmp_path, name):
    model = copy_model(tmp_path, name)
    r = run("moss-encode", "--model", model, "--prompt", "[bold]x[/bold]", "--out", tmp_path / "z.enc")
    assert r.code == 0, r.stderr
    assert f"model {model} (" in r.stderr


# --- 2: --keep makes its folder and keeps what a stopped run finished ---------------------------

def test_keep_folder_is_created_like_mkdir_p(tmp_path):
    keep = tmp_path / "work" / "deeper"
    r = run("moss-image", "--prompt", "a red fox", "--seed", "42", *FAST, "--picture", tmp_path / "fox.png",
            "--keep", f"{keep}/", "--quiet")
    assert r.code == 0, r.stderr
    assert (keep / "prompt.enc").is_file() and (keep / "latents.lat").is_file()
    (tmp_path / "file").write_text("")
    line = single_error(run("moss-image", "--prompt", "x", "--seed", "1", *FAST, "--picture",
                             tmp_path / "p.png", "--keep", tmp_path / "file"))
    assert "not a folder" in line and not (tmp_path / "p.png").exists()


def test_an_interrupted_run_keeps_the_finished_stage_files(tmp_path):
    keep = tmp_path / "work"
    picture = tmp_path / "p.png"
    p = subprocess.Popen([str(BIN / "moss-image"), "--prompt", "a red fox", "--seed", "1", "--width", "64",
                          "--height", "64", "--steps", "100000", "--picture", str(picture), "--keep", str(keep)],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                         # a suite started in the background (bash `&`) ignores SIGINT, and children inherit that
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in p.stderr:            # interrupt once denoising has begun, i.e. encoding is over
            if "step 1/" in line:
                p.send_signal(signal.SIGINT)
                break
        rest = p.stderr.read()
        assert p.wait(timeout=120) == 130, rest
    finally:
        p.kill()
    assert "moss-image: aborted" in rest and "Traceback" not in rest
    assert (keep / "prompt.enc").is_file() and not (keep / "latents.lat").exists() and not picture.exists()
    assert sorted(os.listdir(keep)) == ["prompt.enc"]          # no temporary names left behind
    ref = tmp_path / "ref.enc"
    assert run("moss-encode", "--prompt", "a red fox", "--out", ref, "--quiet").code == 0
    assert (keep / "prompt.enc").read_bytes() == ref.read_bytes()


# --- 3: an output name that names a folder ------------------------------------------------------

def test_outputs_ending_in_a_separator_are_refused(tmp_path, enc, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "names a folder" in single_error(run("moss-encode", "--prompt", "p", "--out", "dirx/"))
    assert "names a folder" in single_error(run("moss-denoise", enc, "--seed", "1", *FAST, "--out", "dirx/"))
    assert "names a folder" in single_error(run("moss-denoise", enc, "--seed", "1", *FAST, "--trace", "dirx/",
                                                 "--out", "x.lat"))
    assert "names a folder" in single_error(run("moss-decode", enc, "--out", "dirx/"))
    assert "names a folder" in single_error(run("moss-image", "--prompt", "p", "--seed", "1", *FAST,
                                                 "--picture", "dirx/"))
    (tmp_path / "folder").mkdir()
    assert "is a directory" in single_error(run("moss-image", "--prompt", "p", "--seed", "1", *FAST,
                                                 "--picture", "folder"))
    assert sorted(os.listdir(tmp_path)) == ["folder"]


# --- 4, 5, 7: help texts ------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["moss-denoise", "moss-image"])
def test_help_states_the_defaults_that_apply_and_the_seed_rules(command):
    r = run(command, "--help")
    assert r.code == 0
    text = " ".join(r.stdout.decode().split())
    for option in ("--width", "--height"):
        assert re.search(rf"{option} INTEGER [^-]*\[checkpoint's or 1024\]", text), text
    assert "[1024]" not in text
    for option in ("--skip-start FLOAT", "--skip-stop FLOAT"):
        assert re.search(rf"{re.escape(option)} \w", text), f"{option} has no help text"
    seed = text[text.index("--seed "):text.index("--steps INTEGER")]
    assert "-2**63 to 2**64-1" in seed
    if command == "moss-denoise":      # moss-image's --seed refers to it
        assert "manual_seed" in seed and "randn" in seed and "bit for bit" in seed


@pytest.mark.parametrize("args", [
    ["--skip-start", "2"], ["--skip-start", "-0.1"], ["--skip-stop", "1.5"],
    ["--skip-start", "0.6", "--skip-stop", "0.5"],
])
def test_skip_window_outside_0_1_or_reversed_is_refused(tmp_path, enc, args):
    out = tmp_path / "x.lat"
    line = single_error(run("moss-denoise", enc, "--seed", "1", *FAST, *args, "--out", out))
    assert "0 <= start <= stop <= 1" in line and not out.exists()


def test_skip_window_edges_are_accepted(tmp_path, enc):
    for args in (["--skip-start", "0", "--skip-stop", "0"], ["--skip-start", "1", "--skip-stop", "1"]):
        assert run("moss-denoise", enc, "--seed", "1", *FAST, *args, "--out", tmp_path / "x.lat",
                   "--quiet").code == 0


# --- 6: conflicting options ---------------------------------------------------------------------

def test_no_negative_with_a_negative_is_refused(tmp_path):
    out = tmp_path / "x.enc"
    for negative in ("blurry", ""):
        r = run("moss-encode", "--prompt", "fox", "--no-negative", "--negative", negative, "--out", out)
        line = single_error(r)
        assert "--no-negative" in line and "--negative" in line and not out.exists() and r.code == 2


@pytest.mark.parametrize("args,says", [([], "give --prompt TEXT or --prompt-file FILE"),
                                       (["--prompt", "p", "--prompt-file", "-"], "give one of them, not both")])
def test_a_missing_or_conflicting_option_exits_2_as_clicks_own_do(tmp_path, args, says):
    r = run("moss-image", *args, "--seed", "1", "--picture", tmp_path / "a.png")
    assert says in single_error(r) and r.code == 2
    r = run("moss-image", "--seed", "1", "--picture", tmp_path / "a.png", "--steps", "abc")      # click's own
    assert r.code == 2


def test_negative_with_guidance_1_warns_once(tmp_path):
    common = ["--prompt", "fox", "--seed", "1", *FAST, "--guidance", "1", "--quiet"]
    r = run("moss-image", *common, "--negative", "blurry", "--picture", tmp_path / "a.png")
    assert r.code == 0, r.stderr
    assert len(_warnings(r)) == 1 and "--negative" in _warnings(r)[0] and "unused" in _warnings(r)[0]
    r = run("moss-image", *common, "--picture", tmp_path / "b.png")
    assert r.code == 0 and _warnings(r) == []
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


# --- 7: seeds -----------------------------------------------------------------------------------

def test_accepted_seeds_are_torchs():
    torch = pytest.importorskip("torch")
    from moss_cli import noise
    from moss_cli.stages import SEED_MAX, SEED_MIN
    assert (SEED_MIN, SEED_MAX) == (-2**63, 2**64 - 1)
    for seed in (SEED_MIN - 1, SEED_MAX + 1, 99999999999999999999999):
        with pytest.raises((RuntimeError, ValueError, OverflowError)):
            torch.Generator().manual_seed(seed)
    for seed in (SEED_MIN, -1, 0, 2**63, SEED_MAX):
        ref = torch.randn((1, 4, 2, 3), generator=torch.Generator().manual_seed(seed)).numpy()
        np.testing.assert_array_equal(noise.randn((1, 4, 2, 3), seed), ref)
        np.testing.assert_array_equal(noise.randn((1, 128, 2, 3), seed),
                                      torch.randn((1, 128, 2, 3), generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("seed", [str(2**64), str(-2**63 - 1), "99999999999999999999999"])
def test_seeds_torch_refuses_are_refused(tmp_path, enc, seed):
    out = tmp_path / "x.lat"
    line = single_error(run("moss-denoise", enc, "--seed", seed, *FAST, "--out", out))
    assert f"--seed {seed}" in line and "2**64-1" in line and not out.exists()


def test_negative_seed_is_the_same_noise_as_its_uint64(tmp_path, enc):
    for seed in ("-1", str(2**64 - 1)):
        assert run("moss-denoise", enc, "--seed", seed, *FAST, "--out", tmp_path / f"{seed}.lat",
                   "--quiet").code == 0
    a, _ = load(tmp_path / "-1.lat")
    b, _ = load(tmp_path / f"{2**64 - 1}.lat")
    np.testing.assert_array_equal(a["latents"], b["latents"])


# --- 8: output I/O errors -----------------------------------------------------------------------

@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_full_disk_on_stdout_is_one_line_and_exit_1():
    with open("/dev/full", "wb") as full:
        p = subprocess.run([str(BIN / "moss-encode"), "--prompt", "fox", "--out", "-", "--quiet"], stdout=full,
                           stderr=subprocess.PIPE, timeout=120)
    stderr = p.stderr.decode()
    assert p.returncode == 1, stderr
    assert stderr.strip().splitlines() == ["moss-encode: error: stdout: cannot write (No space left on device)"]


def test_a_full_disk_on_a_file_leaves_nothing(tmp_path, monkeypatch):
    from moss_cli import artifacts
    from moss_cli.errors import UsageError

    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fd, mode):
            self.f = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:10])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(artifacts.os, "fdopen", Full)
    with pytest.raises(UsageError, match="No space left on device"):
        artifacts.write(tmp_path / "x.enc", b"0123456789" * 100)
    assert os.listdir(tmp_path) == []


# --- 9: the smaller ones ------------------------------------------------------------------------

def test_a_png_given_as_an_artifact_is_named_a_png(tmp_path, enc):
    png = tmp_path / "p.png"
    assert run("moss-image", "--prompt", "p", "--seed", "1", *FAST, "--picture", png, "--quiet").code == 0
    line = single_error(run("moss-denoise", png, "--seed", "1", *FAST, "--out", tmp_path / "x.lat"))
    assert "is a PNG picture, not an ENC file" in line and "header length" not in line
    line = single_error(run("moss-decode", png, "--out", tmp_path / "y.png"))
    assert "is a PNG picture, not a LAT file" in line
    assert "is an ENC file, expected LAT" in single_error(run("moss-decode", enc, "--out", tmp_path / "y.png"))


def test_every_command_prints_the_device_first_and_where_it_wrote_last(tmp_path, enc):
    for argv, kind, target in [
        (["moss-encode", "--prompt", "p", "--out"], "ENC", tmp_path / "e.enc"),
        (["moss-denoise", enc, "--seed", "1", *FAST, "--out"], "LAT", tmp_path / "l.lat"),
        (["moss-decode", tmp_path / "l.lat", "--out"], "PNG", tmp_path / "d.png"),
        (["moss-image", "--prompt", "p", "--seed", "1", *FAST, "--picture"], "PNG", tmp_path / "i.png"),
    ]:
        r = run(*argv, target)
        assert r.code == 0, r.stderr
        lines = r.stderr.strip().splitlines()
        assert re.search(r"model .*, device cpu$", lines[0]), lines[0]
        assert lines[-1].endswith(f": wrote {kind} {target}"), lines[-1]
        assert r.stdout == b""
        assert run(*argv, target, "--quiet").stderr == ""
    r = run("moss-encode", "--prompt", "p", "--out", "-")
    assert r.stderr.strip().splitlines()[-1] == "moss-encode: wrote ENC to stdout"
    assert r.stdout[:8] != b"" and b"wrote" not in r.stdout


def test_step_times_start_once_the_input_is_read(tmp_path, enc, monkeypatch, capsys):
    """A pipeline's denoise waits on stdin for the encoder: that wait is not step 1's time."""
    from moss_cli import artifacts, cli, progress
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    read_bytes = artifacts.read_bytes

    def slow_read(path):
        clock[0] += 100.0          # the encoder upstream takes 100 s to write its ENC
        return read_bytes(path)

    monkeypatch.setattr(artifacts, "read_bytes", slow_read)
    cli._denoise.main([str(enc), "--seed", "1", *FAST, "--out", str(tmp_path / "x.lat")], standalone_mode=False)
    steps = [line for line in capsys.readouterr().err.splitlines() if " step " in line]
    assert any("step 1/3" in line for line in steps), steps
    for line in steps:   # every time shown (elapsed, estimates) is of the fake clock, which stood still
        times = re.findall(r"(\d+(?:\.\d+)?)s\b", line)
        assert times and all(float(t) == 0 for t in times), line


def test_png_parameters_hold_numbers_as_numbers(tmp_path):
    png = tmp_path / "p.png"
    assert run("moss-image", "--prompt", "a fox", "--seed", "42", *FAST, "--guidance", "2.5", "--picture", png,
               "--quiet").code == 0
    params = json.loads(Image.open(png).text["parameters"])
    assert params["seed"] == 42 and params["steps"] == 3 and params["width"] == 64 and params["height"] == 48
    assert params["guidance"] == 2.5 and params["shift"] == 5.0
    assert params["skip_start"] == 0.01 and params["skip_stop"] == 1.0
    for key in ("seed", "steps", "width", "height"):
        assert type(params[key]) is int
    for key in ("guidance", "shift", "skip_start", "skip_stop"):
        assert type(params[key]) is float
    assert params["prompt"] == "a fox" and params["uncond_skip_layers"] == "22" and params["noise"] == "avx2"


def test_picture_names_must_end_in_png(tmp_path, enc):
    lat = tmp_path / "l.lat"
    assert run("moss-denoise", enc, "--seed", "1", *FAST, "--out", lat, "--quiet").code == 0
    for name in ("f.jpg", "f", "f.png.tmp"):
        assert ".png" in single_error(run("moss-image", "--prompt", "p", "--seed", "1", *FAST, "--picture",
                                           tmp_path / name))
        assert ".png" in single_error(run("moss-decode", lat, "--out", tmp_path / name))
        assert not (tmp_path / name).exists()
    assert run("moss-decode", lat, "--out", tmp_path / "UPPER.PNG", "--quiet").code == 0
    r = run("moss-decode", lat, "--out", "-", "--quiet")
    assert r.code == 0 and r.stdout[:8] == b"\x89PNG\r\n\x1a\n"
