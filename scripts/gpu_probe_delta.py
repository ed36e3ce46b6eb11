"""Where the chunked delta rule's stages spend their time: each stage kernel (gdn_chunk, gdn_setup) relaunched with
smaller grids (fewer blocks doing the same per-block work), captured as a CUDA graph and replayed. A stage
whose time stays when its grid shrinks waits on latency inside a block; one whose time falls with the grid
is bound by a shared resource (memory or L2 bandwidth). Timings only: shrunken grids compute wrong values.
"empty_graph_node" is a one-block walk over zero tokens: the replay's own cost, in every other number.

    python scripts/gpu_probe_delta.py --out probe.json [--n 112] [--walk 32,512,strip]
"""

import argparse
import json

import numpy as np
from numba import cuda

from cuda_kernels import gdn_chunk as gc, gdn_setup as gs
from cuda_kernels.core import allow_shared
from moss_cli.ops.cuda_table import CudaOps, capture

from gpu_bench_delta import HK, HV, DK, DV, graph_ms, inputs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="probe.json")
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--walk", default=None, help="cols,threads[,strip] (default gdn_chunk.WALK)")
    args = parser.parse_args()
    walk_geometry = gc.WALK if args.walk is None else tuple(int(x) if x.isdigit() else x for x in args.walk.split(","))
    ops = CudaOps()
    inp = inputs(args.n)
    q, k, v, g, beta = (cuda.to_device(inp[x]) for x in ("q", "k", "v", "g", "beta"))
    n = args.n
    shapes = gc.workspace_shapes(n, HK, HV, DK, DV, "stages")
    w = {name: cuda.device_array(shape, np.float32) for name, shape in shapes.items()}
    out = cuda.device_array(v.shape, np.float32)
    gc.gated_delta_rule_chunked(q, k, v, g, beta, out, w, setup="stages", walk=walk_geometry)
    gc.gated_delta_rule_chunked(q, k, v, g, beta, out, w, setup="fused", walk=walk_geometry)
    cuda.synchronize()
    setup = gs._setup[(False, HV // HK, DK, DV, gc.CHUNK, gc.SUB, False)]
    sargs = (q.reshape(q.size), k.reshape(k.size), v, g, beta, w["uw"].reshape(w["uw"].size),
             w["p"].reshape(w["p"].size), w["gam"], gs._no_stamps[0])
    sbytes = 4 * gs.setup_layout(DK, DV)[1]
    r = HV // HK
    slots = -(-n // gc.CHUNK) + 1
    prep = gc._prep[r]
    solve = gc._solve[(False, r)]
    cols, threads, variant = gc.walk_variant(walk_geometry)
    walk = gc._walk[(False, cols, threads, DK, variant)]
    wargs = (w["uw"].reshape(w["uw"].size), w["p"].reshape(w["p"].size), q.reshape(q.size), k.reshape(k.size),
             w["gam"], out)
    nbytes = 4 * gc.walk_layout(cols, DK, variant)[1]
    allow_shared(walk, wargs, nbytes)
    empty = wargs[:5] + (out[:0],)

    def timed(launch):
        graph, stream, _ = capture(ops, lambda: launch(ops.stream))
        return graph_ms(graph, stream, 20)

    runs = {
        "prep_full": lambda s: prep[(HV, slots), gc.THREADS, s](q, k, v, g, beta, w["qk"], w["rhs"], w["gam"]),
        "prep_1block": lambda s: prep[(1, 1), gc.THREADS, s](q, k, v, g, beta, w["qk"], w["rhs"], w["gam"]),
        "solve_full": lambda s: solve[(HV, slots), gc.CHUNK * gc.PARTS, s](w["gram"], w["gam"], beta, w["t"], w["p"]),
        "solve_1block": lambda s: solve[(1, 1), gc.CHUNK * gc.PARTS, s](w["gram"], w["gam"], beta, w["t"], w["p"]),
        "setup_full": lambda s: setup[(HV, -(-n // gc.CHUNK)), gs.THREADS, s, sbytes](*sargs),
        "setup_1block": lambda s: setup[(1, 1), gs.THREADS, s, sbytes](*sargs),
        "walk_full": lambda s: walk[(HV, -(-DV // cols)), threads, s, nbytes](*wargs),
        "walk_1block": lambda s: walk[(1, 1), threads, s, nbytes](*wargs),
        "empty_graph_node": lambda s: walk[(1, 1), threads, s, nbytes](*empty),
    }
    result = {"n": n, "walk": list(walk_geometry)}
    # the setup's phases in cycles (%clock64 of thread 0 at each of gdn_setup.PHASES): the median over
    # blocks of each phase's span, and each block's whole span
    blocks = HV * -(-n // gc.CHUNK)
    stamps = cuda.device_array((blocks, len(gs.PHASES)), np.int64)
    for _ in range(3):
        gs.chunk_setup(q, k, v, g, beta, w["uw"], w["p"], w["gam"], stamps=stamps)
    cuda.synchronize()
    st = stamps.copy_to_host().astype(np.float64)
    spans = np.diff(st, axis=1)
    result["setup_phase_cycles_median"] = {f"{a}->{b}": float(np.median(spans[:, i]))
                                           for i, (a, b) in enumerate(zip(gs.PHASES, gs.PHASES[1:]))}
    result["setup_block_cycles_median"] = float(np.median(st[:, -1] - st[:, 0]))
    print("setup phases (cycles, median over blocks):", result["setup_phase_cycles_median"],
          result["setup_block_cycles_median"], flush=True)
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
