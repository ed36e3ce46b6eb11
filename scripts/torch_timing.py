"""GPU timing tools of the GPU scripts, through torch: the median of CUDA-event-timed calls (the baselines), the
same under torch.compile (each mode compiled afresh, its compile time beside it), a product's rate (the floors),
and the kernels a callable queues as CUPTI sees them (torch.profiler), summed per name with the idle gaps."""

import statistics
import time

import torch


def median_ms(fn, reps, warm=2):
    """Median milliseconds of `reps` calls of fn, each between two CUDA events on the current stream, after `warm`
    calls and a synchronisation."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


COMPILE_MODES = ("default", "reduce-overhead")


def compiled_ms(fn, reps, modes=COMPILE_MODES, static=(), warm=3):
    """{mode: {"ms": median of `reps` calls, "compile_s": seconds of the first call (tracing, inductor's code and
    autotuning, one run)}} of fn under torch.compile(mode=mode, dynamic=False), each mode compiled from an empty
    dynamo cache; a mode that fails to compile or run gets {"error": its first line}. `static`: tensors (the
    weights) marked as static addresses, so that CUDA graphs ("reduce-overhead") replay on them instead of
    copying them into the graph's own buffers on every call."""
    for t in static:
        torch._dynamo.mark_static_address(t)
    out = {}
    for mode in modes:
        compiled = None
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        try:
            compiled = torch.compile(fn, mode=mode, dynamic=False)
            torch.cuda.synchronize()
            began = time.perf_counter()
            compiled()
            torch.cuda.synchronize()
            out[mode] = {"compile_s": time.perf_counter() - began, "ms": median_ms(compiled, reps, warm=warm)}
        except Exception as e:           # the run goes on: the row says why this mode has no figure
            out[mode] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}
        del compiled
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return out


def best_mode(timings):
    """The mode of compiled_ms's result with the smallest ms, or None where none ran."""
    ran = {mode: t["ms"] for mode, t in timings.items() if "ms" in t}
    return min(ran, key=ran.get) if ran else None


def compile_description(modes):
    """How a run's torch.compile rows were made (bench_tables names them from this)."""
    try:
        import triton
        version = triton.__version__
    except ImportError:          # inductor then fails per mode, and the rows say so
        version = "absent"
    return {"torch": torch.__version__, "triton": version, "backend": "inductor", "modes": list(modes),
            "dynamic": False}


def compile_into(row, fn, reps, modes, static=()):
    """row["torch_compile"] = compiled_ms(...) of fn, and where a mode ran, its best: "torch_compile_best" and
    "torch_compile_ms" (the keys bench_tables reads for every stage)."""
    row["torch_compile"] = compiled_ms(fn, reps, modes, static=static)
    best = best_mode(row["torch_compile"])
    if best:
        row.update(torch_compile_best=best, torch_compile_ms=row["torch_compile"][best]["ms"])
    return row


def matmul_tflops(m, k, n, dtype):
    """TFLOP/s torch.matmul reaches on one [m, k] x [k, n] product of random `dtype` operands (median of 20):
    the rate a floor takes its products at."""
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype)
    ms = median_ms(lambda: a @ b.T, 20)
    return 2 * m * k * n / (ms * 1e-3) / 1e12


def cuda_spans(run):
    """(start us, end us, name) of every kernel and copy that run() puts on the GPU, under CUPTI, in time order."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        run()
        torch.cuda.synchronize()
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in p.events() if e.device_type.name == "CUDA")


def kernel_table(spans, repeats=1, group=None, top=40, gaps=6):
    """What spans (from cuda_spans over `repeats` identical runs) say, per run: ms and launches per kernel name
    (or per group(name)), largest first; the span from the first start to the last end, the time some kernel
    ran (overlaps counted once), and the longest idle gaps with the kernels either side."""
    totals = {}
    for start, end, name in spans:
        key = group(name) if group else name[:60]
        ms, n = totals.get(key, (0.0, 0))
        totals[key] = (ms + (end - start) / 1e3, n + 1)
    covered, idle, reach, last = 0.0, [], spans[0][0], spans[0][2]
    for start, end, name in spans:
        if start > reach:
            idle.append(((start - reach) / 1e3, last[:40], name[:40]))
        covered += max(0.0, end - max(start, reach))
        if end > reach:
            reach, last = end, name
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return {"runs": repeats, "span_ms": (reach - spans[0][0]) / 1e3 / repeats, "busy_ms": covered / 1e3 / repeats,
            "idle_gaps_ms": sorted(idle, reverse=True)[:gaps],
            "kernels": {k: {"ms": ms / repeats, "launches": n / repeats} for k, (ms, n) in rows}}


def by_family(keys):
    """A kernel_table group: a kernel named with one of `keys` (the first that matches) under that key, the
    rest (cuBLAS's) under their own names."""
    return lambda name: next((key for key in keys if key in name), "cuBLAS " + name[:60])


def table_lines(table):
    """The table's kernel rows as text, one a line."""
    return [f"{row['ms']:9.3f} ms  {row['launches']:7.1f} launches  {name}" for name, row in table["kernels"].items()]
