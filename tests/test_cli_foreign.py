"""Foreign stage files: ENC and LAT tensors saved by another implementation, without moss metadata
(pipeline.md): used with one warning, recorded as foreign in the output, refused with one line when their
names, dtypes or shapes are not the stage's."""

import json

import ml_dtypes
import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import save_file

from cli_util import FAST, error_lines, run
from moss_cli.safetensors_io import dumps, load

@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A moss-cli ENC and LAT, and the PNG moss-decode makes of that LAT."""
    d = tmp_path_factory.mktemp("made")
    assert run("moss-encode", "--prompt", "a red fox", "--out", d / "p.enc", "--quiet").code == 0
    assert run("moss-denoise", d / "p.enc", "--seed", "5", *FAST, "--out", d / "p.lat", "--quiet").code == 0
    assert run("moss-decode", d / "p.lat", "--out", d / "p.png", "--quiet").code == 0
    return d


def _tensors(path):
    tensors, _ = load(path)
    return {k: np.array(v) for k, v in tensors.items()}


def _warnings(r):
    return [line for line in r.stderr.splitlines() if ": warning:" in line]


def single_error(r):
    assert r.code == 1, r.stderr
    errors = error_lines(r)
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    return errors[0]


def test_a_foreign_enc_runs_through_denoise_with_one_warning(tmp_path, made):
    foreign = tmp_path / "foreign.enc"
    save_file(_tensors(made / "p.enc"), str(foreign))          # the safetensors library, no metadata
    assert "moss.stage" not in load(foreign)[1]
    out, trace = tmp_path / "f.lat", tmp_path / "f.trace"
    r = run("moss-denoise", foreign, "--seed", "5", *FAST, "--trace", trace, "--out", out)
    assert r.code == 0, r.stderr
    assert len(_warnings(r)) == 1 and "could not be checked" in _warnings(r)[0] and str(foreign) in _warnings(r)[0]
    lat, meta = load(out)
    assert meta["moss.input"] == "foreign" and meta["moss.stage"] == "denoise"
    assert load(trace)[1]["moss.input"] == "foreign"
    np.testing.assert_array_equal(lat["latents"], load(made / "p.lat")[0]["latents"])   # same rows, same latents
    # a moss-cli ENC is not foreign: no warning, no mark
    r = run("moss-denoise", made / "p.enc", "--seed", "5", *FAST, "--out", tmp_path / "m.lat")
    assert r.code == 0 and _warnings(r) == [] and "moss.input" not in load(tmp_path / "m.lat")[1]


def test_a_foreign_enc_without_negative_needs_guidance_1(tmp_path, made):
    t = _tensors(made / "p.enc")
    foreign = tmp_path / "prompt-only.enc"
    save_file({"prompt_rows": t["prompt_rows"], "prompt_ids": t["prompt_ids"]}, str(foreign))
    assert "negative" in single_error(run("moss-denoise", foreign, "--seed", "5", *FAST, "--out", tmp_path / "x.lat"))
    r = run("moss-denoise", foreign, "--seed", "5", *FAST, "--guidance", "1", "--out", tmp_path / "x.lat", "--quiet")
    assert r.code == 0 and len(_warnings(r)) == 1


def test_a_foreign_lat_runs_through_decode(tmp_path, made):
    foreign = tmp_path / "foreign.lat"
    save_file(_tensors(made / "p.lat"), str(foreign))
    r = run("moss-decode", foreign, "--out", tmp_path / "f.png")
    assert r.code == 0, r.stderr
    assert len(_warnings(r)) == 1 and "could not be checked" in _warnings(r)[0]
    ours, theirs = Image.open(made / "p.png"), Image.open(tmp_path / "f.png")
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))
    params = json.loads(theirs.text["parameters"])
    assert params["input"] == "foreign" and params["seed"] is None and params["prompt"] == ""
    assert "input" not in json.loads(ours.text["parameters"])


def test_a_lat_made_from_a_foreign_enc_says_so_in_the_png(tmp_path, made):
    foreign = tmp_path / "foreign.enc"
    save_file(_tensors(made / "p.enc"), str(foreign))
    assert run("moss-denoise", foreign, "--seed", "5", *FAST, "--out", tmp_path / "f.lat", "--quiet").code == 0
    r = run("moss-decode", tmp_path / "f.lat", "--out", tmp_path / "f.png", "--quiet")
    assert r.code == 0 and _warnings(r) == []
    params = json.loads(Image.open(tmp_path / "f.png").text["parameters"])
    assert params["input"] == "foreign" and params["seed"] == 5


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_foreign_tensors_are_widened_exactly(tmp_path, made, dtype):
    t = _tensors(made / "p.enc")
    half = {k: (v.astype(dtype) if v.dtype == np.float32 else v) for k, v in t.items()}
    wide = {k: (v.astype(np.float32) if k.endswith("_rows") else v) for k, v in half.items()}
    (tmp_path / "half.enc").write_bytes(dumps(half))
    (tmp_path / "wide.enc").write_bytes(dumps(wide))
    for name in ("half", "wide"):
        assert run("moss-denoise", tmp_path / f"{name}.enc", "--seed", "5", *FAST, "--out", tmp_path / f"{name}.lat",
                   "--quiet").code == 0
    np.testing.assert_array_equal(load(tmp_path / "half.lat")[0]["latents"], load(tmp_path / "wide.lat")[0]["latents"])
    lat = _tensors(made / "p.lat")
    (tmp_path / "half.lat").write_bytes(dumps({"latents": lat["latents"].astype(dtype)}))
    assert run("moss-decode", tmp_path / "half.lat", "--out", tmp_path / "half.png", "--quiet").code == 0


def _enc_case(t, case):
    t = dict(t)
    if case == "rows-float64":
        t["prompt_rows"] = t["prompt_rows"].astype(np.float64)
    elif case == "rows-1d":
        t["prompt_rows"] = t["prompt_rows"][0]
    elif case == "rows-text-dim":
        t["prompt_rows"] = t["prompt_rows"][:, :-1]
    elif case == "ids-int64":
        t["prompt_ids"] = t["prompt_ids"].astype(np.int64)
    elif case == "ids-length":
        t["prompt_ids"] = t["prompt_ids"][:-1]
    elif case == "negative-without-ids":
        del t["negative_ids"]
    elif case == "no-rows":
        del t["prompt_rows"]
    return t


@pytest.mark.parametrize("case,needle", [
    ("rows-float64", "prompt_rows is float64"),
    ("rows-1d", "expected float32[L, text_dim]"),
    ("rows-text-dim", "expected float32[L, 32]"),   # the tiny text_dim
    ("ids-int64", "prompt_ids is int64"),
    ("ids-length", "expected int32["),
    ("negative-without-ids", "no negative_ids"),
    ("no-rows", "no prompt_rows tensor"),
])
def test_a_foreign_enc_with_bad_tensors_is_one_line(tmp_path, made, case, needle):
    bad = tmp_path / "bad.enc"
    save_file(_enc_case(_tensors(made / "p.enc"), case), str(bad))
    out = tmp_path / "x.lat"
    line = single_error(run("moss-denoise", bad, "--seed", "5", *FAST, "--out", out))
    assert needle in line and not out.exists()


@pytest.mark.parametrize("case,needle", [
    ("3d", "expected float32[1, channels, h, w]"),
    ("int32", "latents is int32"),
    ("channels", "expected float32[1, 128"),
    ("name", "no latents tensor"),
])
def test_a_foreign_lat_with_bad_tensors_is_one_line(tmp_path, made, case, needle):
    x = _tensors(made / "p.lat")["latents"]
    tensors = {"3d": {"latents": x[0]}, "int32": {"latents": x.astype(np.int32)},
               "channels": {"latents": x[:, :64]}, "name": {"x": x}}[case]
    save_file(tensors, str(tmp_path / "bad.lat"))
    out = tmp_path / "x.png"
    line = single_error(run("moss-decode", tmp_path / "bad.lat", "--out", out))
    assert needle in line.replace("latents are", "latents is") and not out.exists()
