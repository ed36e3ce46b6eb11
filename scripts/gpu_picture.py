"""The whole picture on the GPU from a real-size MOSS-Image folder (scripts/make_real_checkpoint.py makes a
random one): the product's own path (stages.Model with device cuda, as moss-image runs it), timed stage by
stage, for each size twice (the second picture, another seed, reuses the loaded weights, the captured
graphs and the refined texts, and its noise is drawn on a host thread while the first denoises, as
`moss-image` does with several seeds).

Reports: seconds from process start to the three components made (each hands its weights to the uploader's
thread and returns), to the encoder's and the transformer's weights all on the GPU (their copies overlap the
first encode's and the first step's eager passes, which load or compile the kernels and plan the products),
and to the first denoising step, and how late a thread that sleeps 1 ms at a time woke up until then
(GilProbe: long waits for the GIL stall the feeder uploader's copy threads; the native lanes take it once a
batch), with the uploader's stats (the lanes' wall and CPU seconds inside their loops, and the kernel's account
of their threads: on a CPU, waiting for one, blocking and preempting switches); per picture
the encode, denoise and decode seconds and their sum; device memory in use after the load and at the end
(the pool only grows, so this is the peak of the run), and the shared pool's part of it; the seconds the decodes
waited for the decoder's weight splits (made on a host thread from its load on). Writes JSON and the
PNGs beside it.

    python scripts/gpu_picture.py MODEL_DIR --out picture.json [--sizes 1024 512] [--steps 50]
        [--host-profile profile.txt] [--uploader lanes|feeder] [--copy-threads N]

--host-profile: the process's host time under cProfile (the 40 largest by cumulative and by own time),
written to that file, and the whole profile beside it (.prof, for pstats); the profiler slows the host, so
such a run's seconds are not the figures. As moss-image does, the encoder's and the transformer's weights start
for the GPU right after the checkpoint is opened, before the kernel library is imported
(stages.preload_gpu_weights); --uploader lanes-late starts the lanes only when the components are made, and
--uploader feeder takes the Python feeder with copy threads (cuda_upload.Uploader) instead of the native lanes
(cuda_lanes.LaneUploader); --copy-threads sets the lanes (or the feeder's copy threads), for A/B runs of the
start-up.
"""

import threading
import time

START = time.perf_counter()


class GilProbe(threading.Thread):
    """Sleeps 1 ms at a time and keeps how late each wake-up was: a late wake-up is this thread waiting for the
    GIL (or the CPU), as the uploader's copy threads do between their pieces. Its record up to the first step
    says whether the first passes hold the GIL for long stretches while the weights are copied."""

    def __init__(self):
        super().__init__(daemon=True)
        self.lags, self.stop = [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            self.lags.append(time.perf_counter() - t - 0.001)

    def report(self):
        """Wake-ups so far, how many came more than 5 ms late and their total lateness, and the latest."""
        lags = list(self.lags)
        late = [x for x in lags if x > 0.005]
        return {"wakeups": len(lags), "late_5ms": len(late), "late_5ms_s": sum(late),
                "latest_ms": 1e3 * max(lags, default=0.0)}


PROBE = GilProbe()
PROBE.start()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from moss_cli import artifacts, stages  # noqa: E402
from moss_cli.checkpoint import open_checkpoint  # noqa: E402
from moss_cli.progress import Silent  # noqa: E402
from floors import denoise_flops  # noqa: E402

PROMPT = "a red fox in the snow, morning light, detailed fur"


class Clock(Silent):
    """Silent progress that keeps the time of each picture's first denoising step."""

    def __init__(self):
        super().__init__()
        self.first_step = None

    def step(self, i, n, *args, **kwargs):
        if i == 0 and self.first_step is None:
            self.first_step = time.perf_counter()


def _parts(model, lat, png, size, seed):
    """Seconds of the pieces around the GPU work, each timed again on its own after the picture: the noise
    (on the host), the decoder's pixels alone (GPU, copied out) and the PNG written from them."""
    from moss_cli import noise
    from moss_cli.png import encode_png
    shape = lat.tensors["latents"].shape
    t0 = time.perf_counter()
    noise.randn(shape, seed)
    t1 = time.perf_counter()
    pixels = model.decoder.decode(lat.tensors["latents"]) if model.device == "cuda" and png else None
    t2 = time.perf_counter()
    if pixels is not None:
        encode_png(pixels, {"parameters": "x" * 400})
    t3 = time.perf_counter()
    return {"noise_s": t1 - t0, "decode_pixels_s": t2 - t1 if pixels is not None else None,
            "png_s": t3 - t2 if pixels is not None else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 512])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--guidance", type=float, default=3.0)
    ap.add_argument("--device", default="cuda", help="cpu: the same flow on the CPU (a check of the script)")
    ap.add_argument("--host-profile", help="write cProfile's tables of this process here (slows it)")
    ap.add_argument("--uploader", choices=("lanes", "lanes-late", "feeder"), default="lanes",
                    help="lanes: the native lanes from before the kernel imports (moss-image's); lanes-late: the lanes "
                         "from the components' loads on; feeder: the Python feeder and its copy threads")
    ap.add_argument("--copy-threads", type=int, help="the lanes, or the feeder's copy threads (default: 8)")
    args = ap.parse_args()
    if args.device == "cuda":      # the uploader's settings for an A/B run
        from moss_cli.memory import lanes as cuda_lanes
        if args.copy_threads:
            cuda_lanes.LANES = args.copy_threads
        if args.uploader == "feeder":
            from moss_cli.memory import upload as cuda_upload
            cuda_upload.USE_LANES = False
            if args.copy_threads:
                cuda_upload.THREADS = args.copy_threads
    if args.host_profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            run(args)
        finally:
            profiler.disable()
            _write_profile(profiler, args.host_profile)
    else:
        run(args)


def _write_profile(profiler, path):
    import io
    import pstats
    text = io.StringIO()
    for key in ("cumulative", "tottime"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(40)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text.getvalue())
    profiler.dump_stats(str(Path(path).with_suffix(".prof")))     # the whole profile, for pstats' callers/callees


def _uploaded(model_device):
    """The staging uploader's stats so far (bytes, seconds, host_s, wait_s), or None on the CPU; for the lanes
    also where their threads' time went (lane_sched)."""
    if model_device != "cuda":
        return None
    from moss_cli.memory.upload import uploader
    up = uploader()
    stats = dict(up.stats())
    if hasattr(up, "thread_ids"):
        stats["lane_sched"] = _sched(up.thread_ids())
    return stats


def _sched(tids):
    """The kernel's account of these threads so far, summed (Linux): seconds on a CPU and waiting for one (from
    /proc/self/task/ID/schedstat), and their voluntary (blocked: a fault, a lock, a sleep) and involuntary
    (preempted) context switches; None where /proc does not say."""
    total = {"on_cpu_s": 0.0, "runqueue_s": 0.0, "voluntary_switches": 0, "involuntary_switches": 0}
    try:
        for tid in tids:
            on_cpu, waiting = open(f"/proc/self/task/{tid}/schedstat").read().split()[:2]
            total["on_cpu_s"] += int(on_cpu) / 1e9
            total["runqueue_s"] += int(waiting) / 1e9
            for line in open(f"/proc/self/task/{tid}/status"):
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    key = "voluntary_switches" if line.startswith("vol") else "involuntary_switches"
                    total[key] += int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return total


def _uploader_kind(args, model_device):
    """Which uploader the process uses: lanes (preloaded, or late), or the feeder with its switch interval (None
    on the CPU)."""
    if model_device != "cuda":
        return None
    from moss_cli.memory import upload as cuda_upload
    if cuda_upload.USE_LANES:
        return "lanes, preloaded" if args.uploader == "lanes" else "lanes, late"
    return f"feeder (switch interval {cuda_upload.SWITCH_S} s)"


def _landed(out, up):
    """The encoder's and the transformer's weights through the uploader's thread (handed over as each component
    was made, taken by the first passes as they came): when the last copy was done, and the thread's host time."""
    if up is None or up["landed_at"] is None:
        return
    out["start_to_loaded_s"] = up["landed_at"] - START
    out["uploader"] = {k: v for k, v in up.items() if k != "landed_at"}
    if "host_cpu_s" in up:
        how = (f"{up['threads']} native lanes, {up['host_s']:.2f} s inside their loops, {up['host_cpu_s']:.2f} s of "
               f"CPU, {up.get('slot_wait_s', 0.0):.2f} s waiting for slots")
        sched = up.get("lane_sched")
        if sched:
            how += (f"; the lane threads in all {sched['on_cpu_s']:.2f} s on a CPU, {sched['runqueue_s']:.2f} s "
                    f"waiting for one, {sched['voluntary_switches']} blocking and {sched['involuntary_switches']} "
                    f"preempting switches")
    else:
        how = (f"the feeder: host copies {up['host_s']:.2f} s, all its work {up['feed_s']:.2f} s; {up['threads']} "
               f"copy threads inside their copies {up['piece_s']:.2f} s, {up['piece_cpu_s']:.2f} s of CPU")
    print(f"weights on the GPU {out['start_to_loaded_s']:.2f} s after process start ({up['bytes'] / 1e9:.2f} GB; "
          f"{how}; waits for the device {up['wait_s']:.2f} s; {out['uploader_kind']}); first step at "
          f"{out['start_to_first_step_s']:.2f} s", flush=True)
    gil = out["gil_probe_to_first_step"]
    print(f"a thread sleeping 1 ms at a time up to the first step: {gil['late_5ms']} of {gil['wakeups']} wake-ups "
          f"over 5 ms late ({gil['late_5ms_s']:.2f} s in all), the latest {gil['latest_ms']:.0f} ms", flush=True)


def run(args):
    checkpoint = open_checkpoint(args.model)
    preload = {"preload_at_s": time.perf_counter() - START}
    if args.device == "cuda" and args.uploader == "lanes":    # as moss-image: before the kernel library's imports
        preload["preload_bytes"] = stages.preload_gpu_weights(checkpoint, "cuda")[0]
        preload["preload_s"] = time.perf_counter() - START - preload["preload_at_s"]
        from moss_cli.memory.preload import MARKS    # the preload's steps, seconds from this script's start
        preload["preload_steps_s"] = {k: v - START for k, v in MARKS.items()}
        print("preload: " + ", ".join(f"{k} {v:.2f}" for k, v in preload["preload_steps_s"].items())
              + " s after the script's start", flush=True)
    from numba import cuda
    imported = time.perf_counter()
    clock = Clock()
    if args.device == "cuda":      # count the pool's blocks that come back inside a garbage collection
        from moss_cli.ops.cuda.table import shared_pool
        shared_pool().watch_collector()
    model = stages.Model(checkpoint, device=args.device, progress=clock)
    memory = (lambda: cuda.current_context().get_memory_info()) if args.device == "cuda" else (lambda: (0, 0))
    free0, total = memory()
    parts = {}
    for part in ("encoder", "transformer", "decoder"):     # as moss-image makes them, before the first encode
        t = time.perf_counter()
        getattr(model, part)
        parts[part] = time.perf_counter() - t
    made = time.perf_counter()
    out = {"uploader_kind": _uploader_kind(args, args.device), **preload, "imports_s": imported - START, "load_s": made - imported, "load_parts_s": parts,
           "start_to_made_s": made - START, "start_to_loaded_s": made - START,
           "device_memory_after_load_GB": (total - memory()[0]) / 1e9, "pictures": []}
    print(f"components made {made - START:.2f} s after process start (imports {imported - START:.2f} s; "
          + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()) + ")", flush=True)
    folder = Path(args.out).parent
    folder.mkdir(parents=True, exist_ok=True)
    for size in args.sizes:
        for rep in range(2):
            t0 = time.perf_counter()
            enc_bytes = stages.encode(model, PROMPT, "")
            enc = artifacts.parse(enc_bytes, "ENC", "encode", model.fingerprint)
            t1 = time.perf_counter()
            opts = stages.SamplingOptions(seed=42 + rep, steps=args.steps, guidance=args.guidance, width=size, height=size)
            # as moss-image with several seeds: the second picture's noise is drawn while the first denoises
            lat_bytes, _ = stages.denoise(model, enc, opts, next_seed=opts.seed + 1 if rep == 0 else None)
            lat = artifacts.parse(lat_bytes, "LAT", "denoise", model.fingerprint)
            t2 = time.perf_counter()
            try:
                png = stages.decode(model, lat)
            except Exception as e:          # the figures of the other stages still count
                out.setdefault("decode_errors", []).append(f"{type(e).__name__}: {e}")
                print(f"decode failed: {type(e).__name__}: {e}", flush=True)
                png = b""
            t3 = time.perf_counter()
            row = {"size": size, "repeat": rep, "encode_s": t1 - t0, "denoise_s": t2 - t1, "decode_s": t3 - t2,
                   "denoise_decode_s": t3 - t1, "picture_s": t3 - t0,
                   "dit_gpu_ms_per_step": getattr(model.transformer, "timings", {"gpu_s": 0.0})["gpu_s"]
                   / args.steps * 1e3}
            # the denoise's products (the picture's floor, with the decode's): each step's two passes
            texts_n = [enc.tensors[f"{role}_rows"].shape[0] for role in ("prompt", "negative")]
            row["text_tokens"], row["steps"] = texts_n, opts.steps
            row["denoise_tflop"] = denoise_flops(model.checkpoint.config("transformer"), (size // 16) ** 2,
                                                 texts_n[0], texts_n[1], opts.steps, len(opts.uncond_skip_layers),
                                                 opts.skip_start, opts.skip_stop) / 1e12
            timings = getattr(model.transformer, "timings", {})
            texts = getattr(model.transformer, "texts", None)      # the kept refined texts (CudaDenoiser)
            row["refined_texts"] = {"refined": texts.misses, "reused": texts.hits} if texts else None
            row["dit_loop_s"] = timings.get("wall_s", 0.0)        # denoise_s less this: the stage's own work
            row.update(_parts(model, lat, png, size, opts.seed))
            if clock.first_step is not None and not out["pictures"]:
                out["start_to_first_step_s"] = clock.first_step - START
                PROBE.stop.set()
                out["gil_probe_to_first_step"] = PROBE.report()
                _landed(out, _uploaded(args.device))
            out["pictures"].append(row)
            if png and rep == 0:
                (folder / f"picture-{size}.png").write_bytes(png)
            print(f"{size}x{size} #{rep}: noise {row['noise_s']:.3f} s, DiT loop {row['dit_loop_s']:.2f} s, pixels "
                  f"{row['decode_pixels_s'] or 0:.3f} s, PNG {row['png_s'] or 0:.3f} s (each again, alone)", flush=True)
            print(f"{size}x{size} #{rep}: encode {row['encode_s']:.2f} s, denoise {row['denoise_s']:.2f} s "
                  f"({row['dit_gpu_ms_per_step']:.1f} ms/step on the GPU), decode {row['decode_s']:.3f} s, "
                  f"picture {row['picture_s']:.2f} s", flush=True)
    free1, _ = memory()
    out["device_memory_in_use_GB"] = (total - free1) / 1e9
    out["device_memory_by_this_run_GB"] = (free0 - free1) / 1e9
    if args.device == "cuda":          # the one pool every component's activations and workspaces come from
        from moss_cli.ops.cuda.table import shared_pool
        out["pool_GB"] = shared_pool().bytes / 1e9
        out["pool_misses"] = shared_pool().misses      # captures lent other blocks than their plans
        out["pool_collector_gives"] = shared_pool().collector_gives
        out["pool_plans"] = shared_pool().plans        # each capture's eager pass: takes still lent at its end
        ops = model.decoder.ops       # its weights' splits, made on a host thread from its construction on
        out["decoder_split_wait_s"], out["decoder_late_splits"] = ops.split_wait_s, ops.late_splits
    print(f"start to first step {out.get('start_to_first_step_s', float('nan')):.2f} s; device memory in use "
          f"{out['device_memory_in_use_GB']:.1f} GB", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
