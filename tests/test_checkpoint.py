"""Checkpoint reading: sharded/single files, bf16/f32, text-encoder prefixes, validation errors, fingerprint."""

import json
import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch

from moss_cli import safetensors_io
from moss_cli.checkpoint import EMBEDDED, ENV, TEXT_PREFIXES, open_checkpoint
from moss_cli.errors import CheckpointError

SHARDS = ["diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors"]
INDEX = "diffusion_pytorch_model.safetensors.index.json"


@pytest.fixture
def model(tmp_path):
    root = tmp_path / "MOSS-Image"
    shutil.copytree(EMBEDDED, root)
    return root


def library(path):
    """A safetensors file read by the safetensors library, as float64 numpy."""
    return {k: v.double().numpy() for k, v in safetensors.torch.load_file(path).items()}


def read(path):
    tensors, metadata = safetensors_io.load(path)
    return {k: np.array(v) for k, v in tensors.items()}, metadata


def rewrite(path, change):
    """Rewrite a safetensors file with `change(tensors)` applied (a dict it may edit in place)."""
    tensors, metadata = read(path)
    change(tensors)
    safetensors_io.save(path, tensors, metadata)


def edit_json(path, change):
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value, indent=2))


def test_open_defaults_to_env_then_embedded(model, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert open_checkpoint().root == EMBEDDED
    monkeypatch.setenv(ENV, str(model))
    assert open_checkpoint().root == model
    assert open_checkpoint(EMBEDDED).root == EMBEDDED


def test_sharded_bf16_transformer_reads_as_the_library_does(model):
    tr = open_checkpoint(model).component("transformer")
    expected = {**library(model / "transformer" / SHARDS[0]), **library(model / "transformer" / SHARDS[1])}
    assert sorted(tr.tensors) == sorted(expected)
    assert tr.config["num_layers"] == 24
    for name, value in expected.items():
        assert tr.tensors[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(tr.tensors[name].astype(np.float64), value)


def test_single_file_f32_transformer(model):
    folder = model / "transformer"
    merged = {}
    for shard in SHARDS:
        merged.update({k: v.astype(np.float32) for k, v in read(folder / shard)[0].items()})
        (folder / shard).unlink()
    (folder / INDEX).unlink()
    safetensors_io.save(folder / "diffusion_pytorch_model.safetensors", merged)
    tr = open_checkpoint(model).component("transformer")
    assert tr.tensors["layers.23.proj.q.weight"].dtype == np.float32
    np.testing.assert_array_equal(tr.tensors["layers.23.proj.q.weight"], merged["layers.23.proj.q.weight"])


def test_text_encoder_as_stored_mixed_bf16_f32(model):
    te = open_checkpoint(model).component("text_encoder")
    stored = library(model / "text_encoder" / "model.safetensors")
    assert sorted(te.tensors) == sorted(k.removeprefix("model.language_model.") for k in stored)
    assert te.tensors["layers.0.linear_attn.A_log"].dtype == np.float32
    assert te.tensors["layers.0.linear_attn.norm.weight"].dtype == np.float32
    assert te.tensors["layers.0.linear_attn.dt_bias"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(te.tensors["layers.3.self_attn.q_proj.weight"].astype(np.float64),
                                  stored["model.language_model.layers.3.self_attn.q_proj.weight"])


@pytest.mark.parametrize("prefix", TEXT_PREFIXES)
def test_every_text_encoder_prefix_gives_the_same_tensors(model, prefix):
    path = model / "text_encoder" / "model.safetensors"
    plain = {k.removeprefix("model.language_model."): v for k, v in read(path)[0].items()}
    renamed = {prefix + k: v for k, v in plain.items()}
    # what the full checkpoints also hold and the encoder ignores
    renamed.update({"lm_head.weight": np.ones((4, 2), np.float32), "mtp.fc.weight": np.ones(3, np.float32),
                    "model.visual.blocks.0.attn.qkv.weight": np.ones(3, np.float32)})
    safetensors_io.save(path, renamed)
    te = open_checkpoint(model).component("text_encoder")
    assert sorted(te.tensors) == sorted(plain)
    np.testing.assert_array_equal(te.tensors["embed_tokens.weight"], plain["embed_tokens.weight"])


def test_vae_tensors_and_scheduler_config(model):
    ckpt = open_checkpoint(model)
    vae = ckpt.component("vae")
    assert vae.tensors["decoder.conv_in.weight"].shape == (24, 32, 3, 3)
    assert vae.tensors["bn.running_var"].dtype == np.float32
    assert ckpt.config("scheduler")["shift"] == 5.0
    assert ckpt.component("tokenizer").path == model / "tokenizer"
    assert ckpt.model_index["_class_name"] == "MOSSImagePipeline"


def test_fingerprint_is_stable_and_path_independent(model):
    a, b = open_checkpoint(model).fingerprint, open_checkpoint(model).fingerprint
    assert a == b == open_checkpoint(EMBEDDED).fingerprint
    assert len(a) == 64 and int(a, 16) >= 0


@pytest.mark.parametrize("change", ["scheduler config", "transformer config", "tokenizer file", "header"])
def test_fingerprint_changes_with_configs_and_headers(model, change):
    before = open_checkpoint(model).fingerprint
    if change == "scheduler config":
        edit_json(model / "scheduler" / "scheduler_config.json", lambda c: c.update(shift=3.0))
    elif change == "transformer config":
        edit_json(model / "transformer" / "config.json", lambda c: c.update(rope_base=20000.0))
    elif change == "tokenizer file":
        with open(model / "tokenizer" / "chat_template.jinja", "a") as f:
            f.write("\n")
    else:
        rewrite(model / "vae" / "diffusion_pytorch_model.safetensors",
                lambda t: t.update({"bn.running_mean": t["bn.running_mean"].astype(ml_dtypes.bfloat16)}))
    assert open_checkpoint(model).fingerprint != before


def test_fingerprint_does_not_hash_weights(model):
    before = open_checkpoint(model).fingerprint
    rewrite(model / "vae" / "diffusion_pytorch_model.safetensors",
            lambda t: t.update({"bn.running_mean": t["bn.running_mean"] + 1}))
    assert open_checkpoint(model).fingerprint == before


def broken(model, case):
    """Damage the copy for `case`; return the words the error must contain."""
    te, tr, vae = model / "text_encoder", model / "transformer", model / "vae"
    vae_file = vae / "diffusion_pytorch_model.safetensors"
    if case == "missing folder":
        shutil.rmtree(model)
        return "model folder does not exist"
    if case == "no model_index.json":
        (model / "model_index.json").unlink()
        return "not a MOSS-Image folder (no model_index.json)"
    if case == "other pipeline":
        edit_json(model / "model_index.json", lambda m: m.update(_class_name="FluxPipeline"))
        return "'FluxPipeline'"
    if case == "wrong vae class":
        edit_json(model / "model_index.json", lambda m: m.update(vae=["diffusers", "AutoencoderKL"]))
        return "vae class 'AutoencoderKL'"
    if case == "missing component":
        shutil.rmtree(vae)
        return "vae/ is missing"
    if case == "missing config":
        (tr / "config.json").unlink()
        return "transformer/config.json is missing"
    if case == "corrupt config":
        (model / "scheduler" / "scheduler_config.json").write_text("{shift: 5")
        return "scheduler/scheduler_config.json is not valid JSON"
    if case == "missing tokenizer file":
        (model / "tokenizer" / "tokenizer.json").unlink()
        return "tokenizer/tokenizer.json is missing"
    if case == "missing tensor":
        rewrite(vae_file, lambda t: t.pop("decoder.conv_in.weight"))
        return "vae tensor decoder.conv_in.weight is missing"
    if case == "wrong shape":
        rewrite(vae_file, lambda t: t.update({"decoder.conv_in.weight": np.zeros((24, 16, 3, 3), np.float32)}))
        return "vae tensor decoder.conv_in.weight has shape [24, 16, 3, 3], expected [24, 32, 3, 3]"
    if case == "wrong dtype":
        rewrite(te / "model.safetensors", lambda t: t.update(
            {"model.language_model.norm.weight": t["model.language_model.norm.weight"].astype(np.float16)}))
        return "text_encoder tensor norm.weight is F16, expected F32 or BF16"
    if case == "truncated file":
        data = vae_file.read_bytes()
        vae_file.write_bytes(data[:-100])
        return "vae/diffusion_pytorch_model.safetensors is a corrupt or truncated"
    if case == "corrupt header":
        data = bytearray(vae_file.read_bytes())
        data[8:12] = b"@@@@"
        vae_file.write_bytes(bytes(data))
        return "vae/diffusion_pytorch_model.safetensors is a corrupt"
    if case == "missing shard":
        (tr / SHARDS[1]).unlink()
        return f"shard transformer/{SHARDS[1]} is missing"
    if case == "index names the wrong shard":
        edit_json(tr / INDEX, lambda i: i["weight_map"].update({"layers.0.norm1.weight": SHARDS[1]}))
        return "tensor layers.0.norm1.weight"
    if case == "no weights":
        (vae_file).unlink()
        return "vae/ has no weights"
    if case == "unknown text prefix":
        rewrite(te / "model.safetensors",
                lambda t: t.update({"encoder." + k: t.pop(k) for k in list(t)}))
        return "no embed_tokens.weight"
    raise AssertionError(case)


CASES = ["missing folder", "no model_index.json", "other pipeline", "wrong vae class", "missing component",
         "missing config", "corrupt config", "missing tokenizer file", "missing tensor", "wrong shape",
         "wrong dtype", "truncated file", "corrupt header", "missing shard", "index names the wrong shard",
         "no weights", "unknown text prefix"]


@pytest.mark.parametrize("case", CASES)
def test_bad_checkpoint_is_refused_with_one_line_naming_the_culprit(model, case):
    words = broken(model, case)
    with pytest.raises(CheckpointError, match=re.escape(words)) as info:
        open_checkpoint(model)
    message = str(info.value)
    assert "\n" not in message
    assert str(model) in message


def test_validation_uses_the_graph_lists(model):
    """A tensor the caller's list names but the file lacks is reported; extra stored tensors are fine."""
    def expected(name, config):
        return {"transformer": {"made.up": (1,)}}.get(name, {})
    with pytest.raises(CheckpointError, match="transformer tensor made.up is missing"):
        open_checkpoint(model, expected=expected)
    assert open_checkpoint(model, expected=lambda name, config: {}).fingerprint


def test_weights_are_memory_mapped(model):
    tensors = open_checkpoint(model).component("vae").tensors
    assert not tensors["decoder.conv_out.weight"].flags.owndata
    assert not tensors["decoder.conv_out.weight"].flags.writeable
    assert torch.equal(torch.from_numpy(np.array(tensors["decoder.conv_out.weight"])),
                       safetensors.torch.load_file(model / "vae" / "diffusion_pytorch_model.safetensors")[
                           "decoder.conv_out.weight"])


def test_file_changed_after_opening_is_reported(model):
    ckpt = open_checkpoint(model)
    rewrite(model / "vae" / "diffusion_pytorch_model.safetensors", lambda t: t.pop("decoder.conv_out.bias"))
    with pytest.raises(CheckpointError, match="changed since"):
        ckpt.component("vae")
