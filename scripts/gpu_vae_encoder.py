"""The FLUX.2 VAE encoder on the GPU: our CudaImageEncoder against diffusers' AutoencoderKLFlux2 encoder.

    python scripts/gpu_vae_encoder.py --out DIR        # writes DIR/vae_encoder.json (needs diffusers)

Random weights of the real VAE's config (scripts/make_real_checkpoint.py's vae/: encoder widths 128/256/512/512,
GroupNorm 32, values drawn as it draws them) and a smooth image in [-1, 1]. For each size, in one run: our encode
(the median of CUDA-event-timed graph replays after warm-up, the first call's seconds and the pool's bytes beside
it) and diffusers' (encode's posterior mode, the FLUX.2 pipelines' _patchify_latents and BN normalisation) in
float32 with TF32 off and with TF32 on (torch.backends.cuda.matmul.allow_tf32 and cudnn.allow_tf32); the latents
of each against diffusers' float64 on the GPU: relative L2 error and max |error| / max |reference|.
"""

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import make_real_checkpoint as real  # noqa: E402
from graph_timing import replay_ms  # noqa: E402
import make_tiny_checkpoint as tiny  # noqa: E402

REAL = real.vae_config(1)


def random_tensors(config, seed=0):
    """Every tensor of the VAE folder (encoder, decoder, quant convs, bn), each drawn as make_real_checkpoint.py
    draws it (convolutions and projections N(0, 1 / fan_in), norms, biases and BN statistics as the tiny
    checkpoint's), from a generator of its own name."""
    out = {}
    for name, shape in tiny.vae_shapes(config).items():
        if name == "bn.num_batches_tracked":
            out[name] = np.array(1000, np.int64)
            continue
        r = np.random.default_rng([seed, zlib.crc32(name.encode())])
        out[name] = np.asarray(real._vae_value(r, name, shape), np.float32)
    return out


def picture(size):
    yy, xx = np.mgrid[0:size, 0:size]
    return np.stack([np.sin(xx / (9 + size / 64) + c) * np.cos(yy / (7 + size / 64) - c)
                     for c in range(3)]).astype(np.float32)


def ours_ms(enc, image, calls):
    enc(image)
    return replay_ms(enc._captured[image.shape], calls)


def official(model, image):
    """Flux2Pipeline._encode_vae_image on a device image [1, 3, H, W] of the model's dtype."""
    import torch
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
    with torch.no_grad():
        z = Flux2Pipeline._patchify_latents(model.encode(image).latent_dist.mode())
        std = torch.sqrt(model.bn.running_var.view(1, -1, 1, 1) + model.config.batch_norm_eps)
        return (z - model.bn.running_mean.view(1, -1, 1, 1)) / std


def errors(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return {"rel_l2": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
            "max_abs_over_max": float(np.abs(got - ref).max() / np.abs(ref).max())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_out"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024])
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-modes", nargs="*", default=None,
                        help="torch.compile modes of diffusers' TF32 encode timed beside eager (default: default and "
                             "reduce-overhead; none: eager only)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    import diffusers
    import torch
    from diffusers import AutoencoderKLFlux2
    from torch_timing import COMPILE_MODES, compile_description, compile_into, median_ms
    modes = list(COMPILE_MODES) if args.compile_modes is None else args.compile_modes
    from moss_cli.gpu.image_encoder import CudaImageEncoder

    tensors = random_tensors(REAL, args.seed)
    model = AutoencoderKLFlux2.from_config(REAL)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
    model = model.cuda().eval()
    record = {"config": REAL, "device": torch.cuda.get_device_name(),
              "baseline": f"diffusers {diffusers.__version__} AutoencoderKLFlux2 encode (torch {torch.__version__}), "
                          "posterior mode, patchify, BN normalisation; fp32 and TF32", "sizes": {}}
    if modes:
        record["torch_compile"] = compile_description(modes)
    start = time.perf_counter()
    enc = CudaImageEncoder(tensors, REAL)
    for size in args.sizes:
        image = picture(size)
        row = {}
        began = time.perf_counter()
        ours = enc(image)
        row["ours_first_call_s"] = time.perf_counter() - began
        row["ours_ms"] = ours_ms(enc, image, args.replays)
        row["ours_pool_bytes"] = int(enc.ops.pool_bytes)
        x = torch.from_numpy(image).cuda()[None]
        model.double()
        ref = official(model, x.double()).cpu().numpy()
        model.float()
        torch.cuda.empty_cache()
        row["ours_vs_float64"] = errors(ours, ref)
        for name, tf32 in (("fp32", False), ("tf32", True)):
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
            row[f"diffusers_{name}_ms"] = median_ms(lambda: official(model, x), 10)
            got = official(model, x).cpu().numpy()
            row[f"diffusers_{name}_vs_float64"] = errors(got, ref)
            if not tf32:
                row["ours_vs_diffusers_fp32"] = errors(ours, got)
        if modes:          # torch.compile of the TF32 encode, the fastest eager one (weights static for graphs)
            with torch.no_grad():
                compile_into(row, lambda: official(model, x), 10, modes, static=list(model.parameters()))
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        record["sizes"][f"{size}x{size}"] = row
        print(f"{size}x{size}: {json.dumps(row)}", flush=True)
        record["seconds"] = time.perf_counter() - start     # written after each size, as far as the run got
        (args.out / "vae_encoder.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
