"""Where the 9B encoder's graph leaves the GPU idle: one 1000-token replay (random weights, as
gpu_encoder_9b.py) under CUPTI, its kernels and copies in time order, the span from the first start to
the last end, the time covered by some kernel, and the largest idle gaps with the kernels on either side;
beside the CUDA-event time of the same call (BENCHMARKS.md: at 1000 tokens ~2.5 ms of the events' time
lie outside the graph's nodes).

Then the bucket's graph captured again with an event node first and last (`marked`): the outer events
around the launch against the inner ones say whether that time is before the first node (the launch)
or after the last (`launch_call_ms`: the host's graph.launch call alone); `upload` launches after
cuda.core's Graph.upload on the same stream.

    python3 scripts/gpu_encoder_gaps.py --out gaps.json [--tokens 1000]
"""

import argparse
import json
import time

import numpy as np

from numba import cuda

from gpu_encoder_9b import CONFIG, make_weights
from torch_timing import cuda_spans, kernel_table
from moss_cli.gpu.encoder import CudaEncoder, bucket
from moss_cli.ops.cuda.table import numba_stream


def timeline(enc, ids, held):
    """The encode's kernels and copies in time order (CUPTI), and its own timings."""
    spans = cuda_spans(lambda: enc(ids, out=held))
    return spans, dict(enc.timings)


def marked(enc, n, repeats=5):
    """Outer (around the launch) and inner (first and last graph nodes) event times of the n-token bucket's
    graph, recaptured by CudaEncoder._capture with its model call wrapped in two event records (so two
    event nodes, first and last; the bucket keeps that graph); median ms over repeats."""
    ops, model = enc.ops, enc.model
    first, last = cuda.event(), cuda.event()

    def wrapped(ids, **kwargs):
        first.record(numba_stream(ops.stream))
        out = model(ids, **kwargs)
        last.record(numba_stream(ops.stream))
        return out
    enc.model = wrapped
    try:
        enc._capture(bucket(n))
    finally:
        enc.model = model
    c = enc._captured[bucket(n)]
    graph, stream, queue, began, ran = c.graph, c.stream, c.queue, c.began, c.ran
    result = {}
    for mode in ("launch", "upload"):
        rows = []
        for _ in range(repeats + 1):
            began.record(queue)
            if mode == "upload":
                graph.upload(stream)
            t = time.perf_counter()
            graph.launch(stream)
            host = 1e3 * (time.perf_counter() - t)
            ran.record(queue)
            ran.synchronize()
            rows.append((cuda.event_elapsed_time(began, first), cuda.event_elapsed_time(first, last),
                         cuda.event_elapsed_time(last, ran), cuda.event_elapsed_time(began, ran), host))
        rows = np.array(rows[1:])
        names = ("to_first_node_ms", "first_to_last_node_ms", "last_node_to_end_ms", "total_ms", "launch_call_ms")
        result[mode] = dict(zip(names, np.median(rows, axis=0).round(4).tolist()))
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gaps.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000, 100])
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
            table = kernel_table(spans, top=0, gaps=25)
            runs.append({"events": len(spans), "span_ms": table["span_ms"], "busy_ms": table["busy_ms"],
                         "largest_gaps": table["idle_gaps_ms"], "timings": timings})
        try:
            runs.append({"marked": marked(enc, n)})
        except Exception as exc:      # a diagnosis: report, go on
            runs.append({"marked_failed": repr(exc)})
        result[str(n)] = runs
        print(json.dumps(result[str(n)], indent=1), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
