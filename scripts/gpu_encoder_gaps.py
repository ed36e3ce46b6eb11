"""Where the 9B encoder's graph leaves the GPU idle: one 1000-token replay (random weights, as
gpu_encoder_9b.py) under CUPTI, its kernels and copies in time order, the span from the first start to
the last end, the time covered by some kernel, and the largest idle gaps with the kernels on either side;
beside the CUDA-event time of the same call. (In run AI the kernels' CUPTI times summed to 26.9 ms where
the events timed the graph at 29.5.)

    python3 scripts/gpu_encoder_gaps.py --out gaps.json [--tokens 1000]
"""

import argparse
import json

import numpy as np
import torch

from gpu_encoder_9b import CONFIG, make_weights
from moss_cli.ops.cuda_table import CudaEncoder


def timeline(enc, ids, held):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        enc(ids, out=held)
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in p.events()
                   if e.device_type.name == "CUDA")
    return spans, dict(enc.timings)


def summary(spans, top=25):
    covered, gaps, reach, last = 0.0, [], spans[0][0], spans[0][2]
    for start, end, name in spans:
        if start > reach:
            gaps.append((start - reach, last, name))
        covered += max(0.0, end - max(start, reach))
        if end > reach:
            reach, last = end, name
    gaps.sort(reverse=True)
    return {"events": len(spans), "span_ms": (reach - spans[0][0]) / 1e3, "covered_ms": covered / 1e3,
            "idle_ms": sum(g[0] for g in gaps) / 1e3, "gaps_over_2us": sum(g[0] > 2 for g in gaps),
            "largest_gaps": [f"{g / 1e3:.4f} ms after {a[:70]} before {b[:70]}" for g, a, b in gaps[:top]]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gaps.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000])
    args = parser.parse_args()
    enc = CudaEncoder(make_weights(CONFIG), CONFIG)
    enc.upload()
    rng = np.random.default_rng(7)
    result = {}
    for n in args.tokens:
        ids = rng.integers(0, 248077, n)
        held = enc.host_rows(n)
        for _ in range(3):
            enc(ids, out=held)
        runs = []
        for _ in range(2):
            spans, timings = timeline(enc, ids, held)
            runs.append(dict(summary(spans), timings=timings))
        result[str(n)] = runs
        print(json.dumps(result[str(n)], indent=1), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
