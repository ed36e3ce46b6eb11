"""The FLUX.2 small VAE decoder on the GPU: our CudaDecoder against a torch statement of the same decoder.

    python scripts/gpu_decoder.py --out DIR        # writes DIR/decoder.json

Random weights of realistic scale (the small config: widths 96/192/384/384, GroupNorm 32) and standard
normal latents. For each image size: our decode (median of CUDA-event-timed graph replays after warm-up),
the torch statement (scripts/reference/vae_decoder.py, checked against diffusers and moss_cli in the CPU
tests) in float32 with and without TF32 convolutions, and the share of uint8 values each puts off the
float64 decode of the same statement on the GPU (plus our raw output's max abs error against it).

    python scripts/gpu_decoder.py --ops 1024     # each op's own error, to find where an excess comes from
    python scripts/gpu_decoder.py --profile      # also where each decode's time goes, kernel by kernel (CUPTI)

--ops runs our decode eagerly once and holds every op's output against torch float64 of that op on the op's own
inputs (so each error is the op's, not accumulated), and prints the worst per op kind.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from graph_timing import replay_ms  # noqa: E402

SMALL = {"block_out_channels": [128, 256, 512, 512], "decoder_block_out_channels": [96, 192, 384, 384],
         "latent_channels": 32, "norm_num_groups": 32, "layers_per_block": 2, "patch_size": [2, 2],
         "batch_norm_eps": 1e-4, "use_post_quant_conv": True, "mid_block_add_attention": True}


def random_tensors(config, seed=0):
    """Every decode tensor: matrices N(0, 1 / fan_in), norm weights 1 + 0.2 N, biases 0.2 N, BN variance in
    [0.25, 1.75] (as tests/test_vae.py randomizes diffusers' model)."""
    from moss_cli import vae
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in vae.expected_tensors(config).items():
        if name == "bn.running_var":
            v = rng.random(shape) * 1.5 + 0.25
        elif len(shape) >= 2:
            v = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        elif "norm" in name and name.endswith("weight"):
            v = 1 + 0.2 * rng.standard_normal(shape)
        else:
            v = 0.2 * rng.standard_normal(shape)
        out[name] = v.astype(np.float32)
    return out


def off(a, b):
    d = np.abs(a.astype(int) - b.astype(int))
    return {"percent_off": float(100 * np.mean(d > 0)), "max_diff": int(d.max())}


def ours_ms(dec, latents, calls):
    dec.decode(latents)
    return replay_ms(dec._captured[latents.shape[2:]], calls)


def variants_ms(tensors, latents, calls):
    """Our decode timed at several tap conv chunk sizes (conv.TAP_BYTES: its split image and product)."""
    import gc
    from cuda_kernels import conv
    from moss_cli.gpu.decoder import CudaDecoder
    out, kept = {}, conv.TAP_BYTES
    for mb in (24, 32, 40, 48):
        conv.TAP_BYTES = mb << 20
        out[f"taps_{mb}MB"] = ours_ms(CudaDecoder(tensors, SMALL), latents, calls)
        gc.collect()
    conv.TAP_BYTES = kept
    print("variants (ms): " + json.dumps(out), flush=True)
    return out


def _op_errors(dec, latents):
    """{op kind: [calls, worst relative L2 error, worst max-abs error / max |reference|]} of one eager decode,
    each op against torch float64 on its own inputs."""
    import torch
    import torch.nn.functional as F
    from numba import cuda
    from moss_cli.ops.cuda.conv import Normalized, Upsampled

    ops, worst = dec.ops, {}

    def t64(a):
        if isinstance(a, Upsampled):
            return F.interpolate(t64(a.x)[None], scale_factor=2.0, mode="nearest")[0]
        if isinstance(a, Normalized):      # never written: the conv that reads it holds its error
            return F.silu(F.group_norm(t64(a.x)[None], a.groups, t64(a.w), t64(a.b), a.eps)[0])
        return torch.as_tensor(a, device="cuda").double()

    def check(kind, out, ref):
        cuda.synchronize()
        got = t64(out)
        err = float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref))
        peak = float((got - ref).abs().max() / ref.abs().max())
        row = worst.setdefault(kind, [0, 0.0, 0.0])
        row[0] += 1
        row[1], row[2] = max(row[1], err), max(row[2], peak)

    references = {
        "conv2d": lambda x, w, b=None, padding=0, residual=None: F.conv2d(
            t64(x)[None], t64(w), None if b is None else t64(b), padding=padding)[0]
        + (0 if residual is None else t64(residual)),
        "group_norm": lambda x, groups, w, b, eps: F.group_norm(t64(x)[None], groups, t64(w), t64(b), eps)[0],
        "silu": lambda x: F.silu(t64(x)),
        "add": lambda a, b: t64(a) + t64(b),
        "split_linear": lambda x, w, b=None: F.linear(t64(x), t64(w), None if b is None else t64(b)),
        "split_attention": lambda q, k, v, scale: torch.softmax(
            scale * t64(q)[:, 0] @ t64(k)[:, 0].T, -1).matmul(t64(v)[:, 0])[:, None],
        "unpack_latents": lambda x, std, mean: (t64(x) * t64(std).reshape(-1, 1, 1) + t64(mean).reshape(-1, 1, 1))
        .reshape(-1, 2, 2, x.shape[1], x.shape[2]).permute(0, 3, 1, 4, 2).reshape(-1, 2 * x.shape[1], 2 * x.shape[2]),
    }
    for kind, reference in references.items():
        def wrapped(*args, _run=getattr(ops, kind), _kind=kind, _ref=reference, **kwargs):
            out = _run(*args, **kwargs)
            if _kind == "conv2d":
                label = f"conv2d {args[1].shape[2]}x{args[1].shape[3]} {args[1].shape[1]}->{args[1].shape[0]}"
            else:
                label = _kind
            check(label, out, _ref(*args, **kwargs))
            return out
        setattr(ops, kind, wrapped)
    try:
        d = dec.decoder
        d.decode_image(ops.unpack_latents(ops.array(latents[0]), d.bn_std, d.bn_mean))
    finally:
        for kind in references:
            delattr(ops, kind)
    return worst


def _latents(seed, size):
    h = size // 16
    return np.random.default_rng(seed + size).standard_normal((1, 128, h, h)).astype(np.float32)


# --profile's rows: ours by name, the products (cuBLASLt) by theirs
KERNELS = ("Memcpy", "split_image", "finish", "absmax", "gn_sums", "gn_stats", "gn_apply", "split_rows",
           "softmax", "unpack", "pixels", "zero", "copy")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_out"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ops", type=int, metavar="SIZE", help="each op's own error at this size, then exit")
    parser.add_argument("--profile", action="store_true", help="GPU time per kernel of our decode (CUPTI), per size")
    parser.add_argument("--variants", action="store_true",
                        help="also time other tap conv chunk sizes, at 1024 (else the first size)")
    parser.add_argument("--compile-modes", nargs="*", default=None,
                        help="torch.compile modes of the TF32 statement timed beside eager (default: default and "
                             "reduce-overhead; none: eager only)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ops:
        from moss_cli.gpu.decoder import CudaDecoder
        latents = _latents(args.seed, args.ops)
        worst = _op_errors(CudaDecoder(random_tensors(SMALL, args.seed), SMALL, graphs=False), latents)
        for kind, (calls, err, peak) in sorted(worst.items(), key=lambda kv: -kv[1][1]):
            print(f"{kind:28s} {calls:3d} calls  rel L2 {err:.3g}  max abs / max |ref| {peak:.3g}")
        (args.out / "decoder_ops.json").write_text(json.dumps({"size": args.ops, "ops": worst}, indent=1))
        return 0

    import torch
    from floors import decode_flops
    from reference import vae_decoder
    from torch_timing import (COMPILE_MODES, by_family, compile_description, compile_into, cuda_spans, kernel_table,
                              matmul_tflops, median_ms, table_lines)
    modes = list(COMPILE_MODES) if args.compile_modes is None else args.compile_modes
    from moss_cli.gpu.decoder import CudaDecoder

    tensors = random_tensors(SMALL, args.seed)
    dec = CudaDecoder(tensors, SMALL)
    baseline = f"torch {torch.__version__} eager statement of the decoder, fp32 / TF32 convolutions"
    record = {"config": SMALL, "baseline": baseline, "sizes": {}}
    if modes:
        record["torch_compile"] = compile_description(modes)
    torch.backends.cuda.matmul.allow_tf32 = False
    rate = record["fp16_product_tflops"] = matmul_tflops(8192, 8192, 8192, torch.float16)   # the split's rate
    for size in args.sizes:
        latents = _latents(args.seed, size)
        # the floor: the decode's FLOPs three times over (the split's three fp16 products) at the fp16 rate
        flops = decode_flops(SMALL, size)
        row = {"tflop": flops / 1e12, "floor_ms": 3 * flops / (rate * 1e12) * 1e3}
        start = time.perf_counter()
        pixels = dec.decode(latents)
        row["ours_first_call_s"] = time.perf_counter() - start
        row["ours_ms"] = ours_ms(dec, latents, args.replays)
        if args.variants and size == (1024 if 1024 in args.sizes else args.sizes[0]):
            row["variants_ms"] = variants_ms(tensors, latents, args.replays)
        if args.profile:
            row["profile"] = kernel_table(cuda_spans(lambda: [dec.decode(latents) for _ in range(3)]), repeats=3,
                                          group=by_family(KERNELS))
            print(f"{size}x{size} per decode: span {row['profile']['span_ms']:.1f} ms, kernels busy "
                  f"{row['profile']['busy_ms']:.1f} ms\n" + "\n".join(table_lines(row["profile"])), flush=True)
        lat = torch.from_numpy(latents).cuda()
        try:
            t64 = vae_decoder.weights(tensors, torch.float64, "cuda")
            with torch.no_grad():
                ref = vae_decoder.decode(t64, SMALL, lat.double())
            ref_pixels = vae_decoder.to_pixels(ref)
            row["ours_vs_float64"] = off(pixels, ref_pixels)
            ops, d = dec.ops, dec.decoder
            raw = ops.host(d.decode_image(ops.unpack_latents(ops.array(latents[0]), d.bn_std, d.bn_mean)))
            row["ours_vs_float64"]["max_abs_error"] = float(np.abs(raw - ref[0].cpu().numpy()).max())
            del t64, ref
        except torch.cuda.OutOfMemoryError:
            ref_pixels = None
            row["float64"] = "out of memory"
        torch.cuda.empty_cache()
        t32 = vae_decoder.weights(tensors, torch.float32, "cuda")
        for name, tf32 in (("fp32", False), ("tf32", True)):
            torch.backends.cudnn.allow_tf32 = tf32
            with torch.no_grad():
                row[f"torch_{name}_ms"] = median_ms(lambda: vae_decoder.decode(t32, SMALL, lat), 10)
                if ref_pixels is not None:
                    row[f"torch_{name}_vs_float64"] = off(vae_decoder.to_pixels(vae_decoder.decode(t32, SMALL, lat)),
                                                          ref_pixels)
        if modes:          # torch.compile of the TF32 statement, the fastest eager one (weights static for graphs)
            with torch.no_grad():
                compile_into(row, lambda: vae_decoder.decode(t32, SMALL, lat), 10, modes, static=list(t32.values()))
        torch.backends.cudnn.allow_tf32 = False
        del t32
        torch.cuda.empty_cache()
        record["sizes"][f"{size}x{size}"] = row
        print(f"{size}x{size}: {json.dumps(row)}", flush=True)
        # after each size: a run its step limit cuts keeps the sizes it finished
        (args.out / "decoder.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
