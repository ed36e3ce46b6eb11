"""What bounds the delta rule's token recurrence: its timed kernel (gdn, %clock64 stamps of each block's
thread 0) on the full 9B shapes and on 4 value heads, with 8, 2 and 1 warps a block. With 4 heads and
one-warp blocks each SM holds about one warp, so nothing else competes for its shared-memory pipe and
schedulers: if the token loop's cycles per token fall far below the full run's, the full run waits on a
resource the SM's warps share; if they stay, it waits on its own dependent chain.

    python scripts/gpu_probe_recurrence.py --out recurrence.json
"""

import argparse
import json

import numpy as np
from numba import cuda

from cuda_kernels import gdn

from gpu_bench_delta import HV, cycle_stamps, inputs

# (label, value heads, geometry (parts, threads, tile, group, cols))
CONFIGS = [
    ("32 heads, default", HV, gdn.GEOMETRY),
    ("32 heads, tile 4", HV, (8, 256, 4, 1, 1)),
    ("32 heads, 1 warp a block, tile 4", HV, (8, 32, 4, 1, 1)),
    ("4 heads, 8 warps a block", 4, gdn.GEOMETRY),
    ("4 heads, 8 warps a block, tile 4", 4, (8, 256, 4, 1, 1)),
    ("4 heads, 2 warps a block, tile 4", 4, (8, 64, 4, 1, 1)),
    ("4 heads, 1 warp a block, tile 4", 4, (8, 32, 4, 1, 1)),
    # less k/q traffic per column (2 columns a thread) with 4 parts: 168 registers at 128 threads, 240 at 64
    ("32 heads, 4 parts, 2 columns a thread", HV, (4, 128, 8, 1, 2)),
    ("32 heads, 4 parts, 2 columns a thread, 2 warps a block", HV, (4, 64, 8, 1, 2)),
    ("32 heads, 4 parts", HV, (4, 256, 16, 1, 1)),
]


def heads(inp, hv):
    """The first hv value heads (and their key heads) of the inputs, contiguous on the device."""
    hk = hv * inp["q"].shape[1] // inp["v"].shape[1]
    cut = {"q": hk, "k": hk, "v": hv, "g": hv, "beta": hv}
    return [cuda.to_device(np.ascontiguousarray(inp[x][:, :cut[x]])) for x in ("q", "k", "v", "g", "beta")]


def cycles(args, geometry, n):
    blocks, threads, stamps = cycle_stamps(args, geometry, launches=5)
    return {"blocks": blocks, "warps_a_block": threads // 32,
            **{f"{name}_per_token": v / n for name, v in stamps.items()}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="recurrence.json")
    args = parser.parse_args()
    result = {}
    for n in (112, 1024):
        inp = inputs(n)
        for label, hv, geometry in CONFIGS:
            try:
                row = cycles(heads(inp, hv), geometry, n)
            except Exception as exc:
                row = f"failed: {exc!r}"
            result[f"{n} tokens, {label}"] = row
            print(n, label, json.dumps(row), flush=True)
    result["median_of"] = "5 launches, each the median over blocks"
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
