"""Write a random MOSS-Image folder at the real size (~26 GB) in the official layout, fast.

The same layout as OpenMOSS-Team/MOSS-Image (and as scripts/make_tiny_checkpoint.py writes): model_index.json;
transformer/ (MOSSImageTransformer, 5.08 B params, bf16, sharded with its index); text_encoder/ (the
Qwen3.5-9B text model under `model.language_model.`, bf16 with F32 A_log / linear_attn.norm.weight,
sharded with its index; no vision tower, lm_head or MTP weights); vae/ (AutoencoderKLFlux2 with the FLUX.2
encoder and the small decoder, float32); scheduler/; and the tiny checkpoint's tokenizer files (a small
byte-level BPE, not Qwen's: see the folder's README.md). It exists to measure loading and speed at real
sizes; its pictures are noise.

Values are of realistic scale, not of a trained model: matrices are N(0, 0.02) bf16 bits, cut from one
random pool at offsets that a hash of (tensor, chunk) picks, so the big tensors cost no random draws and
are written straight from the pool; norms near 1 (the encoder's zero-centred norms near 0), A_log, dt_bias,
conv and bias values as scripts/gpu_encoder_9b.py makes them; the VAE's convolutions N(0, 1/fan_in). A
rerun with the same seed writes the same bytes. Shards are written in parallel threads into a temporary
sibling folder that is renamed to DIR at the end.

    python scripts/make_real_checkpoint.py DIR [--scale N] [--force] [--threads T] [--seed S]

--scale N divides every width (hidden sizes, heads, vocabulary, VAE channels; at least 8) by N, keeping
layer counts and names, so tests can check the layout at a few MB.
"""

import argparse
import hashlib
import json
import math
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import make_tiny_checkpoint as tiny  # noqa: E402

TOKENIZER = ROOT / "moss_cli" / "tiny" / "tokenizer"
SHARD_BYTES = 5 * 10 ** 9          # transformers' and diffusers' default max_shard_size ("5GB")
POOL = 1 << 26                     # elements of the random bf16 pool (128 MiB)
CHUNK = 1 << 24                    # elements per write of a pooled tensor (32 MiB)
SCALE = 0.02                       # std of the matrices (gpu_encoder_9b.py's random_bf16 scale)
METADATA = {"format": "pt"}
TEXT_PREFIX = tiny.TEXT_PREFIX
TEXT_F32 = tiny.TEXT_F32

NOTE = ("Random weights at the real MOSS-Image sizes for load and speed measurements; the tokenizer is the "
        "tiny demo checkpoint's byte-level BPE (not Qwen3.5's), its pictures are noise.")

README = """\
# Random MOSS-Image folder at the real size

Written by `python scripts/make_real_checkpoint.py DIR{scale_arg}` (seed {seed}).

The layout, names, shapes and dtypes of OpenMOSS-Team/MOSS-Image: transformer/ (bf16, {t_shards} shards),
text_encoder/ (the Qwen3.5-9B text model under `model.language_model.`, bf16 with F32 `A_log` and
`linear_attn.norm.weight`, {e_shards} shards; no vision tower, lm_head or MTP weights), vae/ (float32, FLUX.2
encoder and small decoder), scheduler/. The weights are random (matrices N(0, 0.02) in bf16, norms near 1),
so pictures are noise: the folder exists to measure loading and speed at real sizes.

The tokenizer/ files are the tiny demo checkpoint's (moss_cli/tiny/tokenizer: a small byte-level BPE with
the Qwen special tokens and chat template), not Qwen3.5's; the text encoder's config names their special
token ids. Prompts therefore tokenize to other ids than with the real tokenizer.
"""


# --- configs ---------------------------------------------------------------------------------------

def width(x, n):
    """A width divided by the scale n, a multiple of 8 and at least 8 (x itself when n is 1)."""
    return x if n == 1 else max(8, x // n // 8 * 8)


def mrope_section(half):
    """Split `half` rotary frequencies over (t, h, w) as Qwen3.5's [11, 11, 10] splits 32."""
    t = -(-half // 3)
    h = -(-(half - t) // 2)
    return [t, h, half - t - h]


def text_config(n, tokenizer_ids, used):
    kv = max(1, 4 // n)
    key_heads = max(1, 16 // n)
    head_dim = width(256, n)
    layers = 32
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": None,
        "dtype": "bfloat16", "eos_token_id": tokenizer_ids["<|endoftext|>"], "full_attention_interval": 4,
        "head_dim": head_dim, "hidden_act": "silu", "hidden_size": width(4096, n), "initializer_range": 0.02,
        "intermediate_size": width(12288, n),
        "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": width(128, n), "linear_num_key_heads": key_heads,
        "linear_num_value_heads": 2 * key_heads, "linear_value_head_dim": width(128, n),
        "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144, "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 4 * kv,
        "num_hidden_layers": layers, "num_key_value_heads": kv, "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": mrope_section(head_dim // 8),
                            "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"},
        "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": max(width(248320, n), -(-used // 64) * 64),
    }
    vision = {   # Qwen3.5-9B's vision tower config (no vision weights are written)
        "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "in_channels": 3,
        "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_5_vision", "num_heads": 16,
        "num_position_embeddings": 2304, "out_hidden_size": text["hidden_size"], "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "image_token_id": tokenizer_ids["<|image_pad|>"], "video_token_id": tokenizer_ids["<|video_pad|>"],
        "vision_start_token_id": tokenizer_ids["<|vision_start|>"],
        "vision_end_token_id": tokenizer_ids["<|vision_end|>"],
        "model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False, "vision_config": vision,
    }


def vae_config(n):
    enc = [width(c, n) for c in (128, 256, 512, 512)]
    dec = [width(c, n) for c in (96, 192, 384, 384)]
    return {**tiny.VAE, "block_out_channels": enc, "decoder_block_out_channels": dec,
            "latent_channels": width(32, n), "norm_num_groups": min(32, math.gcd(*enc, *dec))}


def transformer_config(n, text_dim, latent_channels):
    heads = max(1, 24 // n)
    return {**tiny.TRANSFORMER, "dim": heads * width(128, n), "ffn_dim": width(8192, n), "num_heads": heads,
            "num_layers": 42, "text_dim": text_dim, "freq_dim": width(256, n), "latent_channels": latent_channels}


def configs(n):
    vocab = json.loads((TOKENIZER / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    used = max([*vocab["model"]["vocab"].values(), *ids.values()]) + 1
    text = text_config(n, ids, used)
    vae = vae_config(n)
    transformer = transformer_config(n, text["text_config"]["hidden_size"],
                                     vae["latent_channels"] * math.prod(vae["patch_size"]))
    return {"transformer": transformer, "text_encoder": text, "vae": vae}


# --- values ----------------------------------------------------------------------------------------

def bf16_bits(x):
    """float -> bf16 bits, round to nearest even."""
    return tiny.to_bf16(x).view(np.uint16)


class Values:
    """Every tensor's bytes: matrices from the pool, the rest drawn per tensor from (seed, name)."""

    def __init__(self, seed, pool_elements, threads=8):
        self.seed = seed
        self.pool = np.empty(pool_elements, np.uint16)
        def fill(i):      # one generator per part: numpy draws and converts without the GIL
            lo, hi = pool_elements * i // threads, pool_elements * (i + 1) // threads
            draws = np.random.default_rng([seed, 0, i]).standard_normal(hi - lo, dtype=np.float32)
            self.pool[lo:hi] = bf16_bits(draws * np.float32(SCALE))

        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(fill, range(threads)))

    def rng(self, name):
        return np.random.default_rng([self.seed, int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")])

    def pooled(self, name, count):
        """Buffers holding `count` bf16 elements: pool slices at hashed offsets."""
        span = len(self.pool)
        for k, start in enumerate(range(0, count, CHUNK)):
            n = min(CHUNK, count - start)
            h = int.from_bytes(hashlib.blake2b(f"{name}#{k}".encode(), digest_size=8).digest(), "little")
            offset = h % (span - n + 1)
            yield memoryview(self.pool[offset:offset + n])

    def small(self, component, name, shape):
        """float64 values of a tensor that is not pooled."""
        r = self.rng(f"{component}/{name}")
        if component == "vae":
            return tiny.vae_value(name, shape) if name == "bn.num_batches_tracked" else _vae_value(r, name, shape)
        if name == "rope.bands":
            return 1.0 / 10000.0 ** (np.arange(shape[0]) / shape[0])
        if name.endswith("linear_attn.A_log"):
            return np.log(r.uniform(1.0, 16.0, shape))
        if name.endswith("linear_attn.dt_bias"):
            return r.uniform(0.5, 1.5, shape)
        if name.endswith("linear_attn.norm.weight"):      # gated norm: plain weight
            return 1.0 + 0.1 * r.standard_normal(shape)
        if name.endswith("conv1d.weight"):
            return 0.3 * r.standard_normal(shape)
        if "norm" in name and component == "text_encoder":   # zero-centred norms store offsets from 1
            return 0.1 * r.standard_normal(shape)
        if "norm" in name:                                   # the DiT's plain RMSNorm scales
            return 1.0 + 0.1 * r.standard_normal(shape)
        return SCALE * r.standard_normal(shape)              # biases


def _vae_value(r, name, shape):
    small = tiny.vae_small_value(r, name, shape)
    if small is not None:
        return small
    fan_in = int(np.prod(shape[1:]))
    return r.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(fan_in))


class Tensor:
    """One stored tensor: its stored name, dtype, shape and a producer of its bytes."""

    def __init__(self, name, dtype, shape, produce):
        self.name, self.dtype, self.shape, self.produce = name, dtype, tuple(shape), produce
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * {"BF16": 2, "F32": 4, "I64": 8}[dtype]


def tensors(component, config, values):
    """[Tensor] of one component, in stored names."""
    out = []
    if component == "transformer":
        shapes, prefix = tiny.transformer_shapes(config), ""
    elif component == "text_encoder":
        shapes, prefix = tiny.text_shapes(config["text_config"]), TEXT_PREFIX
    else:
        shapes, prefix = tiny.vae_shapes(config), ""
    for name, shape in shapes.items():
        stored = prefix + name
        if component == "vae":
            dtype = "I64" if name == "bn.num_batches_tracked" else "F32"
            out.append(Tensor(stored, dtype, shape, _small(values, component, name, shape, dtype)))
        elif component == "text_encoder" and name.endswith(TEXT_F32):
            out.append(Tensor(stored, "F32", shape, _small(values, component, name, shape, "F32")))
        elif len(shape) == 2:
            out.append(Tensor(stored, "BF16", shape,
                              lambda stored=stored, shape=shape: values.pooled(stored, int(np.prod(shape)))))
        else:
            out.append(Tensor(stored, "BF16", shape, _small(values, component, name, shape, "BF16")))
    return out


def _small(values, component, name, shape, dtype):
    def produce():
        v = values.small(component, name, shape)
        if dtype == "BF16":
            data = bf16_bits(v)
        elif dtype == "I64":
            data = np.asarray(v, dtype=np.int64)
        else:
            data = np.ascontiguousarray(v, dtype=np.float32)
        yield memoryview(np.ascontiguousarray(data).reshape(-1)).cast("B")
    return produce


# --- writing ---------------------------------------------------------------------------------------

def header(items):
    """The safetensors header bytes for `items` (sorted by name), as safetensors_io.dumps lays them out."""
    entries, offset = {}, 0
    for t in items:
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    entries["__metadata__"] = dict(METADATA)
    raw = json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_file(path, items, progress):
    items = sorted(items, key=lambda t: t.name)
    with open(path, "wb", buffering=0) as f:
        f.write(header(items))
        for t in items:
            written = 0
            for buffer in t.produce():
                written += f.write(buffer)
            if written != t.nbytes:
                raise RuntimeError(f"{path.name}: {t.name} wrote {written} bytes, expected {t.nbytes}")
            progress(t.nbytes)
    return path


def shard_count(shapes, itemsize=2):
    """Shards of at most SHARD_BYTES for these shapes at the real size (kept at every --scale)."""
    return max(1, -(-sum(int(np.prod(s)) * itemsize for s in shapes.values()) // SHARD_BYTES))


def shard(items, base, count):
    """{file name: [Tensor]}: `count` contiguous runs of sorted names, split by size."""
    items = sorted(items, key=lambda t: t.name)
    total = sum(t.nbytes for t in items)
    if count == 1:
        return {f"{base}.safetensors": items}
    files, running = [[] for _ in range(count)], 0
    for t in items:
        files[min(running * count // total, count - 1)].append(t)
        running += t.nbytes
    return {f"{base}-{i + 1:05d}-of-{count:05d}.safetensors": f for i, f in enumerate(files)}


def write_json(path, obj):
    tiny.write_json(path, obj)


class Progress:
    """Bytes written so far, printed every two seconds (called from the writer threads)."""

    def __init__(self, total):
        self.total, self.done, self.start, self.last = total, 0, time.perf_counter(), 0.0
        self.lock = threading.Lock()

    def __call__(self, nbytes):
        with self.lock:
            self.done += nbytes
            now = time.perf_counter() - self.start
            if not (now - self.last >= 2.0 or self.done == self.total):
                return
            self.last = now
            print(f"  {self.done / 1e9:7.2f} / {self.total / 1e9:.2f} GB  {now:6.1f} s  "
                  f"{self.done / 1e9 / max(now, 1e-9):5.2f} GB/s", flush=True)


def write_checkpoint(out, scale=1, seed=0, threads=8):
    """Write the folder into `out` (new or empty); returns {component: bytes of weights}."""
    out = Path(out)
    start = time.perf_counter()
    cfg = configs(scale)
    shapes = [*tiny.transformer_shapes(cfg["transformer"]).values(),
              *tiny.text_shapes(cfg["text_encoder"]["text_config"]).values()]
    largest = max(int(np.prod(s)) for s in shapes if len(s) == 2)
    # the pool: four times the largest write, so chunks of one tensor rarely share their values
    pool_elements = min(POOL, max(1 << 16, 4 * min(largest, CHUNK)))
    values = Values(seed, pool_elements, threads)
    everything = {c: tensors(c, cfg[c], values) for c in cfg}
    print(f"pool: {pool_elements} bf16 values in {time.perf_counter() - start:.1f} s", flush=True)

    real = configs(1)
    transformer_files = shard(everything["transformer"], "diffusion_pytorch_model",
                              shard_count(tiny.transformer_shapes(real["transformer"])))
    text_files = shard(everything["text_encoder"], "model",
                       shard_count(tiny.text_shapes(real["text_encoder"]["text_config"])))
    vae_files = {"diffusion_pytorch_model.safetensors": everything["vae"]}
    jobs = [("transformer", transformer_files), ("text_encoder", text_files), ("vae", vae_files)]

    write_json(out / "model_index.json", {**{k: v for k, v in tiny.MODEL_INDEX.items()
                                              if k != "_moss_cli_defaults"}, "_moss_cli_note": NOTE})
    scale_arg = "" if scale == 1 else f" --scale {scale}"
    (out / "README.md").write_text(README.format(scale_arg=scale_arg, seed=seed, t_shards=len(transformer_files),
                                                 e_shards=len(text_files)), encoding="utf-8")
    shutil.copytree(TOKENIZER, out / "tokenizer")
    write_json(out / "scheduler" / "scheduler_config.json", tiny.SCHEDULER)
    for component, files in jobs:
        folder = out / component
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / "config.json", cfg[component])
        if len(files) > 1:
            base = "diffusion_pytorch_model" if component == "transformer" else "model"
            write_json(folder / f"{base}.safetensors.index.json",
                       {"metadata": {"total_size": sum(t.nbytes for f in files.values() for t in f)},
                        "weight_map": {t.name: file for file, f in files.items() for t in f}})
    totals = {component: sum(t.nbytes for f in files.values() for t in f) for component, files in jobs}
    progress = Progress(sum(totals.values()))
    print(f"writing {progress.total / 1e9:.2f} GB in {sum(len(f) for _, f in jobs)} files, {threads} threads "
          f"(transformer {totals['transformer'] / 1e9:.2f} GB, text encoder {totals['text_encoder'] / 1e9:.2f} GB, "
          f"vae {totals['vae'] / 1e9:.3f} GB)", flush=True)
    work = [(out / component / file, items) for component, files in jobs for file, items in files.items()]
    work.sort(key=lambda w: -sum(t.nbytes for t in w[1]))      # biggest first: the threads end together
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for future in [pool.submit(write_file, path, items, progress) for path, items in work]:
            future.result()
    print(f"written in {time.perf_counter() - start:.1f} s", flush=True)
    return totals


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--scale", type=int, default=1, help="divide every width by N (tests); 1 = the real size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=8, help="files written at once")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    args = p.parse_args(argv)
    if args.scale < 1:
        p.error("--scale must be at least 1")
    out = args.dir
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not args.force:
            sys.exit(f"{out}: exists and is not empty; pass --force to replace it")
        if not (out / "model_index.json").is_file():
            sys.exit(f"{out}: exists and is not a checkpoint folder; refusing to replace it")
    start = time.perf_counter()
    files = tiny.write_in_place(out, lambda staging: write_checkpoint(staging, args.scale, args.seed, args.threads))
    print(f"{out}: {len(files)} files, {sum(p.stat().st_size for p in files) / 1e9:.2f} GB, "
          f"{time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
