"""scripts/make_real_checkpoint.py: the real-size random folder's layout, checked at --scale 64 (a few MB),
and its real-size configs and sizes checked without writing."""

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moss_cli import safetensors_io
from moss_cli.checkpoint import expected_tensors, open_checkpoint
from moss_cli.encoder import text_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "make_real_checkpoint.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("make_real_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / "model"
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), "--scale", "64", "--threads", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "written in" in done.stdout
    return out


def files(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_scaled_folder_loads_with_every_expected_tensor(small):
    ckpt = open_checkpoint(small)          # checks presence, shape and dtype of every expected tensor
    for name in ("transformer", "text_encoder", "vae"):
        comp = ckpt.component(name)
        wanted = expected_tensors(name, comp.config)
        assert wanted and set(wanted) <= set(comp.tensors)
        for key, shape in wanted.items():
            assert comp.tensors[key].shape == tuple(shape), (name, key)
    assert ckpt.config("transformer")["text_dim"] == text_config(ckpt.config("text_encoder"))["hidden_size"]


def test_scaled_folder_has_the_official_layout(small):
    names = set(files(small))
    assert {"README.md", "model_index.json", "scheduler/scheduler_config.json", "tokenizer/tokenizer.json",
            "tokenizer/tokenizer_config.json", "transformer/config.json", "text_encoder/config.json",
            "vae/config.json", "vae/diffusion_pytorch_model.safetensors",
            "transformer/diffusion_pytorch_model.safetensors.index.json",
            "text_encoder/model.safetensors.index.json"} <= names
    shards = {"transformer": sorted(n for n in names if n.startswith("transformer/diffusion_pytorch_model-")),
              "text_encoder": sorted(n for n in names if n.startswith("text_encoder/model-"))}
    assert shards["transformer"] == [f"transformer/diffusion_pytorch_model-{i:05d}-of-00003.safetensors"
                                     for i in (1, 2, 3)]
    assert shards["text_encoder"] == [f"text_encoder/model-{i:05d}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    for component, index in (("transformer", "diffusion_pytorch_model.safetensors.index.json"),
                             ("text_encoder", "model.safetensors.index.json")):
        doc = json.loads((small / component / index).read_text())
        stored = {}
        for file in {f.split("/")[1] for f in shards[component]}:
            header = safetensors_io.header(small / component / file)[1]
            stored.update({k: file for k in header if k != "__metadata__"})
        assert doc["weight_map"] == stored
        assert doc["metadata"]["total_size"] == sum((small / f).stat().st_size for f in shards[component]) - sum(
            8 + len(safetensors_io.header(small / f)[0]) for f in shards[component])
    index = json.loads((small / "model_index.json").read_text())
    assert "tokenizer" in index["_moss_cli_note"] and "_moss_cli_defaults" not in index
    assert "tiny" in (small / "README.md").read_text()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        assert (small / "tokenizer" / file).read_bytes() == (ROOT / "moss_cli/tiny/tokenizer" / file).read_bytes()


def test_scaled_folder_dtypes_and_value_scales(small):
    ckpt = open_checkpoint(small)
    dit = ckpt.component("transformer").tensors
    text = ckpt.component("text_encoder").tensors
    vae = ckpt.component("vae").tensors
    assert all(a.dtype.name == "bfloat16" for a in dit.values())
    for key, a in text.items():
        f32 = key.endswith(("linear_attn.A_log", "linear_attn.norm.weight"))
        assert a.dtype == (np.float32 if f32 else np.dtype("bfloat16")), key
    assert all(a.dtype == np.float32 for k, a in vae.items() if k != "bn.num_batches_tracked")
    w = np.asarray(dit["layers.3.proj.ffn_up_gate.weight"], dtype=np.float64)
    assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.002
    e = np.asarray(text["embed_tokens.weight"], dtype=np.float64)
    assert abs(e.std() - 0.02) < 0.002
    assert abs(np.asarray(dit["layers.0.norm1.weight"], dtype=np.float64).mean() - 1) < 0.1
    assert abs(np.asarray(text["layers.0.input_layernorm.weight"], dtype=np.float64).mean()) < 0.1
    assert np.all(np.asarray(vae["bn.running_var"]) > 0)
    # different tensors are not the same bytes
    assert not np.array_equal(np.asarray(dit["layers.0.proj.q.weight"]).view(np.uint16),
                              np.asarray(dit["layers.0.proj.k.weight"]).view(np.uint16))


def test_rerun_writes_the_same_bytes_and_refuses_to_overwrite(small, tmp_path):
    again = tmp_path / "again"
    run = [sys.executable, str(SCRIPT), str(again), "--scale", "64", "--threads", "2"]
    assert subprocess.run(run, capture_output=True, timeout=300).returncode == 0
    assert files(again) == files(small)
    refused = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "--force" in refused.stderr
    assert subprocess.run(run + ["--force"], capture_output=True, timeout=300).returncode == 0


def test_real_size_configs_and_bytes(script):
    """The scale-1 configs are the published ones, and the weights add up to the real sizes."""
    import make_tiny_checkpoint as tiny
    c = script.configs(1)
    t = c["transformer"]
    assert {k: t[k] for k in ("dim", "ffn_dim", "num_heads", "num_layers", "text_dim", "freq_dim",
                              "latent_channels")} == {"dim": 3072, "ffn_dim": 8192, "num_heads": 24,
                                                      "num_layers": 42, "text_dim": 4096, "freq_dim": 256,
                                                      "latent_channels": 128}
    e = c["text_encoder"]["text_config"]
    assert {k: e[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                              "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                              "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")} == {
        "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128}
    assert e["rope_parameters"]["mrope_section"] == [11, 11, 10]
    v = c["vae"]
    assert v["block_out_channels"] == [128, 256, 512, 512] and v["decoder_block_out_channels"] == [96, 192, 384, 384]
    assert v["norm_num_groups"] == 32 and v["latent_channels"] == 32
    params = {name: sum(int(np.prod(s)) for s in shapes.values()) for name, shapes in (
        ("transformer", tiny.transformer_shapes(t)), ("text", tiny.text_shapes(e)), ("vae", tiny.vae_shapes(v)))}
    assert params["transformer"] == 5_082_308_608 + 16          # denoiser.md 3.7, plus rope.bands
    assert params["text"] == 8_953_803_264 - 248320 * 4096       # encoder.md 1, less lm_head
    total = 2 * params["transformer"] + 2 * params["text"] + 4 * params["vae"]
    assert 26e9 < total < 27.2e9
    for name, shapes in (("transformer", tiny.transformer_shapes(t)), ("text_encoder", tiny.text_shapes(e))):
        wanted = expected_tensors(name, c[name])
        assert all(tuple(shapes[k]) == tuple(s) for k, s in wanted.items())


def test_scaled_widths_stay_consistent(script):
    for n in (2, 3, 5, 6, 7, 16, 64, 1000):
        c = script.configs(n)
        t, e, v = c["transformer"], c["text_encoder"]["text_config"], c["vae"]
        assert t["dim"] % t["num_heads"] == 0 and (t["dim"] // t["num_heads"]) % 8 == 0
        assert t["text_dim"] == e["hidden_size"] and t["latent_channels"] == 4 * v["latent_channels"]
        assert e["num_attention_heads"] % e["num_key_value_heads"] == 0
        assert e["linear_num_value_heads"] % e["linear_num_key_heads"] == 0
        assert sum(e["rope_parameters"]["mrope_section"]) == e["head_dim"] // 8
        assert all(w % v["norm_num_groups"] == 0 for w in v["block_out_channels"] + v["decoder_block_out_channels"])
        expected_tensors("transformer", t)
        expected_tensors("text_encoder", c["text_encoder"])
        expected_tensors("vae", v)


def test_pooled_tensors_span_several_chunks(script, monkeypatch):
    """A tensor bigger than one write comes out as several pool slices of the right total length."""
    monkeypatch.setattr(script, "CHUNK", 1000)
    values = script.Values(0, 1 << 14, threads=2)
    parts = [np.frombuffer(b, np.uint16) for b in values.pooled("layers.0.w", 3500)]
    assert [p.size for p in parts] == [1000, 1000, 1000, 500]
    assert len({p[:8].tobytes() for p in parts}) == 4
    assert [p.tobytes() for p in values.pooled("layers.0.w", 3500)] == [p.tobytes() for p in parts]
    x = (values.pool.astype(np.uint32) << 16).view(np.float32)
    assert abs(x.std() - 0.02) < 0.001
