"""Loading on the GPU: time from process start to all three components' weights on the device.

Each run is a fresh process (so "from process start" counts the imports, the CUDA context, opening the
checkpoint, the memory maps and the copies) that uploads every tensor each graph reads (the checkpoint's
expected tensors, or the product's weight lists) as the product stores them (2-D matrices as bf16 bits, the rest
float32) through the product's uploader, the native lanes (moss_cli/memory/lanes.py, --threads lanes), every
tensor handed over at once. Runs:

  early     the product's load as moss-image runs it, the files in the page cache: right after the checkpoint
            is opened, before the kernel library is imported, the encoder's and the transformer's weights go to
            the GPU (stages.preload_gpu_weights: the driver through ctypes, the lanes), then the components are
            made (CudaEncoder.upload and CudaDenoiser.upload take those weights; the VAE's params through the
            lanes), until every copy is done. The embedding table stays on the host, as in the product
  product   the same with the lanes started only after the imports and the context (no preload)
  cold      early, the page cache emptied first: `echo 3 > /proc/sys/vm/drop_caches` where permitted, else (and
            anyway) sync + posix_fadvise(DONTNEED) on every file of the folder, which evicts clean pages of
            files this user can open; the resident fraction (mincore) before and after is reported
  warm      every expected tensor (the embedding table too), handed over at once after the imports and the
            context (CudaOps.preload)
  feeder    warm, the Python feeder the lanes replaced (moss_cli/memory/upload.py: --staging-mb pinned buffers,
            --buffers of them, --threads copy threads), CudaOps.param per tensor
  baseline  warm, cuda.to_device per tensor from the memory map (pageable copies)
  link      the host-to-device link alone: 1 GiB pinned copied to the device, the best of five (the floor of
            a load: its bytes at this rate)

    python scripts/gpu_load.py MODEL_DIR --out load.json [--runs link,early,early,product,warm,feeder,baseline,cold] [--sweep]
        [--staging-mb 128] [--buffers 3] [--threads 8]
    python scripts/gpu_load.py MODEL_DIR --evict      (the page cache emptied as for a cold run, nothing else)

--sweep adds feeder runs with other staging sizes, buffer counts and thread counts.
"""

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("text_encoder", "transformer", "vae")
MODES = ("early", "product", "cold", "warm", "feeder", "baseline", "link")
PRELOADED = ("early", "cold")     # the runs that start the weights before the kernel library is imported
SWEEP = [(64, 2, 4), (64, 3, 8), (128, 3, 4), (256, 3, 8), (256, 2, 16), (128, 4, 16)]


# --- the page cache -------------------------------------------------------------------------------

def weight_files(model):
    return sorted(p for p in Path(model).rglob("*.safetensors") if p.is_file())


def resident(paths):
    """(bytes in the page cache, bytes) over the files, from mincore(2)."""
    import numpy as np
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    cached = total = 0
    for path in paths:
        size = path.stat().st_size
        total += size
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            libc.munmap(ctypes.c_void_p(addr), size)
            cached += min(size, int((np.frombuffer(vec, np.uint8) & 1).sum()) * page)
        finally:
            os.close(fd)
    return cached, total


def evict(paths):
    """Empty the page cache of these files; what was tried and what worked."""
    report = {}
    start = time.perf_counter()
    os.sync()                                   # dirty pages cannot be dropped
    report["sync_s"] = time.perf_counter() - start
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        report["drop_caches"] = "ok"
    except OSError as e:
        report["drop_caches"] = f"not permitted ({e.strerror}); posix_fadvise(DONTNEED) per file instead"
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    report["evict_s"] = time.perf_counter() - start
    return report


# --- a run (child process) ------------------------------------------------------------------------

def since_process_start():
    """Seconds since this process started (kernel clock ticks: 10 ms resolution)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])              # field 22: starttime, in clock ticks after boot
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def link_rate(size=1 << 30, copies=5):
    """GB/s of the host-to-device link: one pinned host buffer copied to the device, the best of `copies`
    (CUDA events around each): the load's floor is its bytes at this rate."""
    import numpy as np
    from numba import cuda
    host = cuda.pinned_array(size, np.uint8)
    host[:] = 1
    dev = cuda.device_array_like(host)
    best = float("inf")
    for _ in range(copies):
        start, stop = cuda.event(), cuda.event()
        start.record()
        dev.copy_to_device(host)
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) / 1e3)
    return {"mode": "link", "gb": host.nbytes / 1e9, "copy_s": best, "gb_per_s": host.nbytes / 1e9 / best}


def child(model, mode, staging_mb, buffers, threads):
    if mode == "link":
        return link_rate()
    at_start = since_process_start()            # the interpreter's own start-up before this line
    sys.path.insert(0, str(ROOT))
    marks = {"python_start_s": at_start - (time.perf_counter() - STARTED)}
    began = None
    if mode in PRELOADED:                       # moss-image's order: the checkpoint, the weights, then the imports
        t = time.perf_counter()
        from moss_cli import stages
        from moss_cli.checkpoint import open_checkpoint
        from moss_cli.memory import lanes as cuda_lanes
        cuda_lanes.LANES = threads
        marks["imports_before_preload_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ckpt = open_checkpoint(model)
        marks["open_checkpoint_s"] = time.perf_counter() - t
        began = t = time.perf_counter()
        marks["preload_bytes"] = stages.preload_gpu_weights(ckpt, "cuda")[0]
        marks["preload_s"] = time.perf_counter() - t
        from moss_cli.memory.preload import MARKS    # the preload's steps, seconds from process start
        marks["preload_steps_s"] = {k: v - STARTED + marks["python_start_s"] for k, v in MARKS.items()}
        if not marks["preload_bytes"] and os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0"):
            raise SystemExit("the preload sent nothing to the GPU")
    t = time.perf_counter()
    import numpy as np
    from numba import cuda
    from moss_cli.checkpoint import expected_tensors, open_checkpoint
    from moss_cli.memory import lanes as cuda_lanes, upload as cuda_upload
    from moss_cli.ops.cuda.table import CudaOps, _is_bf16
    from cuda_kernels.core import from_bf16_bits, to_bf16_bits
    marks["imports_s"] = time.perf_counter() - t
    t = time.perf_counter()
    cuda.current_context()
    marks["context_s"] = time.perf_counter() - t
    if mode not in PRELOADED:
        t = time.perf_counter()
        ckpt = open_checkpoint(model)
        marks["open_checkpoint_s"] = time.perf_counter() - t
    lanes = mode != "feeder" and cuda_upload.USE_LANES   # (the simulator has no driver for the lanes: the feeder)
    if lanes:
        cuda_lanes.LANES = threads
        up = cuda_upload._SHARED = cuda_lanes.process_lanes()
    else:
        up = cuda_upload._SHARED = cuda_upload.Uploader(staging_mb << 20, buffers, threads)
    free0, total_mem = cuda.current_context().get_memory_info()
    components = {}
    kept = []
    began = began or time.perf_counter()
    for name in COMPONENTS:
        t = time.perf_counter()
        comp = ckpt.component(name)
        mapped = time.perf_counter() - t
        wanted = expected_tensors(name, comp.config)
        nbytes = 0
        if mode in ("product",) + PRELOADED:
            ops = _product(name, comp, kept)
            nbytes = sum(a.nbytes for a in _device_arrays(ops))
        elif mode == "baseline":
            for key in wanted:
                host = np.asarray(comp.tensors[key])
                if host.ndim == 2:
                    out = cuda.to_device(np.ascontiguousarray(host.view(np.uint16) if _is_bf16(host.dtype)
                                                              else to_bf16_bits(host)))
                else:
                    out = cuda.to_device(np.ascontiguousarray(
                        from_bf16_bits(host.view(np.uint16)) if _is_bf16(host.dtype) else host, dtype=np.float32))
                kept.append(out)
                nbytes += out.nbytes
        elif mode == "warm":
            ops = CudaOps()
            ops.preload(comp.tensors, wanted)
            nbytes = sum(a.nbytes for a in _device_arrays(ops))
            kept.append(ops)
        else:
            ops = CudaOps()
            for key in wanted:
                nbytes += ops.param(comp.tensors, key).nbytes
            kept.append(ops)
        components[name] = {"tensors": len(wanted), "bytes": nbytes, "map_s": mapped,
                            "queued_s": time.perf_counter() - t}
    stats = up.finish()
    cuda.synchronize()
    done = time.perf_counter()
    free1, _ = cuda.current_context().get_memory_info()
    moved = sum(c["bytes"] for c in components.values())
    return {
        "mode": mode, "how": how(mode, staging_mb, buffers, threads, lanes),
        "staging_mb": staging_mb, "buffers": buffers, "threads": threads,
        "since_process_start_s": since_process_start(), "marks": marks,
        "upload_s": done - began, "bytes": moved, "gb": moved / 1e9, "gb_per_s": moved / 1e9 / (done - began),
        "uploader": stats, "components": components,
        "device_memory_used_gb": (free0 - free1) / 1e9, "device_memory_total_gb": total_mem / 1e9,
    }


def how(mode, staging_mb, buffers, threads, lanes):
    """The path a run's bytes take, in words."""
    if mode == "baseline":
        return "cuda.to_device per tensor"
    if not lanes:
        return f"the Python feeder, {buffers} x {staging_mb} MB pinned, {threads} copy threads"
    if mode in PRELOADED:
        return f"the product's, preloaded: the native lanes, {threads} of them, from before the kernel imports"
    if mode == "product":
        return f"the product's, the native lanes, {threads} of them, after the imports"
    return f"the native lanes, {threads} of them"


def _product(name, comp, kept):
    """The product's load of one component (stages.py): its weight list handed to the uploader."""
    from moss_cli.checkpoint import expected_tensors
    if name == "text_encoder":
        from moss_cli.gpu.encoder import cuda_encoder
        enc = cuda_encoder(comp)
        kept.append(enc)
        return enc.ops
    if name == "transformer":
        from moss_cli.gpu.denoiser import CudaDenoiser
        dit = CudaDenoiser(comp.tensors, comp.config)
        dit.upload()
        kept.append(dit)
        return dit.ops
    from moss_cli.ops.cuda.table import CudaOps
    ops = CudaOps()
    for key in expected_tensors(name, comp.config):
        ops.param(comp.tensors, key)
    kept.append(ops)
    return ops


def _device_arrays(ops):
    """The distinct device weights a CudaOps holds (params and stacks)."""
    seen = {}
    for value in ops._params.values():
        arr = getattr(value, "weight", value)
        arr = arr[0] if isinstance(arr, tuple) else arr
        seen[id(arr)] = arr
    return list(seen.values())


# --- the orchestration ----------------------------------------------------------------------------

def run_child(model, mode, staging_mb, buffers, threads, timeout):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [sys.executable, str(Path(__file__).resolve()), str(model), "--child", mode, "--child-out", str(out),
           "--staging-mb", str(staging_mb), "--buffers", str(buffers), "--threads", str(threads)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    try:
        result = json.loads(out.read_text()) if done.returncode == 0 else {"mode": mode, "error": done.stderr[-4000:]}
    finally:
        out.unlink(missing_ok=True)
    result["process_wall_s"] = wall
    if done.stdout.strip():
        result["stdout"] = done.stdout[-2000:]
    return result


def describe(r):
    if r.get("mode") == "link" and "error" not in r:
        return f"link     pinned host -> device, {r['gb']:.2f} GB: {r['copy_s'] * 1e3:.1f} ms = {r['gb_per_s']:.1f} GB/s"
    if "error" in r:
        return f"{r['mode']:9s} FAILED: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}"
    m, u = r["marks"], r["uploader"]
    early = (f"preload {m['preload_bytes'] / 1e9:.2f} GB handed over {m['preload_s']:.2f} s after "
             f"{m['imports_before_preload_s']:.2f} s of imports ("
             + ", ".join(f"{k} {v:.2f}" for k, v in m.get("preload_steps_s", {}).items())
             + " s from process start), then " if "preload_s" in m else "")
    return (f"{r['mode']:8s} ({r['how']}): "
            f"{r['since_process_start_s']:6.2f} s from process start to {r['gb']:.2f} GB on the GPU; upload "
            f"{r['upload_s']:6.2f} s = {r['gb_per_s']:5.1f} GB/s ({early}imports {m['imports_s']:.2f} s, context "
            f"{m['context_s']:.2f} s, open {m['open_checkpoint_s']:.2f} s; host copies {u['host_s']:.2f} s"
            + (f" ({u['host_cpu_s']:.2f} s on a CPU, {u['slot_wait_s']:.2f} s waiting for slots)"
               if u.get("slot_wait_s") is not None else "")
            + f", waits {u['wait_s']:.2f} s, {u['copies']} copies)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--out", type=Path, help="results JSON")
    p.add_argument("--runs", default="link,early,early,product,warm,feeder,baseline,cold",
                   help="comma-separated: early, product, cold, warm, feeder, baseline, link")
    p.add_argument("--sweep", action="store_true", help="also feeder runs over staging size, buffers and threads")
    p.add_argument("--staging-mb", type=int, default=128)
    p.add_argument("--buffers", type=int, default=3)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--evict", action="store_true",
                   help="only empty the page cache of the folder's weight files (before another script's process "
                        "on a cold cache) and say how much of them stays cached")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = child(args.model, args.child, args.staging_mb, args.buffers, args.threads)
        args.child_out.write_text(json.dumps(result, indent=1))
        return
    files = weight_files(args.model)
    if not files:
        sys.exit(f"{args.model}: no safetensors files (make one: python scripts/make_real_checkpoint.py DIR)")
    cached, total = resident(files)
    print(f"{args.model}: {len(files)} weight files, {total / 1e9:.2f} GB, {cached / total:.0%} in the page cache",
          flush=True)
    if args.evict:
        report = evict(files)
        print(f"evicted ({report['drop_caches']}; {report['evict_s']:.1f} s): {resident(files)[0] / total:.0%} "
              "still in the page cache", flush=True)
        return
    modes = [mode.strip() for mode in args.runs.split(",") if mode.strip()]
    plan = [(mode, args.staging_mb, args.buffers, args.threads) for mode in modes]
    if args.sweep:
        cold = [r for r in plan if r[0] == "cold"]
        plan = [r for r in plan if r[0] != "cold"] + [("feeder", *s) for s in SWEEP] + cold
    results = []
    for mode, staging_mb, buffers, threads in plan:
        if mode not in MODES:
            sys.exit(f"unknown run {mode!r}")
        entry = {}
        if mode == "cold":
            entry["evict"] = evict(files)
        entry["cached_before"] = resident(files)[0] / total
        result = run_child(args.model, mode, staging_mb, buffers, threads, args.timeout)
        result.update(entry)
        results.append(result)
        print(describe(result) + f"  [cached before: {entry['cached_before']:.0%}]", flush=True)
        if "evict" in entry:
            print(f"          eviction: {entry['evict']}", flush=True)
    summary = {"model": str(args.model), "files": len(files), "file_bytes": total, "runs": results}
    warm = [r for r in results if r.get("mode") in ("warm", "feeder") and "error" not in r]
    if warm:                   # the fastest upload from a warm page cache, the lanes' or the feeder's
        best = min(warm, key=lambda r: r["upload_s"])
        summary["best_warm"] = {k: best[k] for k in ("mode", "how", "staging_mb", "buffers", "threads", "upload_s",
                                                      "gb_per_s", "since_process_start_s")}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
        print(f"wrote {args.out}")
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
