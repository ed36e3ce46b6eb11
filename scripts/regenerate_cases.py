#!/usr/bin/env python3
"""Regenerate the reference cases in cases/ from sources independent of moss-cli.

Needs torch, transformers and diffusers (pip install -e '.[test]'); never imports moss_cli.

Tiny demo checkpoint (default): for each case in cases/<name>/case.json it writes
  prompt.enc     prompt/negative ids from transformers' AutoTokenizer + apply_chat_template, rows from
                 transformers' Qwen3_5TextModel in float64 (last_hidden_state; `.double()` with its float32
                 casts made float64, scripts/reference/transformers64.py), stored as float32
  trace.trace    noise from torch.randn on a CPU generator, sigmas from a torch.linspace statement of the
                 MOSS schedule, and per step the latents and guided velocity of a float64 torch statement
                 of the DiT (scripts/reference/dit.py) with CFG and the block-22 skip
  latents.lat    the final latents of that run (float32)
  picture.png    diffusers' AutoencoderKLFlux2 decode of latents.lat (float32) through VaeImageProcessor
and cases/SHA256SUMS over all of them. `--check` recomputes into a temporary folder and compares sums.

Real checkpoint (`--real DIR`): runs the official diffusers pipeline (custom_pipeline from the checkpoint
folder, trust_remote_code) on a prompt and seed and dumps each stage in moss-cli's artifact format:
the encoder rows and ids (forward hook on the text encoder), every transformer call's input latents,
the final latents (callback_on_step_end) and the picture. This needs torch, diffusers, transformers, a
GPU with room for the bf16 model and the real checkpoint (~27 GB); it was written from the documented
pipeline interface and has not been run against the real checkpoint in this repository's CI.
"""

import argparse
import hashlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

# torch's CPU kernels are picked by the processor's instruction set, and AVX-512 ones sum float32 in
# another order than AVX2 ones: the committed bytes come from the AVX2 kernels, so use those everywhere; oneDNN
# (torch's CPU convolutions, the VAE decode) picks its own, and on an AVX-512/AMX processor puts one of the
# picture's values one level off unless held to AVX2 as well
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
import torch                                   # noqa: E402
from safetensors.torch import load_file        # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "moss_cli" / "tiny"
CASES = ROOT / "cases"
sys.path.insert(0, str(ROOT / "scripts"))

from reference import dit as ref_dit          # noqa: E402
from reference import transformers64           # noqa: E402
from reference.fingerprint import fingerprint  # noqa: E402
from reference.safetensors_write import dumps  # noqa: E402
from reference.schedule import sigmas as ref_sigmas  # noqa: E402

torch.set_num_threads(1)   # one thread: float32 reductions in a fixed order, the same bytes run after run
torch.use_deterministic_algorithms(True)

FILES = ("prompt.enc", "trace.trace", "latents.lat", "picture.png")


def artifact(stage, tensors, meta, model):
    head = {"moss.stage": stage, "moss.format": "1", "moss.model": model, "moss.version": "reference"}
    head.update({k: str(v) for k, v in meta.items()})
    return dumps(tensors, head)


# --- encoder rows: transformers ------------------------------------------------------------------

def chat_ids(tokenizer, prompt, max_length=4096):
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True)
    return tokenizer(text, truncation=True, max_length=max_length)["input_ids"]


def text_model(model_dir):
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel
    cfg = json.loads((model_dir / "text_encoder" / "config.json").read_text())
    model = Qwen3_5TextModel(Qwen3_5TextConfig(**cfg.get("text_config", cfg))).double().eval()
    stored = load_file(str(model_dir / "text_encoder" / "model.safetensors"))
    prefix = "model.language_model."
    state = {k[len(prefix):]: v.double() for k, v in stored.items() if k.startswith(prefix)}
    model.load_state_dict(state, strict=True)
    return model


def encode(model_dir, prompt, negative):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir / "tokenizer"))
    model = text_model(model_dir)
    tensors = {}
    for role, text in (("prompt", prompt), ("negative", negative)):
        ids = chat_ids(tokenizer, text)
        rows = transformers64.rows(model, ids)
        tensors[f"{role}_rows"] = rows.float().numpy()
        tensors[f"{role}_ids"] = np.asarray(ids, dtype=np.int32)
    return tensors


# --- denoising: torch.randn + float64 DiT statement -------------------------------------------------

def denoise(model_dir, rows, case):
    cfg = json.loads((model_dir / "transformer" / "config.json").read_text())
    sched = json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text())
    weights = ref_dit.load_weights(model_dir / "transformer")
    h, w = case["height"] // 16, case["width"] // 16
    gen = torch.Generator("cpu").manual_seed(case["seed"])
    noise = torch.randn((1, cfg["latent_channels"], h, w), generator=gen, dtype=torch.float32)
    sig = ref_sigmas(case["steps"], float(sched.get("shift", 5.0)))
    n = len(sig) - 1
    trace = {"noise": noise.numpy(), "sigmas": sig.numpy()}
    x = noise.double()
    cond = ref_dit.text_refiner(weights, cfg, torch.from_numpy(rows["prompt_rows"]).double())
    uncond = ref_dit.text_refiner(weights, cfg, torch.from_numpy(rows["negative_rows"]).double())
    g = case["guidance"]
    for i in range(n):
        t = float(sig[i]) * 1000.0
        t = float(np.float32(t))
        c = ref_dit.velocity(weights, cfg, x, t, cond)
        skip = set(case["uncond_skip_layers"]) if case["skip_start"] <= i / n < case["skip_stop"] else set()
        u = ref_dit.velocity(weights, cfg, x, t, uncond, skip)
        v = u + g * (c - u)
        trace[f"latents.{i:03d}"] = x.float().numpy()
        trace[f"velocity.{i:03d}"] = v.float().numpy()
        x = x + (float(sig[i + 1]) - float(sig[i])) * v
    return trace, x.float().numpy()


# --- decoding: diffusers --------------------------------------------------------------------------

def decode(model_dir, latents):
    from diffusers import AutoencoderKLFlux2
    from diffusers.image_processor import VaeImageProcessor
    vae = AutoencoderKLFlux2.from_pretrained(str(model_dir / "vae"), torch_dtype=torch.float32).eval()
    z = torch.from_numpy(latents)
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    z = z * std + mean
    b, c, h, w = z.shape
    z = z.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)
    with torch.no_grad():
        image = vae.decode(z).sample.clamp(-1, 1)
    picture = VaeImageProcessor(do_normalize=True).postprocess(image, output_type="pil")[0]
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def make_case(folder, model_dir, out):
    case = json.loads((folder / "case.json").read_text())
    model = fingerprint(model_dir)
    rows = encode(model_dir, case["prompt"], case["negative"])
    meta = {"moss.prompt": case["prompt"], "moss.negative": case["negative"], "moss.device": "reference"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompt.enc").write_bytes(artifact("encode", rows, meta, model))
    trace, latents = denoise(model_dir, rows, case)
    params = {f"moss.{k}": v for k, v in case.items() if k not in ("prompt", "negative")}
    params["moss.uncond_skip_layers"] = ",".join(map(str, case["uncond_skip_layers"]))
    (out / "trace.trace").write_bytes(artifact("trace", trace, {**meta, **params}, model))
    (out / "latents.lat").write_bytes(artifact("denoise", {"latents": latents}, {**meta, **params}, model))
    (out / "picture.png").write_bytes(decode(model_dir, latents))


def sums(root):
    lines = []
    for folder in sorted(p for p in root.iterdir() if (p / "case.json").is_file()):
        for name in ("case.json",) + FILES:
            data = (folder / name).read_bytes()
            lines.append(f"{hashlib.sha256(data).hexdigest()}  {folder.name}/{name}")
    return "\n".join(lines) + "\n"


def regenerate(out_root, model_dir=TINY):
    for folder in sorted(p for p in CASES.iterdir() if (p / "case.json").is_file()):
        target = out_root / folder.name
        target.mkdir(parents=True, exist_ok=True)
        (target / "case.json").write_bytes((folder / "case.json").read_bytes())
        make_case(folder, model_dir, target)
    return sums(out_root)


def real(args):
    from diffusers import DiffusionPipeline
    model_dir = Path(args.real)
    pipe = DiffusionPipeline.from_pretrained(str(model_dir), custom_pipeline=str(model_dir), trust_remote_code=True,
                                             torch_dtype={"default": torch.bfloat16, "vae": torch.float32})
    pipe = pipe.to("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seen = {"rows": [], "ids": [], "calls": []}

    def on_text(module, inputs, kwargs, output):
        seen["ids"].append(kwargs.get("input_ids", inputs[0] if inputs else None).detach().cpu()[0].numpy())
        seen["rows"].append(output.last_hidden_state.detach().float().cpu()[0].numpy())

    def on_dit(module, inputs, kwargs):
        seen["calls"].append(inputs[0].detach().float().cpu().numpy())

    final = {}

    def on_step(pipeline, i, t, kwargs):
        final["latents"] = kwargs["latents"].detach().float().cpu().numpy()
        return kwargs

    pipe.text_encoder.register_forward_hook(on_text, with_kwargs=True)
    pipe.transformer.register_forward_pre_hook(on_dit, with_kwargs=True)
    image = pipe(prompt=args.prompt, negative_prompt=args.negative, generator=torch.Generator("cpu").manual_seed(args.seed),
                 num_inference_steps=args.steps, guidance_scale=args.guidance, width=args.width, height=args.height,
                 callback_on_step_end=on_step, callback_on_step_end_tensor_inputs=["latents"]).images[0]
    model = fingerprint(model_dir)
    enc = {"prompt_rows": seen["rows"][0], "prompt_ids": seen["ids"][0].astype(np.int32)}
    if len(seen["rows"]) > 1:
        enc.update(negative_rows=seen["rows"][1], negative_ids=seen["ids"][1].astype(np.int32))
    meta = {"moss.prompt": args.prompt, "moss.negative": args.negative, "moss.device": "official-pipeline"}
    (out / "prompt.enc").write_bytes(artifact("encode", enc, meta, model))
    calls = {f"call.{i:03d}": x for i, x in enumerate(seen["calls"])}
    (out / "calls.trace").write_bytes(artifact("trace", calls, meta, model))
    (out / "latents.lat").write_bytes(artifact("denoise", {"latents": final["latents"]},
                                               {**meta, "moss.seed": args.seed, "moss.steps": args.steps}, model))
    image.save(out / "picture.png")
    print(f"wrote {out}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="regenerate into a temp folder and compare with SHA256SUMS")
    p.add_argument("--real", metavar="DIR", help="the real MOSS-Image folder (official pipeline; needs a GPU)")
    p.add_argument("--out", default=str(CASES), help="output folder (the tiny cases, or the real run's)")
    p.add_argument("--prompt", default="a red fox in the snow")
    p.add_argument("--negative", default="")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--guidance", type=float, default=3.0)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--height", type=int, default=1024)
    args = p.parse_args()
    if args.real:
        return real(args)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            got = regenerate(Path(tmp))
        want = (CASES / "SHA256SUMS").read_text()
        if got != want:
            print("cases differ from SHA256SUMS:\n" + got, file=sys.stderr)
            return 1
        print("cases reproduce SHA256SUMS")
        return 0
    out = Path(args.out)
    (out / "SHA256SUMS").write_text(regenerate(out))
    print(f"wrote {out / 'SHA256SUMS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
