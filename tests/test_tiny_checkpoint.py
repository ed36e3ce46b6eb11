"""The embedded tiny checkpoint: regenerates byte for byte, and loads in transformers and diffusers."""

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from moss_cli.checkpoint import EMBEDDED, open_checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_checkpoint.py"
PREFIX = "model.language_model."


def config(component, name="config.json"):
    return json.loads((EMBEDDED / component / name).read_text())


def files(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_script_regenerates_identical_bytes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.write_checkpoint(tmp_path)
    assert files(tmp_path) == files(EMBEDDED)


def test_layout_and_size_of_the_real_folder():
    assert set(files(EMBEDDED)) == {
        "README.md", "model_index.json", "scheduler/scheduler_config.json",
        "text_encoder/config.json", "text_encoder/model.safetensors",
        "tokenizer/chat_template.jinja", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
        "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors.index.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "vae/config.json", "vae/diffusion_pytorch_model.safetensors"}
    assert sum(p.stat().st_size for p in EMBEDDED.rglob("*") if p.is_file()) < 4_000_000
    index = json.loads((EMBEDDED / "model_index.json").read_text())
    assert index == {  # denoiser.md section 1
        "_class_name": "MOSSImagePipeline", "_diffusers_version": "0.38.0",
        "transformer": ["pipeline_moss_image", "MOSSImageTransformer"],
        "scheduler": ["pipeline_moss_image", "MOSSImageScheduler"],
        "text_encoder": ["transformers", "Qwen3_5Model"], "vae": ["diffusers", "AutoencoderKLFlux2"],
        "tokenizer": ["transformers", config("tokenizer", "tokenizer_config.json")["tokenizer_class"]],
        "_moss_cli_defaults": {"width": 256, "height": 256, "steps": 8}}   # the demo's own sampling defaults
    scheduler = config("scheduler", "scheduler_config.json")
    assert (scheduler["_class_name"], scheduler["num_train_timesteps"], scheduler["shift"],
            scheduler["training_shift"]) == ("MOSSImageScheduler", 1000, 5.0, 1.0)


def spec_transformer_keys(c):
    """denoiser.md section 3.7, sized by the config."""
    d, f, hd, lat = c["dim"], c["ffn_dim"], c["dim"] // c["num_heads"], c["latent_channels"]
    keys = {"video_embedder.weight": [d, lat], "video_embedder.bias": [d],
            "text_embedder.proj.weight": [d, c["text_dim"]], "text_embedder.proj.bias": [d],
            "rope.bands": [hd // 8],
            "time_embedding.0.weight": [d, c["freq_dim"]], "time_embedding.0.bias": [d],
            "time_embedding.2.weight": [d, d], "time_embedding.2.bias": [d],
            "shared_block_modulation.weight": [6 * d, d], "shared_block_modulation.bias": [6 * d],
            "final_norm_video.weight": [d], "final_linear_video.weight": [lat, d],
            "video_head_modulation.weight": [2 * d, d], "video_head_modulation.bias": [2 * d]}
    for b in (0, 1):
        for n, s in {"norm1.weight": [d], "norm2.weight": [d], "q_norm.weight": [hd], "k_norm.weight": [hd],
                     "qkv.weight": [3 * d, d], "qkv.bias": [3 * d], "proj.weight": [d, d], "proj.bias": [d],
                     "ffn_gate.weight": [f, d], "ffn_gate.bias": [f], "ffn_up.weight": [f, d], "ffn_up.bias": [f],
                     "ffn_down.weight": [d, f], "ffn_down.bias": [d]}.items():
            keys[f"text_embedder.blocks.{b}.{n}"] = s
    for i in range(c["num_layers"]):
        for n, s in {"norm1.weight": [d], "norm2.weight": [d], "q_norm.weight": [hd], "k_norm.weight": [hd],
                     "proj.q.weight": [d, d], "proj.k.weight": [d, d], "proj.v.weight": [d, d],
                     "proj.o.weight": [d, d], "proj.ffn_up_gate.weight": [2 * f, d],
                     "proj.ffn_down.weight": [d, f]}.items():
            keys[f"layers.{i}.{n}"] = s
    return keys


def test_transformer_matches_the_spec_key_list_in_two_bf16_shards():
    c = config("transformer")
    assert (c["dim"], c["num_heads"], c["ffn_dim"], c["num_layers"], c["text_dim"], c["freq_dim"],
            c["latent_channels"], c["rope_base"]) == (32, 2, 64, 24, 32, 256, 128, 10000.0)
    weight_map = config("transformer", "diffusion_pytorch_model.safetensors.index.json")["weight_map"]
    stored = {}
    for shard in sorted(set(weight_map.values())):
        with safetensors.safe_open(EMBEDDED / "transformer" / shard, "pt") as f:
            for k in f.keys():
                assert weight_map[k] == shard
                t = f.get_tensor(k)
                assert t.dtype == torch.bfloat16, k
                stored[k] = list(t.shape)
    assert len(set(weight_map.values())) == 2
    assert stored == spec_transformer_keys(c)


def test_text_encoder_loads_strictly_into_transformers():
    from transformers import Qwen3_5Config, Qwen3_5TextModel
    cfg = Qwen3_5Config.from_pretrained(EMBEDDED / "text_encoder")
    t = cfg.text_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
            t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim,
            t.linear_conv_kernel_dim, t.intermediate_size) == (32, 8, 4, 2, 16, 2, 4, 8, 8, 4, 64)
    assert [i for i, kind in enumerate(t.layer_types) if kind == "full_attention"] == [3, 7]
    stored = safetensors.torch.load_file(EMBEDDED / "text_encoder" / "model.safetensors")
    assert all(k.startswith(PREFIX) for k in stored)
    f32 = sorted(k for k, v in stored.items() if v.dtype == torch.float32)
    assert f32 == sorted(PREFIX + f"layers.{i}.linear_attn.{n}" for i in (0, 1, 2, 4, 5, 6) for n in ("A_log", "norm.weight"))
    assert all(v.dtype == torch.bfloat16 for k, v in stored.items() if k not in f32)
    model = Qwen3_5TextModel(t)
    model.load_state_dict({k.removeprefix(PREFIX): v for k, v in stored.items()}, strict=True)
    # RoPE as encoder.md section 1: theta 1e7 on the first 16 * 0.25 = 4 dims (2 frequencies)
    np.testing.assert_allclose(model.rotary_emb.inv_freq.numpy(), 1e7 ** -(np.arange(0, 4, 2) / 4), rtol=1e-6)
    tokenizer = json.loads((EMBEDDED / "tokenizer" / "tokenizer.json").read_text())
    ids = [*tokenizer["model"]["vocab"].values(), *(a["id"] for a in tokenizer["added_tokens"])]
    assert max(ids) < t.vocab_size and t.vocab_size % 64 == 0 and t.vocab_size - max(ids) <= 64


def test_text_encoder_loads_through_conditional_generation():
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.utils import logging
    logging.set_verbosity_error()   # the vision tower and lm_head are not shipped and get initialised
    model = Qwen3_5ForConditionalGeneration.from_pretrained(EMBEDDED / "text_encoder", dtype=torch.float32)
    loaded = model.state_dict()
    stored = safetensors.torch.load_file(EMBEDDED / "text_encoder" / "model.safetensors")
    for k, v in stored.items():
        assert torch.equal(loaded[k], v.float()), k


def test_vae_loads_in_diffusers_with_exactly_the_stored_tensors():
    from diffusers import AutoencoderKLFlux2
    stored = safetensors.torch.load_file(EMBEDDED / "vae" / "diffusion_pytorch_model.safetensors")
    fresh = AutoencoderKLFlux2.from_config(AutoencoderKLFlux2.load_config(EMBEDDED / "vae")).state_dict()
    assert {k: list(v.shape) for k, v in fresh.items()} == {k: list(v.shape) for k, v in stored.items()}
    vae = AutoencoderKLFlux2.from_pretrained(EMBEDDED / "vae")
    for k, v in vae.state_dict().items():
        assert torch.equal(v, stored[k]), k
    assert stored["bn.num_batches_tracked"].dtype == torch.int64
    assert all(v.dtype == torch.float32 for k, v in stored.items() if k != "bn.num_batches_tracked")
    assert vae.decoder.conv_in.out_channels == 24 and vae.encoder.conv_in.out_channels == 8
    assert vae.config.batch_norm_eps == 1e-4 and vae.config.norm_num_groups == 4


def test_random_values_are_not_trivial():
    ckpt = open_checkpoint(EMBEDDED)
    te = ckpt.component("text_encoder").tensors
    vae = ckpt.component("vae").tensors
    tr = ckpt.component("transformer").tensors
    a = np.exp(np.asarray(te["layers.0.linear_attn.A_log"], np.float64))
    assert np.all((a > 0.01) & (a < 16)) and a.std() > 0
    for norm in (te["norm.weight"], te["layers.3.self_attn.q_norm.weight"], te["layers.0.linear_attn.norm.weight"],
                 tr["layers.22.norm1.weight"], tr["final_norm_video.weight"], vae["decoder.conv_norm_out.weight"]):
        values = np.asarray(norm, np.float64)
        assert not np.any(np.isin(values, (0.0, 1.0))) and values.std() > 0.1
    assert np.all(np.asarray(vae["bn.running_var"]) > 0)
    for name, value in tr.items():
        assert np.asarray(value, np.float64).std() > 0 or value.size == 1, name


@pytest.mark.parametrize("component", ["transformer", "text_encoder", "vae"])
def test_embedded_checkpoint_passes_the_graph_checks(component):
    assert open_checkpoint(EMBEDDED).component(component).tensors
