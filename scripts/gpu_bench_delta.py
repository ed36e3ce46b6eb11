"""The delta rule alone on the GPU at the 9B encoder's GDN shapes: the token recurrence (gdn, its default
and other launch geometries) against the chunked form (gdn_chunk: the setup kernel, then the walk, on TF32
tensor cores), each captured as a CUDA graph and replayed; each stage of the chunked form alone; the cycle
stamps of the recurrence's timed kernel (gdn.STAMPS) and of the chunk setup's phases (gdn_setup.PHASES).

The staged setup (prep, gram, solve, [U | W]) and the tile walk that this script once timed against the
setup kernel and the strip walk are in git history, with that comparison (BENCHMARKS.md at 705748d).

    python scripts/gpu_bench_delta.py --out delta.json
"""

import argparse
import json
import statistics
import time

import numpy as np
from numba import cuda

from cuda_kernels import gdn, gdn_chunk, gdn_setup
from moss_cli.ops.cuda.table import CudaOps
from moss_cli.gpu.capture import capture

HK, HV, DK, DV = 16, 32, 128, 128
LENGTHS = (112, 1024)
FORMS = {"recurrent": "recurrent", "chunked": "chunk"}
# the recurrence's other launch geometries (parts per column, threads per block, tokens per tile and group,
# state columns per thread)
GEOMETRIES = [(8, 256, 16, 2, 1), (8, 128, 16, 1, 2), (8, 128, 8, 1, 2), (8, 256, 16, 1, 2), (8, 64, 8, 1, 4),
              (16, 128, 16, 1, 2), (16, 128, 8, 1, 4), (4, 128, 8, 1, 2), (4, 64, 8, 1, 2)]


def inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    inp = gdn._make_delta_inputs(rng, "real")
    if n != inp["q"].shape[0]:
        inp = {k: np.ascontiguousarray(np.resize(v, (n,) + v.shape[1:])) for k, v in inp.items()}
    inp["g"] = inp["g"] * np.float32(6.0)          # decays as strong as the contract's chunked case
    return inp


def replay_ms(ops, args, form, geometry=None, reps=20):
    """Median wall time of `reps` replays (each synchronised) of the op captured as one graph."""
    ops.delta_geometry = geometry
    ops.gated_delta_rule(*args, form=form)          # compile, plan cuBLAS, fill the pool
    cuda.synchronize()
    graph, stream, out = capture(ops, lambda: ops.gated_delta_rule(*args, form=form))
    return graph_ms(graph, stream, reps), out.copy_to_host()


def graph_ms(graph, stream, reps):
    """Median wall ms of `reps` synchronised replays of a captured graph, after three unmeasured ones."""
    times = []
    for _ in range(reps + 3):
        t = time.perf_counter()
        graph.launch(stream)
        stream.sync()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[3:])


STAMP_NAMES = ("span", "first_loads", "tile_stages", "token_loops")     # gdn.STAMPS, in its order


def cycle_stamps(args, geometry=None, launches=3):
    """The recurrence's timed kernel (%clock64 of each block's thread 0) on args (q, k, v, g, beta at any
    head count): (blocks, threads a block, {stamp: cycles}), each the median over `launches` launches of
    the median over blocks."""
    parts, threads, tile, group, cols = gdn.fit_geometry(args[0].shape[2], geometry or gdn.GEOMETRY)
    blocks = args[2].shape[1] * -(-args[2].shape[2] // (threads // parts * cols))
    stamps = cuda.device_array((blocks, gdn.STAMPS), np.int64)
    out = cuda.device_array(args[2].shape, np.float32)
    medians = []
    for _ in range(launches):
        gdn.gated_delta_rule(*args, out, stamps=stamps, geometry=geometry)
        cuda.synchronize()
        medians.append(np.median(stamps.copy_to_host().astype(np.float64), axis=0))
    return blocks, threads, dict(zip(STAMP_NAMES, map(float, np.median(medians, axis=0))))


def recurrence_cycles(args, n):
    """The default recurrence's cycle stamps (cycle_stamps): the block's whole span, the first tile's
    loads, the tile stages and the token loops, in cycles and per token."""
    cycles = cycle_stamps(args)[2]
    return {"recurrent_cycles": cycles, "recurrent_cycles_per_token": {k: v / n for k, v in cycles.items()}}


def setup_cycles(args, launches=3):
    """The chunk setup's timed kernel (%clock64 of each block's thread 0 at each of gdn_setup.PHASES):
    the median over blocks of each phase's span and of the block's whole span, in cycles."""
    q, k, v, g, beta = args
    n, _, dk = q.shape
    shapes = gdn_chunk.workspace_shapes(n, v.shape[1], dk, v.shape[2])
    work = {name: cuda.device_array(shape, np.float32) for name, shape in shapes.items()}
    stamps = cuda.device_array((v.shape[1] * -(-n // gdn_setup.CHUNK), len(gdn_setup.PHASES)), np.int64)
    for _ in range(launches):
        gdn_setup.chunk_setup(q, k, v, g, beta, work["uw"], work["p"], work["gam"], stamps=stamps)
    cuda.synchronize()
    st = stamps.copy_to_host().astype(np.float64)
    spans = np.diff(st, axis=1)
    phases = zip(gdn_setup.PHASES, gdn_setup.PHASES[1:])
    return {"setup_phase_cycles": {f"{a}->{b}": float(np.median(spans[:, i])) for i, (a, b) in enumerate(phases)},
            "setup_block_cycles": float(np.median(st[:, -1] - st[:, 0]))}


def stage_ms(ops, args, reps=20):
    """Each stage of the chunked form alone (gdn_chunk.STAGES), captured and replayed on buffers a full run
    filled: median ms per stage."""
    q, k, v, g, beta = args
    n, _, dk = q.shape
    work = {name: cuda.device_array(shape, np.float32)
            for name, shape in gdn_chunk.workspace_shapes(n, v.shape[1], dk, v.shape[2]).items()}
    out = cuda.device_array(v.shape, np.float32)
    gdn_chunk.gated_delta_rule_chunked(*args, out, work)
    cuda.synchronize()
    times = {}
    for stage in gdn_chunk.STAGES:
        graph, stream, _ = capture(ops, lambda: gdn_chunk.gated_delta_rule_chunked(
            *args, out, work, stream=ops.stream, stages=(stage,)))
        times[f"chunked_stage_{stage}_ms"] = graph_ms(graph, stream, reps)
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="delta.json")
    args = parser.parse_args()
    ops = CudaOps()
    ops.chunk_from = 0
    result = {}
    for n in LENGTHS:
        inp = inputs(n)
        dev = [cuda.to_device(inp[k]) for k in ("q", "k", "v", "g", "beta")]
        row, outs = {}, {}
        for label, form in FORMS.items():
            try:
                row[label + "_ms"], outs[label] = replay_ms(ops, dev, form)
            except Exception as exc:          # one failing form must not hide the others
                row[label + "_ms"] = f"failed: {exc!r}"
        for geometry in GEOMETRIES:
            label = "recurrent_p{}_t{}_tile{}_group{}_cols{}".format(*geometry)
            try:
                row[label + "_ms"], outs[label] = replay_ms(ops, dev, "recurrent", geometry)
            except Exception as exc:
                row[label + "_ms"] = f"failed: {exc!r}"
        try:
            row.update(recurrence_cycles(dev, n))
        except Exception as exc:
            row["recurrent_cycles"] = f"failed: {exc!r}"
        try:
            row.update(stage_ms(ops, dev))
        except Exception as exc:
            row["chunked_stages"] = f"failed: {exc!r}"
        try:
            row.update(setup_cycles(dev))
        except Exception as exc:
            row["setup_phase_cycles"] = f"failed: {exc!r}"
        ref = outs.get("recurrent")
        for label, o in outs.items():
            if ref is not None and label != "recurrent":
                row[label + "_rel_to_recurrent"] = float(np.abs(o - ref).max() / np.abs(ref).max())
        result[n] = row
        print(n, json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
