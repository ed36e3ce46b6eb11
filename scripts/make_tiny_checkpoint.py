"""Write the tiny MOSS-Image demo checkpoint: the real folder's layout and names, random weights.

All five components (transformer sharded in two bf16 files, Qwen3.5 text encoder under the official
`model.language_model.` prefix with F32 A_log / linear_attn.norm.weight, FLUX.2 VAE in float32 with its
encoder, scheduler, tiny tokenizer). Tensor names and shapes are written out here from the spec's key
lists, not taken from the graph modules. Every tensor draws from its own generator seeded by
(SEED, sha256 of its name), so a rerun gives the same bytes.

    python scripts/make_tiny_checkpoint.py [OUT_DIR]      (default: moss_cli/tiny)
"""

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from moss_cli.safetensors_io import dumps  # noqa: E402
from tiny_tokenizer import write_tiny_tokenizer  # noqa: E402

SEED = 20260501
DIFFUSERS_VERSION = "0.38.0"   # model_index.json as reconstructed in denoiser.md section 1
SAFETENSORS_METADATA = {"format": "pt"}   # what torch-saved files carry
BF16 = np.dtype(ml_dtypes.bfloat16)

MODEL_INDEX = {
    "_class_name": "MOSSImagePipeline",
    "_diffusers_version": DIFFUSERS_VERSION,
    "scheduler": ["pipeline_moss_image", "MOSSImageScheduler"],
    "text_encoder": ["transformers", "Qwen3_5Model"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["pipeline_moss_image", "MOSSImageTransformer"],
    "vae": ["diffusers", "AutoencoderKLFlux2"],
    # not in the real file: moss-cli's sampling defaults for this demo, so it runs in seconds
    "_moss_cli_defaults": {"width": 256, "height": 256, "steps": 8},
}

TRANSFORMER = {
    "_class_name": "MOSSImageTransformer", "_diffusers_version": DIFFUSERS_VERSION,
    "dim": 32, "ffn_dim": 64, "num_heads": 2, "num_layers": 24, "text_dim": 32, "freq_dim": 256,
    "latent_channels": 128, "rope_base": 10000.0,
}
TRANSFORMER_SHARDS = 2

TEXT_LAYERS = 8
TEXT = {
    "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": None,
    "dtype": "bfloat16", "full_attention_interval": 4, "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
    "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(TEXT_LAYERS)],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_value_head_dim": 8, "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144, "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False, "num_attention_heads": 4, "num_hidden_layers": TEXT_LAYERS,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    # rotary dim 16 * 0.25 = 4, i.e. 2 frequencies, split over the (t, h, w) sections
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [1, 1, 0], "partial_rotary_factor": 0.25,
                        "rope_theta": 10000000, "rope_type": "default"},
    "tie_word_embeddings": False, "use_cache": True,
}
# A small vision tower config keeps Qwen3_5ForConditionalGeneration cheap to build; no vision weights ship.
VISION = {
    "depth": 1, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 16, "in_channels": 3,
    "initializer_range": 0.02, "intermediate_size": 32, "model_type": "qwen3_5_vision", "num_heads": 2,
    "num_position_embeddings": 16, "out_hidden_size": 32, "patch_size": 16, "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
TEXT_PREFIX = "model.language_model."
TEXT_F32 = ("linear_attn.A_log", "linear_attn.norm.weight")   # stored F32 in the official Qwen3.5 files

VAE = {
    "_class_name": "AutoencoderKLFlux2", "_diffusers_version": DIFFUSERS_VERSION, "act_fn": "silu",
    "batch_norm_eps": 0.0001, "batch_norm_momentum": 0.1, "block_out_channels": [8, 16, 32, 32],
    "decoder_block_out_channels": [8, 16, 24, 24], "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True, "in_channels": 3, "latent_channels": 32, "layers_per_block": 2,
    "mid_block_add_attention": True, "norm_num_groups": 4, "out_channels": 3, "patch_size": [2, 2],
    "sample_size": 1024, "up_block_types": ["UpDecoderBlock2D"] * 4, "use_post_quant_conv": True,
    "use_quant_conv": True,
}

SCHEDULER = {"_class_name": "MOSSImageScheduler", "_diffusers_version": DIFFUSERS_VERSION,
             "num_train_timesteps": 1000, "shift": 5.0, "training_shift": 1.0}

README = """\
# Tiny MOSS-Image demo checkpoint

Random weights from a fixed seed in the exact layout and names of OpenMOSS-Team/MOSS-Image.
It exists so the commands run with no download; its pictures are noise-like. For real
pictures pass the real model folder with `--model DIR`.

Regenerate (byte-identical): `python scripts/make_tiny_checkpoint.py`
"""


# --- names and shapes, from the spec's key lists -------------------------------------------------

def transformer_shapes(c):
    """denoiser.md section 3.7."""
    d, f, hd = c["dim"], c["ffn_dim"], c["dim"] // c["num_heads"]
    s = {
        "video_embedder.weight": (d, c["latent_channels"]), "video_embedder.bias": (d,),
        "text_embedder.proj.weight": (d, c["text_dim"]), "text_embedder.proj.bias": (d,),
        "rope.bands": (hd // 8,),
        "time_embedding.0.weight": (d, c["freq_dim"]), "time_embedding.0.bias": (d,),
        "time_embedding.2.weight": (d, d), "time_embedding.2.bias": (d,),
        "shared_block_modulation.weight": (6 * d, d), "shared_block_modulation.bias": (6 * d,),
        "final_norm_video.weight": (d,), "final_linear_video.weight": (c["latent_channels"], d),
        "video_head_modulation.weight": (2 * d, d), "video_head_modulation.bias": (2 * d,),
    }
    for b in range(2):
        p = f"text_embedder.blocks.{b}."
        s.update({p + "norm1.weight": (d,), p + "norm2.weight": (d,), p + "q_norm.weight": (hd,),
                  p + "k_norm.weight": (hd,), p + "qkv.weight": (3 * d, d), p + "qkv.bias": (3 * d,),
                  p + "proj.weight": (d, d), p + "proj.bias": (d,), p + "ffn_gate.weight": (f, d),
                  p + "ffn_gate.bias": (f,), p + "ffn_up.weight": (f, d), p + "ffn_up.bias": (f,),
                  p + "ffn_down.weight": (d, f), p + "ffn_down.bias": (d,)})
    for i in range(c["num_layers"]):
        p = f"layers.{i}."
        s.update({p + "norm1.weight": (d,), p + "norm2.weight": (d,), p + "q_norm.weight": (hd,),
                  p + "k_norm.weight": (hd,), p + "proj.q.weight": (d, d), p + "proj.k.weight": (d, d),
                  p + "proj.v.weight": (d, d), p + "proj.o.weight": (d, d),
                  p + "proj.ffn_up_gate.weight": (2 * f, d), p + "proj.ffn_down.weight": (d, f)})
    return s


def text_shapes(t):
    """encoder.md section 4, without the root prefix."""
    h, hd = t["hidden_size"], t["head_dim"]
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    value_heads = t["linear_num_value_heads"]
    value_dim = value_heads * t["linear_value_head_dim"]
    s = {"embed_tokens.weight": (t["vocab_size"], h), "norm.weight": (h,)}
    for i, kind in enumerate(t["layer_types"]):
        p = f"layers.{i}."
        s.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                  p + "mlp.gate_proj.weight": (t["intermediate_size"], h),
                  p + "mlp.up_proj.weight": (t["intermediate_size"], h),
                  p + "mlp.down_proj.weight": (h, t["intermediate_size"])})
        if kind == "full_attention":
            heads, kv = t["num_attention_heads"], t["num_key_value_heads"]
            s.update({p + "self_attn.q_proj.weight": (2 * heads * hd, h),
                      p + "self_attn.k_proj.weight": (kv * hd, h), p + "self_attn.v_proj.weight": (kv * hd, h),
                      p + "self_attn.o_proj.weight": (h, heads * hd),
                      p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        else:
            conv = 2 * key_dim + value_dim
            s.update({p + "linear_attn.in_proj_qkv.weight": (conv, h),
                      p + "linear_attn.in_proj_z.weight": (value_dim, h),
                      p + "linear_attn.in_proj_b.weight": (value_heads, h),
                      p + "linear_attn.in_proj_a.weight": (value_heads, h),
                      p + "linear_attn.conv1d.weight": (conv, 1, t["linear_conv_kernel_dim"]),
                      p + "linear_attn.A_log": (value_heads,), p + "linear_attn.dt_bias": (value_heads,),
                      p + "linear_attn.norm.weight": (t["linear_value_head_dim"],),
                      p + "linear_attn.out_proj.weight": (h, value_dim)})
    return s


def vae_shapes(c):
    """decoder_and_noise.md section 1.7 (decoder, post_quant_conv, bn) plus the FLUX.2 encoder and
    quant_conv that the real file also holds (diffusers' Encoder layout, DownEncoderBlock2D)."""
    s = {}

    def conv(name, cout, cin, k):
        s[name + ".weight"], s[name + ".bias"] = (cout, cin, k, k), (cout,)

    def norm(name, ch):
        s[name + ".weight"], s[name + ".bias"] = (ch,), (ch,)

    def resnet(p, cin, cout):
        norm(p + "norm1", cin)
        conv(p + "conv1", cout, cin, 3)
        norm(p + "norm2", cout)
        conv(p + "conv2", cout, cout, 3)
        if cin != cout:
            conv(p + "conv_shortcut", cout, cin, 1)

    def mid(p, ch):
        resnet(p + "resnets.0.", ch, ch)
        norm(p + "attentions.0.group_norm", ch)
        for proj in ("to_q", "to_k", "to_v", "to_out.0"):
            s[f"{p}attentions.0.{proj}.weight"], s[f"{p}attentions.0.{proj}.bias"] = (ch, ch), (ch,)
        resnet(p + "resnets.1.", ch, ch)

    latent, per_block = c["latent_channels"], c["layers_per_block"]
    down = c["block_out_channels"]
    conv("encoder.conv_in", down[0], c["in_channels"], 3)
    cin = down[0]
    for i, ch in enumerate(down):
        for j in range(per_block):
            resnet(f"encoder.down_blocks.{i}.resnets.{j}.", cin, ch)
            cin = ch
        if i < len(down) - 1:
            conv(f"encoder.down_blocks.{i}.downsamplers.0.conv", ch, ch, 3)
    mid("encoder.mid_block.", down[-1])
    norm("encoder.conv_norm_out", down[-1])
    conv("encoder.conv_out", 2 * latent, down[-1], 3)
    conv("quant_conv", 2 * latent, 2 * latent, 1)
    conv("post_quant_conv", latent, latent, 1)

    up = list(reversed(c["decoder_block_out_channels"]))
    conv("decoder.conv_in", up[0], latent, 3)
    mid("decoder.mid_block.", up[0])
    cin = up[0]
    for i, ch in enumerate(up):
        for j in range(per_block + 1):
            resnet(f"decoder.up_blocks.{i}.resnets.{j}.", cin, ch)
            cin = ch
        if i < len(up) - 1:
            conv(f"decoder.up_blocks.{i}.upsamplers.0.conv", ch, ch, 3)
    norm("decoder.conv_norm_out", up[-1])
    conv("decoder.conv_out", c["out_channels"], up[-1], 3)

    packed = latent * int(np.prod(c["patch_size"]))
    s["bn.running_mean"], s["bn.running_var"], s["bn.num_batches_tracked"] = (packed,), (packed,), ()
    return s


# --- values ----------------------------------------------------------------------------------------

def rng(component, name):
    digest = hashlib.sha256(f"{component}/{name}".encode()).digest()
    return np.random.default_rng([SEED, int.from_bytes(digest[:8], "little")])


def fan_in(shape):
    return int(np.prod(shape[1:]))


def transformer_value(name, shape, c):
    r = rng("transformer", name)
    if name == "rope.bands":
        n = shape[0]
        return 1.0 / c["rope_base"] ** (np.arange(n) / n)
    if "norm" in name:                        # plain RMSNorm scales
        return r.uniform(0.5, 1.5, shape)
    if name.endswith(".bias"):
        return r.normal(0.0, 0.1, shape)
    gain = 0.5 if name.endswith(("proj.o.weight", "proj.ffn_down.weight")) else 1.0   # 24 residual writes
    return r.normal(0.0, gain / np.sqrt(fan_in(shape)), shape)


def text_value(name, shape):
    r = rng("text_encoder", name)
    if name.endswith("linear_attn.A_log"):
        return np.log(r.uniform(0.01, 16.0, shape))
    if name.endswith("linear_attn.dt_bias"):
        return r.uniform(-1.0, 1.0, shape)
    if name.endswith("linear_attn.norm.weight"):   # gated norm: plain weight
        return r.uniform(0.5, 1.5, shape)
    if name.endswith("norm.weight"):              # zero-centred norms store offsets from 1
        return r.uniform(-0.5, 0.5, shape)
    if name == "embed_tokens.weight":
        return r.normal(0.0, 1.0, shape)
    return r.normal(0.0, 1.0 / np.sqrt(fan_in(shape)), shape)


def vae_value(name, shape):
    r = rng("vae", name)
    if name == "bn.num_batches_tracked":
        return np.array(1000, dtype=np.int64)
    small = vae_small_value(r, name, shape)
    return r.normal(0.0, 1.0 / np.sqrt(fan_in(shape)), shape) if small is None else small


def vae_small_value(r, name, shape):
    """A VAE tensor that is not a convolution or linear weight, drawn from r (BN statistics, norm scales and
    offsets, biases); None for the weights, whose draw is the caller's (make_real_checkpoint.py draws them in
    float32)."""
    if name == "bn.running_mean":
        return r.normal(0.0, 0.5, shape)
    if name == "bn.running_var":
        return r.uniform(0.5, 2.0, shape)
    module = name.rsplit(".", 2)[-2]
    if "norm" in module:
        return r.uniform(0.5, 1.5, shape) if name.endswith(".weight") else r.normal(0.0, 0.1, shape)
    if name.endswith(".bias"):
        return r.normal(0.0, 0.1, shape)
    return None


# --- writing ---------------------------------------------------------------------------------------

def to_bf16(x):
    """float64 -> float32 -> bf16 with round-to-nearest-even on the bits (ml_dtypes versions round
    float64 differently, so the cast is spelled out to keep the bytes fixed)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).view(BF16)


def write_json(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_transformer(folder):
    write_json(folder / "config.json", TRANSFORMER)
    tensors = {n: to_bf16(transformer_value(n, s, TRANSFORMER))
               for n, s in transformer_shapes(TRANSFORMER).items()}
    names = sorted(tensors)
    total = sum(tensors[n].nbytes for n in names)
    shards, running = [[] for _ in range(TRANSFORMER_SHARDS)], 0
    for n in names:   # contiguous runs of sorted names, split by size
        shards[min(running * TRANSFORMER_SHARDS // total, TRANSFORMER_SHARDS - 1)].append(n)
        running += tensors[n].nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"diffusion_pytorch_model-{i + 1:05d}-of-{TRANSFORMER_SHARDS:05d}.safetensors"
        (folder / file).write_bytes(dumps({n: tensors[n] for n in shard}, SAFETENSORS_METADATA))
        weight_map.update({n: file for n in shard})
    write_json(folder / "diffusion_pytorch_model.safetensors.index.json",
               {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_text_encoder(folder, tokenizer_folder):
    vocab = json.loads((tokenizer_folder / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    used = max([*vocab["model"]["vocab"].values(), *ids.values()]) + 1
    text = {**TEXT, "vocab_size": -(-used // 64) * 64, "eos_token_id": ids["<|endoftext|>"]}
    write_json(folder / "config.json", {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False, "vision_config": VISION,
    })
    tensors = {}
    for name, shape in text_shapes(text).items():
        value = text_value(name, shape)
        tensors[TEXT_PREFIX + name] = value.astype(np.float32) if name.endswith(TEXT_F32) else to_bf16(value)
    (folder / "model.safetensors").write_bytes(dumps(tensors, SAFETENSORS_METADATA))


def write_vae(folder):
    write_json(folder / "config.json", VAE)
    tensors = {}
    for name, shape in vae_shapes(VAE).items():
        value = vae_value(name, shape)
        tensors[name] = value if value.dtype == np.int64 else value.astype(np.float32)
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(dumps(tensors, SAFETENSORS_METADATA))


def write_checkpoint(out):
    """Write the whole tiny checkpoint into the (new or empty) folder `out`."""
    out = Path(out)
    write_json(out / "model_index.json", MODEL_INDEX)
    (out / "README.md").write_text(README, encoding="utf-8")
    write_tiny_tokenizer(out / "tokenizer")
    write_text_encoder(out / "text_encoder", out / "tokenizer")
    write_transformer(out / "transformer")
    write_vae(out / "vae")
    write_json(out / "scheduler" / "scheduler_config.json", SCHEDULER)


def write_in_place(out, write):
    """write(folder) into a staging folder beside `out`, which then replaces `out`: a killed writer leaves
    `out` as it was. Returns the files written, sorted."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return sorted(p for p in out.rglob("*") if p.is_file())


def main(argv):
    out = Path(argv[0]) if argv else ROOT / "moss_cli" / "tiny"
    if out.exists() and any(out.iterdir()) and not (out / "model_index.json").is_file():
        sys.exit(f"{out}: exists and is not a checkpoint folder; refusing to replace it")
    files = write_in_place(out, write_checkpoint)
    print(f"{out}: {len(files)} files, {sum(p.stat().st_size for p in files)} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
