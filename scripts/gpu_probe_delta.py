"""Where the chunked delta rule's stages spend their time: each stage kernel of gdn_chunk relaunched with
smaller grids (fewer blocks doing the same per-block work), captured as a CUDA graph and replayed. A stage
whose time stays when its grid shrinks waits on latency inside a block; one whose time falls with the grid
is bound by a shared resource (memory or L2 bandwidth). Timings only: shrunken grids compute wrong values.

    python scripts/gpu_probe_delta.py --out probe.json
"""

import argparse
import json

import numpy as np
from numba import cuda

from cuda_kernels import gdn_chunk as gc
from moss_cli.ops.cuda_table import CudaOps, capture

from gpu_bench_delta import HK, HV, DK, DV, graph_ms, inputs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="probe.json")
    parser.add_argument("--n", type=int, default=1024)
    args = parser.parse_args()
    ops = CudaOps()
    inp = inputs(args.n)
    q, k, v, g, beta = (cuda.to_device(inp[x]) for x in ("q", "k", "v", "g", "beta"))
    n = args.n
    shapes = gc.workspace_shapes(n, HK, HV, DK, DV)
    w = {name: cuda.device_array(shape, np.float32) for name, shape in shapes.items()}
    out = cuda.device_array(v.shape, np.float32)
    gc.gated_delta_rule_chunked(q, k, v, g, beta, out, w)
    cuda.synchronize()
    r = HV // HK
    slots = -(-n // gc.CHUNK) + 1
    prep = gc._prep[r]
    solve = gc._solve[(False, r)]
    cols, threads = gc.WALK[:2]
    walk = gc._walk[(False, cols, threads, DK, False)]
    walk1 = gc._make_walk(False, cols, threads, DK, False, 1)
    walk2 = gc._make_walk(False, cols, threads, DK, False, 2)
    flat = [w[name].reshape(w[name].size) for name in ("uw", "qg", "kt", "p")]
    spans = -(-gc.CHUNK // gc.SPAN)
    prep_rows = gc._make_prep_rows(r)
    w2 = {name: cuda.device_array(shape, np.float32) for name, shape in shapes.items()}
    prep_rows[(HV, slots), 256](q, k, v, g, beta, w2["qk"], w2["rhs"], w2["kt"], w2["qg"], w2["gam"])
    cuda.synchronize()
    result = {"n": n}
    for name in ("qk", "rhs", "kt", "qg", "gam"):       # prep_rows against prep, valid chunk slots only
        a, b = w[name].copy_to_host()[:, :slots - 1], w2[name].copy_to_host()[:, :slots - 1]
        result[f"prep_rows_{name}_maxdiff"] = float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))
    print(result, flush=True)

    def timed(launch):
        graph, stream, _ = capture(ops, lambda: launch(ops.stream))
        return graph_ms(graph, stream, 20)

    runs = {
        "prep_full": lambda s: prep[(HV, slots, spans), min(DK, gc.THREADS), s](q, k, v, g, beta, w["qk"], w["rhs"],
                                                                              w["kt"], w["qg"], w["gam"]),
        "prep_1head": lambda s: prep[(1, slots, spans), min(DK, gc.THREADS), s](q, k, v, g, beta, w["qk"], w["rhs"],
                                                                              w["kt"], w["qg"], w["gam"]),
        "prep_1block": lambda s: prep[(1, 1, 1), min(DK, gc.THREADS), s](q, k, v, g, beta, w["qk"], w["rhs"],
                                                                        w["kt"], w["qg"], w["gam"]),
        "prep_rows_full": lambda s: prep_rows[(HV, slots), 256, s](q, k, v, g, beta, w2["qk"], w2["rhs"],
                                                                  w2["kt"], w2["qg"], w2["gam"]),
        "solve_full": lambda s: solve[(HV, slots), gc.CHUNK * gc.PARTS, s](w["gram"], w["gam"], beta, w["t"], w["p"]),
        "solve_1head": lambda s: solve[(1, slots), gc.CHUNK * gc.PARTS, s](w["gram"], w["gam"], beta, w["t"], w["p"]),
        "solve_1block": lambda s: solve[(1, 1), gc.CHUNK * gc.PARTS, s](w["gram"], w["gam"], beta, w["t"], w["p"]),
        "walk_full": lambda s: walk[(HV, -(-DV // cols)), threads, s](*flat, w["gam"], out),
        "walk_1colblock": lambda s: walk[(HV, 1), threads, s](*flat, w["gam"], out),
        "walk_4heads": lambda s: walk[(4, -(-DV // cols)), threads, s](*flat, w["gam"], out),
        "walk_1block": lambda s: walk[(1, 1), threads, s](*flat, w["gam"], out),
        "walk_step1_only": lambda s: walk1[(HV, -(-DV // cols)), threads, s](*flat, w["gam"], out),
        "walk_step2_only": lambda s: walk2[(HV, -(-DV // cols)), threads, s](*flat, w["gam"], out),
        "walk_step1_only_1block": lambda s: walk1[(1, 1), threads, s](*flat, w["gam"], out),
        "walk_step2_only_1block": lambda s: walk2[(1, 1), threads, s](*flat, w["gam"], out),
        "empty_graph_node": lambda s: walk[(1, 1), threads, s](*flat, w["gam"], out[:0]),
    }
    for name, launch in runs.items():
        try:
            result[name + "_ms"] = timed(launch)
        except Exception as exc:
            result[name + "_ms"] = f"failed: {exc!r}"
        print(name, result[name + "_ms"], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
