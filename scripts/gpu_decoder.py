"""The FLUX.2 small VAE decoder on the GPU: our CudaDecoder against a torch statement of the same decoder.

    python scripts/gpu_decoder.py --out DIR        # writes DIR/decoder.json

Random weights of realistic scale (the small config: widths 96/192/384/384, GroupNorm 32) and standard
normal latents. For each image size: our decode (median of CUDA-event-timed graph replays after warm-up),
the torch statement (scripts/reference/vae_decoder.py, checked against diffusers and moss_cli in the CPU
tests) in float32 with and without TF32 convolutions, and the share of uint8 values each puts off the
float64 decode of the same statement on the GPU (plus our raw output's max abs error against it).

    python scripts/gpu_decoder.py --ops 1024     # each op's own error, to find where an excess comes from
    python scripts/gpu_decoder.py --profile      # also where each decode's time goes, kernel by kernel (CUPTI)
    python scripts/gpu_decoder.py --cudnn-convs plain zero  # also the decode with cuDNN's convolutions (experimental:
                                                 # cuda_kernels.cudnn_conv), a sum's first convolution in each FIRST form
    python scripts/gpu_decoder.py --cudnn-ops plain  # which cuDNN convolution differs from the columns, and where

--ops runs our decode eagerly once and holds every op's output against torch float64 of that op on the op's own
inputs (so each error is the op's, not accumulated), and prints the worst per op kind.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

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


def where_off(a, b, top=12):
    """Where the pixels off by more than one lie: the rows holding most of them and the worst pixels (row, column,
    levels), to tell an engine's wrong edge or chunk rows from rounding spread over the image."""
    d = np.abs(a.astype(int) - b.astype(int))
    d = d.max(axis=-1) if d.ndim == 3 else d
    rows = np.count_nonzero(d > 1, axis=1)
    worst = np.argsort(d, axis=None)[::-1][:top]
    return {"rows_most_over_one": [[int(r), int(rows[r])] for r in np.argsort(rows)[::-1][:top] if rows[r]],
            "worst": [[int(i // d.shape[1]), int(i % d.shape[1]), int(d.flat[i])] for i in worst if d.flat[i] > 1]}


def ours_ms(dec, latents, calls):
    from numba import cuda
    dec.decode(latents)
    c = dec._captured[latents.shape[2:]]
    for _ in range(3):
        c.graph.launch(c.stream)
    c.queue.synchronize()
    times = []
    for _ in range(calls):
        start, stop = cuda.event(), cuda.event()
        start.record(c.queue)
        c.graph.launch(c.stream)
        stop.record(c.queue)
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop))
    return statistics.median(times)


def _op_errors(dec, latents):
    """{op kind: [calls, worst relative L2 error, worst max-abs error / max |reference|]} of one eager decode,
    each op against torch float64 on its own inputs."""
    import torch
    import torch.nn.functional as F
    from numba import cuda
    from moss_cli.ops.cuda_conv import Normalized, Upsampled

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


def _conv_name(x, w):
    return f"{w.shape[2]}x{w.shape[3]} {w.shape[1]}->{w.shape[0]} at {x.shape[1]}x{x.shape[2]}"


def _conv_difference(name, got, want, top=4):
    """{"conv": name, "rel": max |got - want| / max |want|, "rows", "cols": where the largest differences lie,
    "rows_over": rows differing by more than 1e-4 of max |want|} of two conv outputs [C, H, W]."""
    full = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    by_row, by_col = full.max(axis=(0, 2)), full.max(axis=(0, 1))
    scale = max(float(np.abs(want).max()), 1e-30)
    return {"conv": name, "rel": float(by_row.max() / scale),
            "rows": [int(r) for r in np.argsort(by_row)[::-1][:top]],
            "cols": [int(c) for c in np.argsort(by_col)[::-1][:top]],
            "rows_over": int(np.count_nonzero(by_row > 1e-4 * scale))}


def _print_differences(size, calls, every=True):
    for call in calls:
        if every or call["rel"] > 1e-5:
            print(f"{size} {call['conv']:32s} rel {call['rel']:.3g} rows {call['rows']} cols {call['cols']} "
                  f"rows over 1e-4: {call['rows_over']}", flush=True)


def _cudnn_record(ops):
    """The cuDNN route's geometries refused (to the columns), each plan's check margin, the plans given a zeroed
    workspace."""
    from cuda_kernels import cudnn_conv
    return {"refused": {str(k): v for k, v in ops.__dict__.get("cudnn_refused", {}).items()},
            "checks": {str(k): v for k, v in cudnn_conv._state.get("checked", {}).items()},
            "zeroed": [str(k) for k in cudnn_conv._state.get("zeroed", [])]}


def _latents(seed, size):
    h = size // 16
    return np.random.default_rng(seed + size).standard_normal((1, 128, h, h)).astype(np.float32)


def route_differences(ops, run, top=4):
    """Run run() with each ops.conv2d call made on ops' route and again on the columns, same inputs: per call,
    {"conv": shape, "rel": max |route - columns| / max |columns|, "rows": the rows of the largest
    differences}, in call order (the route's output goes on, so each difference is that conv's own)."""
    calls = []
    route = ops.convs

    def both(x, w, b=None, padding=0, residual=None):
        out = type(ops).conv2d(ops, x, w, b, padding, residual)
        ops.convs = "columns"
        try:
            ref = type(ops).conv2d(ops, x, w, b, padding, residual)
        finally:
            ops.convs = route
        calls.append(_conv_difference(_conv_name(x, w), ops.host(out), ops.host(ref), top))
        return out

    ops.conv2d = both
    try:
        run()
    finally:
        del ops.conv2d
    return calls


def graph_probe(tensors, config, latents):
    """The cuDNN route's conv outputs in a captured graph against an eager decode's, conv by conv: each conv's
    output copied, inside the graph, into a buffer of its own (outside the pool) and compared after a replay."""
    from numba import cuda
    from moss_cli.ops.cuda_decoder import CudaDecoder
    from moss_cli.ops.cuda_table import numba_stream
    eager = CudaDecoder(tensors, config, graphs=False, convs="cudnn")
    want, shapes = [], []

    def keep(x, w, b=None, padding=0, residual=None, _ops=eager.ops):
        out = type(_ops).conv2d(_ops, x, w, b, padding, residual)
        want.append(_ops.host(out))
        shapes.append(_conv_name(x, w))
        return out

    eager.ops.conv2d = keep
    pixels = eager.decode(latents)
    graphed = CudaDecoder(tensors, config, convs="cudnn")
    ops, probes, count = graphed.ops, [], [0]

    def probe(x, w, b=None, padding=0, residual=None):
        out = type(ops).conv2d(ops, x, w, b, padding, residual)
        i = count[0] % len(want)
        count[0] += 1
        if len(probes) <= i:                 # the eager pass before the capture: a buffer of its own
            probes.append(cuda.device_array(out.shape, np.float32))
        probes[i].copy_to_device(out, stream=numba_stream(ops.stream))
        return out

    ops.conv2d = probe
    graph_pixels = graphed.decode(latents)
    calls = [_conv_difference(name, probe.copy_to_host(), ref) for probe, ref, name in zip(probes, want, shapes)]
    return {"convs": calls, "graph_vs_eager": off(graph_pixels, pixels)}


# --profile's rows: ours by name, the products (cuBLASLt) by theirs
KERNELS = ("Memcpy", "split_image", "gather", "finish", "absmax", "gn_sums", "gn_stats", "gn_apply", "split_rows",
           "softmax", "unpack", "pixels", "zero", "copy")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_out"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ops", type=int, metavar="SIZE", help="each op's own error at this size, then exit")
    parser.add_argument("--profile", action="store_true", help="GPU time per kernel of our decode (CUPTI), per size")
    parser.add_argument("--cudnn-ops", metavar="FIRST", choices=("plain", "scale", "zero"),
                        help="one eager decode at each size with cuDNN's convolutions (FIRST form), each conv against "
                             "the columns on the same input (route_differences), and the graph's pixels against the "
                             "eager ones; then exit")
    parser.add_argument("--cudnn-graph-probe", action="store_true",
                        help="the cuDNN route's graph conv by conv against an eager decode (graph_probe), at each "
                             "size; then exit")
    parser.add_argument("--cudnn-convs", nargs="*", metavar="FIRST", choices=("plain", "scale", "zero"),
                        help="also our decode with cuDNN's convolutions in place of the columns (experimental), "
                             "once per form of a sum's first convolution (cudnn_conv.FIRST; none: plain)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ops:
        from moss_cli.ops.cuda_decoder import CudaDecoder
        latents = _latents(args.seed, args.ops)
        worst = _op_errors(CudaDecoder(random_tensors(SMALL, args.seed), SMALL, graphs=False), latents)
        for kind, (calls, err, peak) in sorted(worst.items(), key=lambda kv: -kv[1][1]):
            print(f"{kind:28s} {calls:3d} calls  rel L2 {err:.3g}  max abs / max |ref| {peak:.3g}")
        (args.out / "decoder_ops.json").write_text(json.dumps({"size": args.ops, "ops": worst}, indent=1))
        return 0

    if args.cudnn_graph_probe:
        tensors, record = random_tensors(SMALL, args.seed), {}
        for size in args.sizes:
            t0 = time.perf_counter()
            row = graph_probe(tensors, SMALL, _latents(args.seed, size))
            row["seconds"] = time.perf_counter() - t0
            record[f"{size}x{size}"] = row
            _print_differences(size, row["convs"], every=False)
            print(f"{size}: graph vs eager pixels {row['graph_vs_eager']} ({row['seconds']:.0f} s)", flush=True)
            (args.out / "decoder_cudnn_graph_probe.json").write_text(json.dumps(record, indent=1))
        return 0

    if args.cudnn_ops:
        from cuda_kernels import cudnn_conv
        from moss_cli.ops.cuda_decoder import CudaDecoder
        cudnn_conv.FIRST = args.cudnn_ops
        tensors, record = random_tensors(SMALL, args.seed), {"first": args.cudnn_ops, "sizes": {}}
        for size in args.sizes:
            latents = _latents(args.seed, size)
            eager, pixels = CudaDecoder(tensors, SMALL, graphs=False, convs="cudnn"), []
            ops = eager.ops
            calls = route_differences(ops, lambda: pixels.append(eager.decode(latents)))   # the route's pixels
            pixels = pixels[0]
            graphed = CudaDecoder(tensors, SMALL, convs="cudnn").decode(latents)
            row = {"convs": calls, "graph_vs_eager": off(graphed, pixels), **_cudnn_record(ops)}
            record["sizes"][f"{size}x{size}"] = row
            _print_differences(size, calls)
            print(f"{size} graph vs eager pixels: {row['graph_vs_eager']}", flush=True)
        (args.out / f"decoder_cudnn_ops_{args.cudnn_ops}.json").write_text(json.dumps(record, indent=1))
        return 0

    import torch
    from reference import vae_decoder
    from torch_timing import by_family, cuda_spans, kernel_table, median_ms, table_lines
    from moss_cli.ops.cuda_decoder import CudaDecoder

    tensors = random_tensors(SMALL, args.seed)
    dec = CudaDecoder(tensors, SMALL)
    baseline = f"torch {torch.__version__} eager statement of the decoder, fp32 / TF32 convolutions"
    record = {"config": SMALL, "baseline": baseline, "convs": dec.ops.convs, "sizes": {}}
    torch.backends.cuda.matmul.allow_tf32 = False
    for size in args.sizes:
        latents = _latents(args.seed, size)
        row = {}
        start = time.perf_counter()
        pixels = dec.decode(latents)
        row["ours_first_call_s"] = time.perf_counter() - start
        row["ours_ms"] = ours_ms(dec, latents, args.replays)
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
        del t32
        torch.cuda.empty_cache()
        for first in ([] if args.cudnn_convs is None else args.cudnn_convs or ["plain"]):
            from cuda_kernels import cudnn_conv
            cudnn_conv.FIRST = first
            name = "ours_cudnn_convs" + ("" if first == "plain" else f"_{first}")
            variant = CudaDecoder(tensors, SMALL, convs="cudnn")
            t0 = time.perf_counter()
            got = variant.decode(latents)
            row[f"{name}_first_call_s"] = time.perf_counter() - t0      # the plans built and checked, the capture
            row[f"{name}_ms"] = ours_ms(variant, latents, args.replays)
            if ref_pixels is not None:
                row[f"{name}_vs_float64"] = off(got, ref_pixels)
                row[f"{name}_where_off"] = where_off(got, ref_pixels)
            cudnn = _cudnn_record(variant.ops)
            row[f"{name}_refused"], row[f"{name}_zeroed"] = cudnn["refused"], cudnn["zeroed"]
            del variant
        record["sizes"][f"{size}x{size}"] = row
        print(f"{size}x{size}: {json.dumps(row)}", flush=True)
    (args.out / "decoder.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
