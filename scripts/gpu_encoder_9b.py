"""Qwen3.5-9B encoder on the GPU with random weights made on the GPU: accuracy and speed.

Per layer, the relative error (Frobenius, all rows) of our rows and of transformers' bf16 forward against
transformers run in float64 on the same weights; then encode time at 100 and 1000 tokens (CUDA graph
replay) next to transformers bf16 and the bandwidth floor (weight bytes read / measured copy bandwidth).

    python scripts/gpu_encoder_9b.py --out results.json
"""

import argparse
import json
import os
import statistics
import time

import ml_dtypes
import numpy as np
import torch
from numba import cuda

from cuda_kernels.core import from_bf16_bits, to_bf16_bits
from cuda_kernels.layout import random_bf16
from moss_cli.encoder import expected_tensors, text_config
from moss_cli.stages import HOST_TENSORS
from moss_cli.gpu.encoder import CudaEncoder

CONFIG = {"text_config": {
    "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "hidden_act": "silu", "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True}}}
LENGTHS = (100, 1000)
# the same graph with one choice changed (CudaOps attributes; "form" is the encoder's), each timed at both
# lengths with its final rows' error against float64 (so a faster choice shows what it costs)
VARIANTS = {
    "recurrent_delta": {"form": "recurrent"},
    "chunked_delta": {"chunk_from": 0},
    "wide_products": {"narrow_products": False},
    "element_swiglu": {"packed_swiglu": False},
    "unfused_norm_rope": {"fuse_norm_rope": False},
    "unfused_gdn_inputs": {"fuse_gdn_inputs": False},
    "delta_2_columns": {"delta_geometry": (8, 128, 16, 1, 2)},
    "default_again": {},        # the default recaptured after the others: the run's drift and noise
}


def small_param(name, shape, rng):
    """Host float32 values of the 1-D / conv tensors, rounded to bf16 (both models read the same)."""
    if name.endswith("A_log"):
        v = np.log(rng.uniform(1, 16, shape))
    elif name.endswith("dt_bias"):
        v = rng.uniform(0.5, 1.5, shape)
    elif name.endswith("linear_attn.norm.weight"):
        v = 1 + 0.1 * rng.standard_normal(shape)
    elif name.endswith("conv1d.weight"):
        v = 0.3 * rng.standard_normal(shape)
    else:                      # zero-centred norm offsets
        v = 0.1 * rng.standard_normal(shape)
    return from_bf16_bits(to_bf16_bits(v)).astype(np.float32)


def make_weights(config, seed=0):
    rng = np.random.default_rng(seed)
    tensors = {}
    for i, (name, shape) in enumerate(expected_tensors(config).items()):
        if len(shape) == 2:
            arr = cuda.device_array(shape, np.uint16)
            random_bf16(arr.reshape(arr.size), seed * 100003 + i, 0.02)
            tensors[name] = arr
        else:
            tensors[name] = small_param(name, shape, rng)
    cuda.synchronize()
    for name in HOST_TENSORS["text_encoder"]:      # kept on the host, as the product's loader keeps them
        tensors[name] = tensors[name].copy_to_host().view(ml_dtypes.bfloat16)
    return tensors


def copy_bandwidth():
    a = torch.empty(1 << 30, dtype=torch.float32, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    e.synchronize()
    gbps = 2 * a.numel() * 4 * 10 / (s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return gbps


def weight_bytes(config, tokens):
    """Bytes a forward must read: every matrix once, plus the embedding rows it gathers."""
    total = 0
    for name, shape in expected_tensors(config).items():
        if name == "embed_tokens.weight":
            total += tokens * shape[1] * 2
        else:
            total += int(np.prod(shape)) * (2 if len(shape) == 2 else 4)
    return total


def hf_model(config, tensors):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel
    cfg = Qwen3_5TextConfig(**config["text_config"])
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3_5TextModel(cfg).eval()
    torch.set_default_dtype(torch.float32)
    state = {}
    for name, value in tensors.items():
        if hasattr(value, "__cuda_array_interface__"):
            state[name] = torch.as_tensor(value, device="cuda").view(torch.bfloat16)
        elif value.dtype == ml_dtypes.bfloat16:
            state[name] = torch.as_tensor(value.view(np.uint16)).view(torch.bfloat16).to("cuda")
        else:
            state[name] = torch.as_tensor(value).to("cuda", torch.bfloat16)
    model.load_state_dict(state, strict=True, assign=True)
    torch.cuda.empty_cache()
    return model


def hf_hidden(model, ids):
    with torch.no_grad():
        out = model(torch.as_tensor(ids[None], device="cuda"), output_hidden_states=True)
    return [h[0].double().cpu().numpy() for h in out.hidden_states]


GROUPS = ("Memcpy", "gated_delta_rule", "causal_conv1d", "gated_rms_norm", "rms_norm", "l2_norm", "softmax", "rope",
          "strided_copy", "copy_rows", "embedding", "cast_bf16", "unary", "binary", "swiglu", "gdn_gates",
          "sigmoid_gate", "prep", "solve", "walk", "setup", "flash")    # the profile's rows: ours by family


def profile(enc, ids, top=40):
    """GPU time per kernel over 3 graph replays (CUPTI): the top rows, as text."""
    from torch_timing import by_family, cuda_spans, kernel_table, table_lines
    enc(ids)

    def three():
        for _ in range(3):
            enc(ids)
    return table_lines(kernel_table(cuda_spans(three), repeats=3, group=by_family(GROUPS), top=top))


def replay_ms(enc, ids):
    """Median encode time over 10 graph replays into a pinned array, after the capture (its first call)."""
    held = enc.host_rows(len(ids))
    enc(ids, out=held)
    totals = []
    for _ in range(10):
        enc(ids, out=held)
        totals.append(enc.timings["total_s"])
    return 1e3 * statistics.median(totals)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="encoder_9b.json")
    parser.add_argument("--chunk-from", type=int, default=None,
                        help="prompt length from which the delta rule runs chunked (default: ops/cuda/table.py's)")
    parser.add_argument("--attention", choices=("products", "flash"), default=None,
                        help="the attention form (default: ops/cuda/table.py's)")
    parser.add_argument("--quick", action="store_true",
                        help="accuracy and speed only: no variants, tuned products or CUPTI profiles (the benchmark run)")
    args = parser.parse_args()
    result = {}
    config = text_config(CONFIG)
    free0, total_mem = cuda.current_context().get_memory_info()
    result["copy_GBps"] = copy_bandwidth() / 1e9
    t = time.perf_counter()
    tensors = make_weights(CONFIG)
    result["make_weights_s"] = time.perf_counter() - t
    rng = np.random.default_rng(7)
    prompts = {n: rng.integers(0, 248077, n) for n in LENGTHS}

    enc = CudaEncoder(tensors, CONFIG)
    t = time.perf_counter()
    enc.upload()
    result["upload_s"] = time.perf_counter() - t
    ours = {}
    ops = enc.ops
    if args.chunk_from is not None:
        ops.chunk_from = args.chunk_from
    result["chunk_from"] = ops.chunk_from
    if args.attention is not None:
        ops.attention_form = args.attention
    result["attention_form"] = ops.attention_form
    for n, ids in prompts.items():
        layers = []
        eager = enc(ids, on_layer=lambda i, x: layers.append(ops.host(x)))     # eager, one launch per op
        ours[n] = [*layers[:-1], eager]
    speed = {}
    for n, ids in prompts.items():
        t = time.perf_counter()
        rows = enc(ids)
        capture_s = time.perf_counter() - t
        cuda.synchronize()
        t = time.perf_counter()
        enc.model(ids)                  # one launch per op, no graph (ends in a copy to the host)
        eager_ms = 1e3 * (time.perf_counter() - t)
        totals, hosts, gpus, copies = [], [], [], []
        for _ in range(10):
            again = enc(ids)
            totals.append(enc.timings["total_s"])
            hosts.append(enc.timings["host_s"])
            gpus.append(enc.timings["gpu_s"])
            copies.append(enc.timings["copy_s"])
        reused, kept = [], np.empty_like(rows)
        for _ in range(10):             # into one array the caller keeps (a serving loop's case)
            enc(ids, out=kept)
            reused.append(enc.timings["total_s"])
        pinned, pinned_gpu, pinned_copy, held = [], [], [], enc.host_rows(len(ids))
        host_steps = {"rows_s": [], "queue_s": [], "wait_s": []}
        for _ in range(10):             # into a pinned array the caller keeps: the copy is one DMA
            enc(ids, out=held)
            pinned.append(enc.timings["total_s"])
            pinned_gpu.append(enc.timings["gpu_s"])
            pinned_copy.append(enc.timings["copy_s"])
            for key, times in host_steps.items():
                times.append(enc.timings.get(key, float("nan")))
        speed[n] = {"ours_ms": 1e3 * statistics.median(totals), "ours_host_ms": 1e3 * statistics.median(hosts),
                    "ours_into_kept_array_ms": 1e3 * statistics.median(reused),
                    "ours_into_pinned_ms": 1e3 * statistics.median(pinned),
                    "ours_into_pinned_gpu_ms": 1e3 * statistics.median(pinned_gpu),
                    "ours_into_pinned_copy_ms": 1e3 * statistics.median(pinned_copy),
                    "pinned_equals_fresh": held.tobytes() == rows.tobytes(),
                    **{f"ours_into_pinned_{key[:-2]}_ms": 1e3 * statistics.median(times)
                       for key, times in host_steps.items()},
                    "ours_to_synced_ms": 1e3 * statistics.median(gpus), "ours_rows_copy_ms": 1e3 * statistics.median(copies),
                    "ours_eager_ms": eager_ms,
                    "bucket": enc.timings["bucket"], "capture_s": capture_s,
                    "graph_vs_eager_rel": rel(rows, ours[n][-1]), "replays_identical": again.tobytes() == rows.tobytes(),
                    "floor_ms": 1e3 * weight_bytes(config, n) / (result["copy_GBps"] * 1e9)}
    # the same graph with one choice changed at a time (VARIANTS)
    finals = {}

    def variant(settings, label):
        saved = {key: getattr(enc.model if key == "form" else ops, key) for key in settings}
        for key, value in settings.items():
            setattr(enc.model if key == "form" else ops, key, value)
        enc._captured.clear()
        try:
            for n, ids in prompts.items():
                speed[n][f"ours_{label}_ms"] = replay_ms(enc, ids)
                finals[(label, n)] = enc(ids)
        except Exception as exc:       # a variant the code does not have (yet) is reported, not fatal
            result.setdefault("variant_errors", {})[label] = repr(exc)
        for key, value in saved.items():
            setattr(enc.model if key == "form" else ops, key, value)
        enc._captured.clear()
    for label, settings in ({} if args.quick else VARIANTS).items():
        if all(key == "form" or hasattr(ops, key) for key in settings):
            variant(settings, label)
    # and with the products' algorithms timed per shape (MOSS_GEMM_TUNE=1's Blas) instead of the heuristic's
    from cuda_kernels import gemm
    default = gemm.blas()
    result["gemm_stored_plans"] = sum(bool(p.get("stored")) for p in default._plans.values())
    result["gemm_plans"] = len(default._plans)
    gemm._blas = default if args.quick else gemm.Blas(tune=True)
    for n, ids in ({} if args.quick else prompts).items():
        speed[n]["ours_tuned_gemm_ms"] = replay_ms(enc, ids)
    # the tuner's picks in PICKS' form (committed as cuda_kernels/GEMM_PICKS.json after a run)
    with open(os.path.join(os.path.dirname(os.path.abspath(args.out)), "gemm_picks.json"), "w") as f:
        json.dump({gemm._blas.library_key(): gemm._blas.tuned_picks()}, f, indent=1)
    if result["gemm_stored_plans"] and not args.quick:   # the default ran stored picks: the heuristic's choice too
        gemm._blas = gemm.Blas(picks={})
        enc._captured.clear()
        for n, ids in prompts.items():
            speed[n]["ours_heuristic_gemm_ms"] = replay_ms(enc, ids)
    gemm._blas = default
    enc._captured.clear()
    free1, _ = cuda.current_context().get_memory_info()
    result["ours_peak_GiB"] = (free0 - free1) / 2 ** 30
    print("ours:", json.dumps(speed), flush=True)
    for n, ids in ({} if args.quick else prompts).items():
        try:
            result[f"profile_{n}"] = profile(enc, ids)
        except Exception as exc:     # the profiler is a diagnosis, not a result
            result[f"profile_{n}"] = [f"profiler failed: {exc}"]
        print(f"GPU time per kernel, {n} tokens:\n" + "\n".join(result[f"profile_{n}"]), flush=True)
    # the CUPTI profile of the other GDN inputs form too: which kernels a whole-encode difference comes from
    fused = ops.fuse_gdn_inputs
    ops.fuse_gdn_inputs = not fused
    enc._captured.clear()
    for n, ids in ({} if args.quick else prompts).items():
        try:
            result[f"profile_other_gdn_inputs_{n}"] = profile(enc, ids)
        except Exception as exc:
            result[f"profile_other_gdn_inputs_{n}"] = [f"profiler failed: {exc}"]
        print(f"GPU time per kernel, {n} tokens, other GDN inputs form:\n"
              + "\n".join(result[f"profile_other_gdn_inputs_{n}"]), flush=True)
    ops.fuse_gdn_inputs = fused
    enc._captured.clear()
    enc = ops = None                  # free our buffers before transformers loads
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("profile")}), flush=True)

    model = hf_model(CONFIG, tensors)
    hf16 = {}
    for n, ids in prompts.items():
        hf16[n] = hf_hidden(model, ids)
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                model(torch.as_tensor(ids[None], device="cuda"))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        speed[n]["transformers_bf16_ms"] = 1e3 * statistics.median(times[1:])
    result["transformers_peak_GiB"] = torch.cuda.max_memory_allocated() / 2 ** 30
    model = model.double()
    torch.cuda.empty_cache()
    table = {}
    for n, ids in prompts.items():
        ref = hf_hidden(model, ids)
        rows = []
        for i in range(len(ours[n])):
            hf_i = i + 1 if i < len(ours[n]) - 1 else len(ref) - 1
            rows.append({"layer": i if i < len(ours[n]) - 1 else "final norm",
                         "ours": rel(ours[n][i], ref[hf_i]), "transformers_bf16": rel(hf16[n][hf_i], ref[hf_i])})
        table[n] = rows
        for (label, m), final in finals.items():
            if m == n:
                speed[n][f"ours_{label}_final_rel"] = rel(final, ref[-1])
    result["speed"] = speed
    result["accuracy"] = table
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for n in LENGTHS:
        worse = [r for r in table[n] if r["ours"] > r["transformers_bf16"]]
        print(f"{n} tokens: layers where ours is worse than transformers bf16: {len(worse)} of {len(table[n])}")
        for r in table[n]:
            print(f"  layer {r['layer']}: ours {r['ours']:.3e}  transformers bf16 {r['transformers_bf16']:.3e}")
    print(json.dumps({"speed": speed, **{k: v for k, v in result.items()
                                        if k not in ("accuracy", "speed") and not k.startswith("profile")}}, indent=1))


if __name__ == "__main__":
    main()
