"""Outputs that never clobber what they should not, and inputs that end in one line, not an internal error
(pipeline.md: bad input gets one clear line and a non-zero exit; written files are whole or absent)."""

import importlib.util
import json
import os
import socket
import stat
import subprocess
import threading
import tracemalloc

import numpy as np
import pytest

from cli_util import BIN, FAST, copy_model, encode_fixture, run, single_error
from moss_cli import artifacts, batch, device, stages
from moss_cli.checkpoint import open_checkpoint
from moss_cli.errors import UsageError
from moss_cli.safetensors_io import load

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="making a character device needs root")
DENOISE = ["--seed", "1", *FAST, "--quiet"]


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    return encode_fixture(tmp_path_factory)


@pytest.fixture(scope="module")
def lat(tmp_path_factory, enc):
    out = tmp_path_factory.mktemp("lat") / "p.lat"
    assert run("moss-denoise", enc, *DENOISE, "--out", out).code == 0
    return out


def reader(path):
    """A thread reading the FIFO PATH to its end; .got holds the bytes once joined."""
    def read():
        with open(path, "rb") as f:
            thread.got = f.read()
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def device_file(path, minor):
    """A character device with the major/minor of /dev/null (3) or /dev/full (7), in the test's folder."""
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    return path


def run_closed(stream, command, *args):
    """COMMAND with its stdin (0) or stdout (1) closed, as a shell's <&- or >&- leaves it."""
    argv = ["sh", "-c", f'exec "$@" {stream}>&-', "sh", str(BIN / command), *map(str, args)]
    return subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)


# --- 1: special files are written in place, never replaced -----------------------------------------

def test_a_fifo_output_gets_the_artifact_and_stays_a_fifo(tmp_path, enc, lat):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got = reader(fifo)
    r = run("moss-denoise", enc, *DENOISE, "--out", fifo)
    got.join(60)
    assert r.code == 0, r.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert got.got == lat.read_bytes()


@ROOT_ONLY
def test_a_character_device_output_is_written_into_not_replaced(tmp_path, enc, lat):
    null, full = device_file(tmp_path / "null", 3), device_file(tmp_path / "full", 7)
    r = run("moss-denoise", enc, *DENOISE, "--out", tmp_path / "a.lat", "--trace", null)
    assert r.code == 0, r.stderr
    assert stat.S_ISCHR(os.stat(null).st_mode)
    assert run("moss-decode", lat, "--out", null, "--quiet").code == 0      # no .png needed for a device
    assert stat.S_ISCHR(os.stat(null).st_mode)
    line = single_error(run("moss-denoise", enc, *DENOISE, "--out", full))
    assert "cannot write (No space left on device)" in line
    assert stat.S_ISCHR(os.stat(full).st_mode)


def test_a_dev_fd_pipe_output_is_written_into(enc, lat):
    read, write = os.pipe()
    argv = [str(BIN / "moss-denoise"), str(enc), *DENOISE, "--out", f"/dev/fd/{write}"]
    p = subprocess.Popen(argv, pass_fds=(write,), stderr=subprocess.PIPE)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        got = f.read()
    assert p.wait(300) == 0, p.stderr.read()
    assert got == lat.read_bytes()


def test_a_socket_is_refused_and_a_link_keeps_pointing_at_the_new_file(tmp_path, enc, lat):
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s"))
    try:
        line = single_error(run("moss-denoise", enc, *DENOISE, "--out", tmp_path / "s"))
    finally:
        sock.close()
    assert "is a block device or a socket" in line
    target = tmp_path / "target.lat"
    target.write_bytes(b"old")
    (tmp_path / "link.lat").symlink_to(target)
    assert run("moss-denoise", enc, *DENOISE, "--out", tmp_path / "link.lat").code == 0
    assert (tmp_path / "link.lat").is_symlink() and target.read_bytes() == lat.read_bytes()


# --- 2: an output that is an input, or two outputs that are one file ------------------------------------

def test_an_output_that_is_the_input_is_refused_before_any_work(tmp_path, enc, lat):
    copy = tmp_path / "p.enc"
    copy.write_bytes(enc.read_bytes())
    os.link(copy, tmp_path / "hard.enc")
    (tmp_path / "soft.enc").symlink_to(copy)
    for out in (copy, tmp_path / "hard.enc", tmp_path / "soft.enc", tmp_path / "." / "p.enc"):
        r = run("moss-denoise", copy, *DENOISE, "--out", out)
        assert "is the input ENC" in single_error(r) and "loading" not in r.stderr
        assert copy.read_bytes() == enc.read_bytes()
    (tmp_path / "l.png").symlink_to(lat)
    assert "is the input LAT" in single_error(run("moss-decode", lat, "--out", tmp_path / "l.png"))
    assert load(lat)[1]["moss.stage"] == "denoise"
    prompts = tmp_path / "prompts.png"
    prompts.write_text("a fox\n")
    line = single_error(run("moss-image", "--prompt-file", prompts, "--seed", "1", "--picture", prompts))
    assert "is --prompt-file" in line and prompts.read_text() == "a fox\n"


def test_a_picture_or_mask_to_start_from_is_an_input_too(tmp_path, enc):
    from PIL import Image
    photo, mask = tmp_path / "photo.png", tmp_path / "mask.png"
    Image.new("RGB", (64, 48), (200, 30, 30)).save(photo)
    Image.new("L", (64, 48), 255).save(mask)
    kept = photo.read_bytes(), mask.read_bytes()
    line = single_error(run("moss-encode-image", photo, "--out", photo))
    assert "is the input picture" in line
    for extra, says in ((["--picture", photo], "is --init-image"), (["--mask", mask, "--picture", mask], "is --mask")):
        args = ["--prompt", "x", "--seed", "1", *FAST, "--init-image", photo]
        line = single_error(run("moss-image", *args, *(extra if "--mask" in extra else extra)))
        assert says in line, line
    image = tmp_path / "photo.img"
    assert run("moss-encode-image", photo, "--out", image, "--quiet").code == 0
    line = single_error(run("moss-denoise", enc, *DENOISE, "--init", image, "--mask", mask, "--out", mask))
    assert "is --mask" in line
    assert (photo.read_bytes(), mask.read_bytes()) == kept


def test_two_outputs_that_are_one_file_are_refused(tmp_path, enc):
    line = single_error(run("moss-denoise", enc, *DENOISE, "--out", tmp_path / "a.lat", "--trace",
                            tmp_path / "." / "a.lat"))
    assert "are one file" in line and not (tmp_path / "a.lat").exists()
    keep = tmp_path / "keep"
    keep.mkdir()
    (tmp_path / "pic.png").write_bytes(b"")
    os.link(tmp_path / "pic.png", keep / "latents.lat")
    line = single_error(run("moss-image", "--prompt", "p", "--seed", "1", "--picture", tmp_path / "pic.png",
                            "--keep", keep))
    assert "are one file" in line and (tmp_path / "pic.png").read_bytes() == b""


def test_check_apart_names_files_by_inode_and_new_ones_by_resolved_path(tmp_path):
    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    artifacts.check_apart([("--out", tmp_path / "x"), ("--trace", tmp_path / "y")], [("in", tmp_path / "a")])
    artifacts.check_apart([("--out", "-")], [("in", "-")])
    with pytest.raises(UsageError, match="is in"):
        artifacts.check_apart([("--out", tmp_path / "b")], [("in", tmp_path / "a")])
    with pytest.raises(UsageError, match="one file"):
        artifacts.check_apart([("--out", tmp_path / "x"), ("--trace", tmp_path / "sub" / ".." / "x")])


# --- 3: prompts that are not UTF-8 ------------------------------------------------------------------

@pytest.mark.parametrize("command,args,option,byte", [
    ("moss-image", ["--prompt", b"\xff\xfe bad", "--seed", "1", "--picture", "{tmp}/a.png"], "--prompt", 0),
    ("moss-image", ["--prompt", "p", "--negative", b"ok \xff", "--seed", "1", "--picture", "{tmp}/a.png"],
     "--negative", 3),
    ("moss-encode", ["--prompt", b"caf\xc3\xa9 \xe9", "--out", "{tmp}/a.enc"], "--prompt", 6),
    ("moss-encode", ["--prompt", "p", "--negative", b"\xff", "--out", "{tmp}/a.enc"], "--negative", 0),
])
def test_a_prompt_that_is_not_utf8_is_one_line(tmp_path, command, args, option, byte):
    args = [os.fsdecode(a) if isinstance(a, bytes) else a.format(tmp=tmp_path) for a in args]
    r = run(command, *args)
    assert r.code == 1 and single_error(r).endswith(f"{option}: not UTF-8 text (byte {byte})")
    assert "internal error" not in r.stderr and list(tmp_path.iterdir()) == []


def test_a_prompt_file_line_that_is_not_utf8_is_named(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"a red fox\n\ncaf\xc3\xa9 \xff owl\n")
    r = run("moss-image", "--prompt-file", prompts, "--seed", "1", "--picture", tmp_path / "p-{line}.png")
    assert single_error(r).endswith(f"--prompt-file {prompts}: line 3 is not UTF-8 text (byte 17)")


# --- 4: closed standard streams ---------------------------------------------------------------------

def test_closed_stdin_and_stdout_are_one_line(tmp_path, enc):
    r = run_closed(0, "moss-denoise", "-", "--seed", "1", "--out", tmp_path / "a.lat")
    assert r.returncode == 1 and r.stderr.decode().strip().endswith("error: stdin is closed; pipe an artifact "
                                                                      "in or give a file name")
    r = run_closed(0, "moss-image", "--prompt-file", "-", "--seed", "1", "--picture", tmp_path / "a.png")
    assert r.returncode == 1 and "--prompt-file -: stdin is closed" in r.stderr.decode()
    r = run_closed(1, "moss-encode", "--prompt", "x", "--out", "-")
    assert r.returncode == 1 and "error: stdout is closed" in r.stderr.decode()
    r = run_closed(1, "moss-image", "--prompt", "x", "--seed", "1", "--picture", "-")
    assert r.returncode == 1 and "error: stdout is closed" in r.stderr.decode()
    assert list(tmp_path.iterdir()) == []


# --- 5: sizes too large for the machine ---------------------------------------------------------------

def test_a_size_past_the_machines_memory_is_refused_before_any_work(tmp_path, enc):
    r = run("moss-image", "--prompt", "x", "--seed", "1", "--width", "100000", "--height", "100000",
            "--picture", tmp_path / "a.png")
    line = single_error(r)
    assert r.code == 1 and "100000x100000: denoising needs at least" in line and "GB of memory" in line
    assert "encoding" not in r.stderr and "internal error" not in r.stderr
    r = run("moss-denoise", enc, "--seed", "1", "--width", "100000", "--height", "100000", "--out", tmp_path / "a.lat")
    assert "denoising needs at least" in single_error(r) and "loading" not in r.stderr
    assert list(tmp_path.iterdir()) == []
    from PIL import Image
    photo = tmp_path.parent / f"{tmp_path.name}-photo.png"
    Image.new("RGB", (64, 48)).save(photo)
    r = run("moss-encode-image", photo, "--width", "160000", "--height", "160000", "--out", tmp_path / "a.img")
    assert "160000x160000: encoding the picture needs at least" in single_error(r) and "loading" not in r.stderr
    r = run("moss-image", "--prompt", "x", "--seed", "1", "--width", "40000", "--height", "40000", "--init-image",
            photo, "--steps", "1", "--picture", tmp_path / "a.png")
    assert "encoding the picture needs at least" in single_error(r) and "loading" not in r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("given,says", [(["--gpu-memory", "abc"], "--gpu-memory 'abc': give a number of GB"),
                                        (["--gpu-memory", "-3"], "--gpu-memory -3: give a positive number"),
                                        ([], "$MOSS_GPU_MEMORY 'zzz': give a number of GB")])
def test_a_bad_gpu_memory_budget_is_refused_on_any_device(tmp_path, given, says):
    env = dict(os.environ, **({} if given else {"MOSS_GPU_MEMORY": "zzz"}))
    r = run("moss-encode", "--prompt", "x", "--device", "cpu", "--out", tmp_path / "a.enc", *given, env=env)
    assert says in single_error(r) and r.code == 1 and not (tmp_path / "a.enc").exists()


def test_a_reader_that_leaves_mid_write_fails_the_command(enc):
    """The LAT (about 2 MB at 512x512) does not fit a pipe's 64 KB: once the first bytes arrive the command is
    inside its write, which the kernel ends short when this reader closes; the command must not say it wrote."""
    argv = [str(BIN / "moss-denoise"), str(enc), "--seed", "1", "--steps", "1", "--width", "512", "--height", "512",
            "--out", "-"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(p.stdout.read(10)) == 10
    p.stdout.close()
    assert p.wait(timeout=300) == 1
    assert "wrote LAT" not in p.stderr.read().decode()


def test_the_room_check_names_the_need_and_what_the_machine_has():
    checkpoint = open_checkpoint()
    need = stages.host_need(checkpoint, "decode", 4096, 4096, "cpu")
    stages.check_room(checkpoint, "decode", 4096, 4096, "cpu", memory=need)
    with pytest.raises(UsageError, match=rf"4096x4096: decoding needs at least {need / 1e9:.1f} GB of memory, "
                                         r"and this machine has 0\.1 GB"):
        stages.check_room(checkpoint, "decode", 4096, 4096, "cpu", memory=10**8)
    assert stages.host_need(checkpoint, "denoise", 1024, 1024, "cuda") == 12 * 128 * 64 * 64   # the noise draw
    assert 0 < stages.host_memory()


@pytest.mark.parametrize("stage", ["denoise", "decode", "encode-image"])
def test_the_need_is_a_lower_bound_of_the_cpu_peak(stage, enc):
    """The room check never refuses a size the CPU could make: its need is at most what tracemalloc measures
    (and within 4x of it, so it is not vacuous)."""
    model = stages.Model(open_checkpoint())
    options = stages.SamplingOptions(seed=1, steps=1, width=512, height=384)
    source = artifacts.read(enc, "encode", model.fingerprint)
    for part in ("transformer", "decoder"):     # loaded first: weights are not what the estimate counts
        getattr(model, part)
    latents = artifacts.parse(stages.denoise(model, source, options)[0], "lat", "denoise")
    import io
    from PIL import Image
    from moss_cli import picture
    photo = io.BytesIO()
    Image.new("RGB", (640, 480), (90, 160, 40)).save(photo, format="PNG")
    photo = picture.from_bytes(photo.getvalue(), "photo")
    model.image_encoder
    tracemalloc.start()
    try:
        if stage == "denoise":
            stages.denoise(model, source, options)
        elif stage == "encode-image":
            stages.encode_image(model, photo, 512, 384)
        else:
            stages.decode_pixels(model, latents)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    need = stages.host_need(model.checkpoint, stage, 512, 384, "cpu")
    assert peak / 4 <= need <= peak, (need, peak)


# --- 6: steps run against steps asked --------------------------------------------------------------------

def test_steps_the_schedule_drops_are_recorded_and_warned(tmp_path, enc):
    """219 steps at shift 5 snap two sigmas onto one training sigma: 218 run."""
    out, trace = tmp_path / "a.lat", tmp_path / "a.trace"
    r = run("moss-denoise", enc, "--seed", "1", "--steps", "219", "--width", "16", "--height", "16", "--guidance",
            "1", "--out", out, "--trace", trace, "--quiet")
    assert r.code == 0, r.stderr
    assert "warning: --steps 219: the schedule runs 218 steps" in r.stderr
    meta = load(out)[1]
    assert meta["moss.steps"] == "219" and meta["moss.steps_run"] == "218"
    assert len([k for k in load(trace)[0] if k.startswith("velocity.")]) == 218
    assert run("moss-decode", out, "--out", tmp_path / "a.png", "--quiet").code == 0
    from PIL import Image
    params = json.loads(Image.open(tmp_path / "a.png").text["parameters"])
    assert params["steps"] == 219 and params["steps_run"] == 218


def test_steps_that_all_run_add_no_key(lat):
    r = load(lat)[1]
    assert r["moss.steps"] == "3" and "moss.steps_run" not in r


# --- 7: non-finite outputs -------------------------------------------------------------------------------

def poison(model, component, name):
    """NaN in tensor NAME of a model copy, written in place: the header, and so the fingerprint, unchanged."""
    for file in (model / component).glob("*.safetensors"):
        data = bytearray(file.read_bytes())
        size = int.from_bytes(data[:8], "little")
        entry = json.loads(data[8:8 + size]).get(name)
        if entry is None:
            continue
        start, stop = (8 + size + o for o in entry["data_offsets"])
        nan = {"F32": np.float32(np.nan).tobytes(), "BF16": b"\xc0\x7f"}[entry["dtype"]]
        data[start:stop] = nan * ((stop - start) // len(nan))
        file.write_bytes(bytes(data))
        return model
    raise KeyError(name)


@pytest.mark.parametrize("component,tensor,command", [
    ("text_encoder", "model.language_model.norm.weight", "moss-encode"),
    ("transformer", "final_linear_video.weight", "moss-denoise"),
    ("vae", "decoder.conv_out.weight", "moss-decode"),
    ("vae", "decoder.conv_out.weight", "moss-image"),
])
def test_nan_weights_give_one_line_and_no_file(tmp_path, enc, lat, component, tensor, command):
    model = poison(copy_model(tmp_path), component, tensor)
    out = tmp_path / ("out.png" if command in ("moss-decode", "moss-image") else "out.bin")
    args = {"moss-encode": ["--prompt", "a fox", "--out", out],
            "moss-denoise": [enc, *DENOISE, "--out", out],
            "moss-decode": [lat, "--out", out],
            "moss-image": ["--prompt", "a fox", *DENOISE, "--picture", out]}[command]
    r = run(command, "--model", model, *args)
    line = single_error(r)
    assert r.code == 1 and "hold NaN or infinite values" in line and "Warning" not in r.stderr
    assert not out.exists()


# --- 9: the smaller ones -------------------------------------------------------------------------------------

def test_device_cuda_without_a_gpu_names_the_missing_gpu(tmp_path, enc, monkeypatch):
    if device.gpu_status()[0]:
        pytest.skip("this machine has a usable GPU")
    if device.no_gpu() is None:
        pytest.skip("this machine has a GPU")
    line = single_error(run("moss-denoise", enc, *DENOISE, "--device", "cuda", "--out", tmp_path / "a.lat"))
    assert "--device cuda: no NVIDIA GPU" in line and "nvmath-python is not installed (" not in line
    monkeypatch.setattr(device, "no_gpu", lambda: None)    # a GPU, and the extra missing: the extra is named
    ok, why = device.gpu_status()
    if not ok and any(importlib.util.find_spec(m) is None for m in device.GPU_EXTRA):
        assert "not installed" in why and "no NVIDIA GPU" not in why


@pytest.mark.parametrize("seed", ["1_000", "\u0661\u0662", "0x10", "1e3"])
def test_both_commands_parse_seeds_alike(tmp_path, enc, seed):
    with pytest.raises(UsageError, match="give"):
        batch.parse_seed(seed)
    for command, args in (("moss-denoise", [enc, "--out", tmp_path / "a.lat"]),
                          ("moss-image", ["--prompt", "p", "--picture", tmp_path / "a.png"])):
        r = run(command, *args, "--seed", seed, *FAST)
        assert r.code == 1 and f"--seed {seed!r}: give" in single_error(r)
    assert batch.parse_seed(" 42 ") == 42 and batch.parse_seed("-5") == -5


def test_a_skip_layer_past_the_last_block_is_refused_before_any_work(tmp_path, enc):
    for command, args in (("moss-image", ["--prompt", "p", "--seed", "1", "--picture", tmp_path / "a.png"]),
                          ("moss-denoise", [enc, "--seed", "1", "--out", tmp_path / "a.lat"])):
        r = run(command, *args, "--uncond-skip-layers", "99")
        assert "skip layer 99 does not exist: the transformer has blocks 0..23" in single_error(r)
        assert "loading" not in r.stderr and "encoding" not in r.stderr


def test_a_missing_model_from_the_environment_names_the_variable(tmp_path):
    env = {**os.environ, "MOSS_IMAGE_MODEL": str(tmp_path / "nowhere")}
    line = single_error(run("moss-encode", "--prompt", "p", "--out", tmp_path / "a.enc", env=env))
    assert line.endswith(f"error: $MOSS_IMAGE_MODEL: {tmp_path / 'nowhere'}: model folder does not exist")
    line = single_error(run("moss-encode", "--model", tmp_path / "nowhere", "--prompt", "p", "--out",
                            tmp_path / "a.enc", env=env))
    assert "$MOSS_IMAGE_MODEL" not in line


def test_readme_states_exit_codes_and_how_outputs_are_written():
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text[text.index("## Exit codes and outputs"):]
    for code in ("`0`", "`1`", "`2`", "`3`", "`130`"):
        assert code in section
    assert "temporary name" in section and "FIFO" in section
