"""moss-server's adapters (the tiny checkpoint on the CPU, uvicorn in a thread): named at start, picked per request
with scales. Requests that switch sets back and forth each get moss-image's PNG with the same --lora options, byte
for byte (the set recorded in the PNG as moss-image records it); scale 0 is the base model's picture; a request
naming an adapter the server does not have is 400 in OpenAI's error shape and never queued."""

import base64
import hashlib
import json
from pathlib import Path

import httpx
import ml_dtypes
import numpy as np
import pytest

from cli_util import run
from moss_cli import lora, safetensors_io
from moss_cli.checkpoint import open_checkpoint
from moss_cli.errors import UsageError
from moss_cli.png import decode_png
from moss_cli.server.app import create_app
from moss_cli.server.engine import Engine
from moss_cli.server.main import _adapters
from server_util import WAIT_S, serving, until

BF16 = ml_dtypes.bfloat16
SIZE = {"size": "64x48", "seed": 7, "num_inference_steps": 2}
IMAGE = ["--prompt", "a red fox", "--seed", 7, "--width", 64, "--height", 48, "--steps", 2, "--quiet"]


def kohya(path, shapes, stems, seed):
    """A kohya adapter of rank 4 on these weights (bf16 factors, alpha 4)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for root, name in stems:
        out, inn = shapes[name]
        stem = root + name[:-len(".weight")].replace(".", "_")
        tensors.update({stem + ".lora_up.weight": (rng.standard_normal((out, 4)) * 0.5).astype(BF16),
                        stem + ".lora_down.weight": rng.standard_normal((4, inn)).astype(BF16),
                        stem + ".alpha": np.array(4.0, np.float32)})
    safetensors_io.save(path, tensors)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """style: the DiT's block 0 q, block 5 up/gate and the text refiner's qkv; te: the text encoder's block 3 q."""
    folder = tmp_path_factory.mktemp("adapters")
    shapes = open_checkpoint().shapes()
    style = kohya(folder / "style.safetensors", shapes["transformer"], [
        ("lora_unet_", "layers.0.proj.q.weight"), ("lora_unet_", "layers.5.proj.ffn_up_gate.weight"),
        ("lora_unet_", "text_embedder.blocks.0.qkv.weight")], 1)
    te = kohya(folder / "te.safetensors", shapes["text_encoder"], [("lora_te_", "layers.3.self_attn.q_proj.weight")], 2)
    return {"style": style, "te": te}


@pytest.fixture(scope="module")
def made(files, tmp_path_factory):
    """moss-image's PNG for each adapter set, by the --lora options of each."""
    folder = tmp_path_factory.mktemp("made")
    sets = {"base": [], "style 0.5": [f"{files['style']}:0.5"],
            "style 1, te 0.7": [f"{files['style']}:1", f"{files['te']}:0.7"], "te -1": [f"{files['te']}:-1"]}
    out = {}
    for key, specs in sets.items():
        picture = folder / f"{key}.png"
        r = run("moss-image", *IMAGE, *[a for s in specs for a in ("--lora", s)], "--picture", picture)
        assert r.code == 0, r.stderr
        out[key] = picture.read_bytes()
    assert len(set(out.values())) == 4
    return out


@pytest.fixture(scope="module")
def server(files):
    """The engine of `moss-server --lora style=STYLE:0.5 --lora TE:0` (te loaded, not applied) and its URL."""
    checkpoint, adapters = _adapters(None, [f"style={files['style']}:0.5", f"{files['te']}:0"])
    engine = Engine(checkpoint, device="cpu", warm=False, adapters=adapters).start()
    until(lambda: engine.state == "ready", "the engine to load")
    with serving(create_app(engine)) as url:
        yield engine, url
    engine.close()
    engine.join(WAIT_S)


def generate(url, **body):
    r = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a red fox", **SIZE, **body}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return base64.b64decode(r.json()["data"][0]["b64_json"])


def test_requests_switching_adapter_sets_get_moss_images_pngs_with_those_sets(server, made, files):
    engine, url = server
    assert engine.adapters.keys() == {"style", "te"}
    asked = [(None, "style 0.5"),                                 # no lora field: the set given at start
             ([], "base"),
             ([{"name": "style", "scale": 1.0}, {"name": "te", "scale": 0.7}], "style 1, te 0.7"),
             ([{"name": "te", "scale": -1.0}], "te -1"),
             ([{"name": "style", "scale": 0.0}], "base"),             # scale 0: the base model
             ([{"name": "style"}], "style 0.5"),                      # the scale given at start
             (None, "style 0.5")]
    switches = []
    for lora_field, key in asked:
        body = {} if lora_field is None else {"lora": lora_field}
        assert generate(url, **body) == made[key], key
        switches.append(engine.switch_s)
    native = httpx.post(f"{url}/v1/moss/image", json={"prompt": "a red fox", "seed": 7, "width": 64, "height": 48,
                                                      "steps": 2, "lora": [{"name": "te", "scale": -1}]},
                        timeout=WAIT_S)
    assert native.status_code == 200 and native.content == made["te -1"]
    params = json.loads(decode_png(native.content)[1]["parameters"])
    assert params["lora"] == [{"scale": -1.0, "sha256": hashlib.sha256(files["te"].read_bytes()).hexdigest()}]
    assert all(s is not None for s in switches[1:])


def test_an_unknown_adapter_or_a_bad_scale_is_400_and_never_queued(server):
    engine, url = server
    made = engine.made
    for choice, says in (([{"name": "nope"}], "lora: no adapter named 'nope' (this server has style, te)"),
                         ([{"name": "style", "scale": "x"}], "lora: "),
                         ([{"name": "style", "weight": 1}], "lora: ")):
        r = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a fox", "lora": choice, **SIZE},
                       timeout=WAIT_S)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"]) == ("invalid_request_error", "lora")
        assert error["message"].startswith(says), error["message"]
    r = httpx.post(f"{url}/v1/moss/image", json={"prompt": "a fox", "lora": [{"name": "nope"}]}, timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora"
    assert engine.made == made and engine.depth == 0
    assert httpx.get(f"{url}/health", timeout=WAIT_S).json()["lora"] == {"style": 0.5, "te": 0.0}


def test_adapter_names_from_the_command_line(tmp_path):
    assert lora.parse_named("style=a/b.safetensors:0.5") == ("style", Path("a/b.safetensors"), 0.5)
    assert lora.parse_named("a/my-style.safetensors") == ("my-style", Path("a/my-style.safetensors"), 1.0)
    odd = tmp_path / "x=y.safetensors"
    odd.write_bytes(b"")
    assert lora.parse_named(str(odd)) == ("x=y", odd, 1.0)
    folder = tmp_path / "peft-out"
    folder.mkdir()
    assert lora.parse_named(f"{folder}:2")[0] == "peft-out"


def test_a_name_given_twice_is_one_line(files):
    with pytest.raises(UsageError, match="the name 'style' is given twice"):
        _adapters(None, [f"{files['style']}", f"style={files['te']}"])
