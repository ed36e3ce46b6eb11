"""The 9B encoder's transformers baseline with whichever fast kernels are importable, beside ours, in one process.

    python scripts/gpu_encoder_baseline.py --out DIR/encoder_baseline.json

transformers' Qwen3.5 gated-DeltaNet layer binds each of its kernels at import time: flash-linear-attention's
chunk_gated_delta_rule (package `fla`) and causal-conv1d's causal_conv1d_fn where they import, else its own
torch code. This script records which ones it got, then times transformers' bf16 forward (eager, the median
of 5 after two warm-ups, which also compile fla's Triton kernels) and our encode (CUDA graph replay into a
pinned array) at 100 and 1000 tokens on the same random weights (scripts/gpu_encoder_9b.py's). Run it with
and without the packages on the path (scripts/gpu_run.sh baseline) for the two baselines.
"""

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def bound_kernels():
    """{transformers' kernel name: the module its implementation comes from}."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    out = {}
    names = [n for n in dir(m) if "gated_delta_rule" in n or n.startswith("causal_conv1d")]
    for name in names:
        fn = getattr(m, name)
        while fn is not None:           # through the hub decorators to the bound implementation
            cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
            inner = cells.get("implementation")
            if inner is None or inner is fn:
                break
            fn = inner
        out[name] = getattr(fn, "__module__", None)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compile-modes", nargs="*", default=["default"],
                        help="torch.compile modes of transformers' forward timed beside eager (none: eager only)")
    args = parser.parse_args()
    from gpu_encoder_9b import CONFIG, LENGTHS, hf_model, make_weights, replay_ms
    from torch_timing import compile_description, compile_into
    from moss_cli.gpu.encoder import CudaEncoder

    result = {"packages": {p: importlib.util.find_spec(p) is not None for p in ("fla", "causal_conv1d")},
              "kernels": bound_kernels(), "speed": {}}
    if args.compile_modes:
        result["torch_compile"] = compile_description(args.compile_modes)
    print(json.dumps({k: result[k] for k in ("packages", "kernels")}), flush=True)
    tensors = make_weights(CONFIG)
    prompts = {n: np.random.default_rng(7).integers(0, 248077, n) for n in LENGTHS}
    enc = CudaEncoder(tensors, CONFIG)
    enc.upload()
    for n, ids in prompts.items():
        result["speed"][n] = {"ours_into_pinned_ms": replay_ms(enc, ids)}
    enc = None
    model = hf_model(CONFIG, tensors)
    for n, ids in prompts.items():
        batch = torch.as_tensor(ids[None], device="cuda")
        times = []
        with torch.no_grad():
            for _ in range(7):
                torch.cuda.synchronize()
                t = time.perf_counter()
                model(batch)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
        row = result["speed"][n]
        row["transformers_bf16_ms"] = 1e3 * statistics.median(times[2:])
        row["ratio"] = row["transformers_bf16_ms"] / row["ours_into_pinned_ms"]
        if args.compile_modes:      # the same forward under torch.compile, each mode afresh (weights static)
            with torch.no_grad():
                compile_into(row, lambda: model(batch), 5, args.compile_modes, static=list(model.parameters()))
        print(f"{n} tokens: ours {row['ours_into_pinned_ms']:.2f} ms, transformers bf16 "
              f"{row['transformers_bf16_ms']:.2f} ms ({row['ratio']:.1f}x); torch.compile "
              f"{row.get('torch_compile_ms', row.get('torch_compile'))}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
