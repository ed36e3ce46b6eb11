"""Where one `moss-image --device cuda` call's time goes, from the command to its exit.

Each run is a fresh process, timed from its spawn to its exit, that runs the command with a few of its functions
wrapped in timers: the imports (per top-level package, outermost import only), the checkpoint's open, the weights'
preload and upload, the first use of cuBLASLt (product plans) and cuDNN (attention plans), the CUDA graph captures,
the kernels compiled, loaded from the prebuilt files or from the disk cache, the encode, each denoising step
(its end), the decode and the PNG; the teardown is the time from the command's return to the process's exit.

Runs: `first` processes, each with an empty GPU kernel cache ($XDG_CACHE_HOME, as on a fresh machine: kernels come
from the prebuilt files where there are any, else they compile; the host's numba cache as installed, where
moss-cli-build-kernels compiles the upload lanes' loop; --cold-host empties that too), then `warm` ones sharing
a folder a previous process filled; at each --sizes; then the three chained commands (encode, denoise, decode)
as separate processes.

    python scripts/gpu_call_cost.py MODEL_DIR --out call_cost.json [--sizes 512 1024] [--runs 3] [--steps 50] [--profile]

(--device cpu runs the same on the CPU: the CPU tests check the timing on the tiny checkpoint.)
"""

import argparse
import builtins
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a red fox in the snow, morning light, detailed fur"

# (module, attribute path, label): what the child times; a label's figure is its calls' inclusive seconds
TIMED = [
    ("moss_cli.checkpoint", "open_checkpoint", "checkpoint open"),
    ("moss_cli.stages", "preload_gpu_weights", "preload start"),
    ("moss_cli.stages", "memory_plan", "memory plan"),
    ("moss_cli.stages", "encode", "encode"),
    ("moss_cli.stages", "denoise", "denoise"),
    ("moss_cli.stages", "decode_pixels", "decode"),
    ("moss_cli.stages", "Model.encoder.func", "encoder load"),
    ("moss_cli.stages", "Model.transformer.func", "transformer load"),
    ("moss_cli.stages", "Model.decoder.func", "decoder load"),
    ("moss_cli.gpu.denoiser", "CudaDenoiser.upload", "transformer upload"),
    ("moss_cli.gpu.capture", "capture", "graph captures"),
    ("moss_cli.gpu.decoder", "DecoderOps._host_split_weight", "VAE splits taken"),
    ("moss_cli.ops.cuda.table", "CudaOps.__init__", "op tables made"),
    ("moss_cli.png", "encode_png", "PNG"),
    ("cuda_kernels.gemm", "Blas.__init__", "cuBLASLt handle"),
    ("cuda_kernels.gemm", "Blas._plan", "cuBLASLt plans"),
    ("cuda_kernels.sdpa", "_plan", "cuDNN plans"),
    ("cuda_kernels.prebuilt", "load", "kernels: prebuilt lookups"),
    ("numba.cuda.dispatcher", "_Kernel.__init__", "kernels: compiled"),
    ("numba.cuda.dispatcher", "CUDACache.load_overload", "kernels: disk cache lookups"),
    ("numba.cuda.dispatcher", "_Kernel.bind", "kernels: modules loaded"),
]

COMMANDS = {"image": "image_command", "encode": "encode_command", "denoise": "denoise_command",
            "decode": "decode_command"}


# --- the child: the command in this process, timed ---------------------------------------------------
class Timers:
    def __init__(self, t0):
        self.t0 = t0                # the parent's time.time() just before it spawned this process
        self.seconds, self.calls, self.events = {}, {}, []
        self.imports, self.untimed = {}, []
        self._local = threading.local()
        self._lock = threading.Lock()

    def now(self):
        return time.time() - self.t0

    def event(self, what):
        with self._lock:
            self.events.append((round(self.now(), 4), what))

    def add(self, label, seconds):
        with self._lock:
            self.seconds[label] = self.seconds.get(label, 0.0) + seconds
            self.calls[label] = self.calls.get(label, 0) + 1

    def wrap(self, fn, label):
        timers = self

        def timed(*args, **kwargs):
            active = timers._local.__dict__.setdefault("labels", set())
            if label in active:              # a call inside another of the same label counts once
                return fn(*args, **kwargs)
            active.add(label)
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                active.discard(label)
                timers.add(label, time.perf_counter() - began)
        timed.__wrapped__ = fn
        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            setattr(timed, attr, getattr(fn, attr, None))
        return timed

    def install(self):
        """Time every import statement's outermost import per top-level package, and wrap TIMED's functions as
        soon as their modules are loaded."""
        real, pending, timers = builtins.__import__, list(TIMED), self

        def patch():
            # after every import, nested ones too: a module that binds a timed function by name (from m import f)
            # must get the wrapper, and so must numba's cache before the kernel library wraps its lookups
            for item in list(pending):
                module = sys.modules.get(item[0])
                spec = getattr(module, "__spec__", None)
                if spec is None or getattr(spec, "_initializing", False):
                    continue
                pending.remove(item)
                try:
                    _patch(module, item[1], lambda fn, label=item[2]: timers.wrap(fn, label))
                except AttributeError:      # renamed in the product: the run goes on, the report names it
                    timers.untimed.append(f"{item[0]}.{item[1]}")

        def timed_import(name, globals=None, locals=None, fromlist=(), level=0):
            depth = getattr(timers._local, "depth", 0)
            timers._local.depth = depth + 1
            began = time.perf_counter()
            try:
                return real(name, globals, locals, fromlist, level)
            finally:
                timers._local.depth = depth
                spent = time.perf_counter() - began
                if depth == 0 and spent > 1e-4:
                    root = name.split(".")[0] if level == 0 else (globals or {}).get("__package__", "?").split(".")[0]
                    with timers._lock:
                        timers.imports[root] = timers.imports.get(root, 0.0) + spent
                if pending:
                    patch()
        builtins.__import__ = timed_import

    def report(self):
        return {"untimed": self.untimed, "events": self.events, "seconds": {k: round(v, 4) for k, v in sorted(self.seconds.items())},
                "calls": self.calls, "imports": {k: round(v, 4) for k, v in
                                                 sorted(self.imports.items(), key=lambda kv: -kv[1])}}


def _patch(module, path, wrap):
    """Replace module.<path> (a function, a method, or a cached_property's function) by wrap(it)."""
    *owners, name = path.split(".")
    owner = module
    for part in owners:
        owner = getattr(owner, part)
    if name == "func" and hasattr(owner, "func"):        # functools.cached_property
        owner.func = wrap(owner.func)
        return
    setattr(owner, name, wrap(getattr(owner, name)))


def child(report, command, args, t0):
    timers = Timers(t0)
    timers.event("python started")
    timers.install()
    from moss_cli import progress as progress_module
    timers.event("moss_cli imported")
    step, note = progress_module.Progress.step, progress_module.Progress.note

    def on_step(self, index, total, sigma, sigma_next):
        if index in (0, total - 1):
            timers.event(f"step {index + 1}/{total} done")
        return step(self, index, total, sigma, sigma_next)

    def on_note(self, message):
        timers.event(str(message)[:80])
        return note(self, message)
    progress_module.Progress.step, progress_module.Progress.note = on_step, on_note
    from moss_cli import cli
    timers.event("cli imported")
    sys.argv = [f"moss-{command}"] + args
    leave = os._exit

    profile = None
    if os.environ.get("CALL_COST_PROFILE"):     # the main thread under cProfile, its table written at the end
        import cProfile
        profile = cProfile.Profile()

    def write(code):
        timers.event("command returned")
        if profile is not None:
            profile.disable()
            _profile_table(profile, os.environ["CALL_COST_PROFILE"])
        out = timers.report()
        out.update(exit_code=code, returned_s=timers.now())
        if os.environ.get("CALL_COST_TREE"):      # whether the sources the command ran are the tree's (--tree)
            source = Path(sys.modules["moss_cli"].__file__).resolve()
            out["from_tree"] = source.is_relative_to(Path(os.environ["CALL_COST_TREE"]).resolve())
        if "cuda_kernels.prebuilt" in sys.modules:
            record = sys.modules["cuda_kernels.prebuilt"].RECORD
            out["prebuilt"] = {"file": record["file"], "rejected": record["rejected"], "loaded": len(record["loaded"]),
                               "missing": len(record["missing"])}
        Path(report).write_text(json.dumps(out))

    def report_and_leave(code):          # the command ends its process itself (cli._leave): report first
        write(code)
        leave(code)
    os._exit = report_and_leave
    if profile is not None:
        profile.enable()
    try:
        getattr(cli, COMMANDS[command])()
    except SystemExit as e:
        write(e.code or 0)
        raise


def _profile_table(profile, path):
    """The main thread's functions by cumulative and by own time (pstats' tables) into `path`."""
    import io
    import pstats
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(80)
    stats.sort_stats("tottime").print_stats(40)
    Path(path).write_text(text.getvalue().replace(str(ROOT) + "/", "").replace(sys.prefix + "/", "PREFIX/"))


# --- the parent: processes, timed from spawn to exit ---------------------------------------------------
TREE = None      # --tree: the source tree (a folder holding moss_cli/ and cuda_kernels/) the processes import


def run(command, args, cache, cold_host=False, profile=None):
    """One process of `command` with its GPU kernel cache under `cache` (and numba's host cache there too where
    cold_host; its main thread under cProfile into the file `profile` where given): {"wall_s", "teardown_s", the
    child's report}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
        if TREE:
            env["PYTHONPATH"] = os.pathsep.join([str(Path(TREE).resolve()), env.get("PYTHONPATH", "")])
            env["CALL_COST_TREE"] = str(TREE)
        env["XDG_CACHE_HOME"] = str(cache)
        if cold_host:
            env["NUMBA_CACHE_DIR"] = str(Path(cache) / "numba")
        if profile:
            env["CALL_COST_PROFILE"] = str(profile)
        began = time.time()
        done = subprocess.run([sys.executable, __file__, "--child", str(report), str(began), command, "--", *args],
                              env=env, capture_output=True, text=True)
        wall = time.time() - began
        if done.returncode != 0 or not report.exists():
            return {"command": command, "error": done.stderr.strip().splitlines()[-1:] or ["no report"],
                    "wall_s": wall}
        out = json.loads(report.read_text())
    out.update(command=command, wall_s=round(wall, 3), teardown_s=round(wall - out["returned_s"], 3))
    return out


def summary_line(label, r):
    if "error" in r:
        return f"{label}: error {r['error']}"
    top = sorted(r["seconds"].items(), key=lambda kv: -kv[1])[:8]
    imports = sum(r["imports"].values())
    return (f"{label}: {r['wall_s']:.2f} s from spawn to exit (teardown {r['teardown_s']:.2f} s, imports "
            f"{imports:.2f} s); " + ", ".join(f"{k} {v:.2f} s" for k, v in top))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, report, t0, command, sep, *args = sys.argv
        child(report, command, args, float(t0))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--no-chain", action="store_true", help="leave out the chained commands")
    ap.add_argument("--no-first", action="store_true",
                    help="leave out the first processes (each size's warm ones then fill one folder first, untimed)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cold-host", action="store_true", help="first processes without numba's host cache either")
    ap.add_argument("--profile", action="store_true",
                    help="one more warm moss-image at the largest size, its main thread under cProfile "
                         "(OUT's stem + _profile.txt; its timings are not in the medians), and a chained moss-decode "
                         "(_profile_decode.txt)")
    ap.add_argument("--tree", default=None,
                    help="run the moss_cli and cuda_kernels of this folder (e.g. `git archive REV moss_cli cuda_kernels "
                         "| tar x -C before`: an earlier revision measured in the same call)")
    args = ap.parse_args()
    global TREE
    TREE = args.tree
    work = Path(tempfile.mkdtemp(prefix="call-cost-"))
    out = {"device": args.device, "steps": args.steps, "runs": [], "tree": args.tree or "."}
    for size in sorted(args.sizes):
        image = ["--model", args.model, "--prompt", PROMPT, "--seed", "1", "--steps", str(args.steps), "--width",
                 str(size), "--height", str(size), "--picture", str(work / f"{size}.png"), "--device", args.device, "--quiet"]
        if args.no_first:               # one untimed process fills the warm runs' folder
            folder = work / f"fill-{size}"
            run("image", image, folder)
        for cache in ([] if args.no_first else ["first"] * args.runs) + ["warm"] * args.runs:
            if cache == "first":        # a fresh folder each; the last one, filled, serves the warm runs
                folder = work / f"first-{len(out['runs'])}"
            r = run("image", image, folder, args.cold_host and cache == "first")
            r.update(size=size, cache=cache)
            out["runs"].append(r)
            print(summary_line(f"moss-image {size}x{size}, {cache} kernel cache", r), flush=True)
    if not args.no_chain:
        size = max(args.sizes)
        enc, lat = work / "p.enc", work / "p.lat"
        chain = [("encode", ["--model", args.model, "--prompt", PROMPT, "--out", str(enc)]),
                 ("denoise", ["--model", args.model, str(enc), "--seed", "1", "--steps", str(args.steps), "--width",
                              str(size), "--height", str(size), "--out", str(lat)]),
                 ("decode", ["--model", args.model, str(lat), "--out", str(work / "chain.png")])]
        for i in range(args.runs):
            for command, cargs in chain:     # in the largest size's warm folder
                r = run(command, cargs + ["--device", args.device, "--quiet"], folder)
                r.update(size=size, cache="warm", chain=i)
                out["runs"].append(r)
                print(summary_line(f"moss-{command} {size}x{size} (chain {i + 1})", r), flush=True)
    if args.profile:
        size = max(args.sizes)
        table = Path(args.out).with_name(Path(args.out).stem + "_profile.txt")
        image = ["--model", args.model, "--prompt", PROMPT, "--seed", "1", "--steps", str(args.steps), "--width",
                 str(size), "--height", str(size), "--picture", str(work / "profiled.png"), "--device", args.device,
                 "--quiet"]
        r = run("image", image, folder, profile=table)
        out["profiled"] = dict(r, size=size, cache="warm", table=table.name)
        print(summary_line(f"moss-image {size}x{size}, warm, under cProfile ({table.name})", r), flush=True)
        if not args.no_chain:            # the chained decode: its eager pass is host time
            table = Path(args.out).with_name(Path(args.out).stem + "_profile_decode.txt")
            r = run("decode", chain[2][1] + ["--device", args.device, "--quiet"], folder, profile=table)
            out["profiled_decode"] = dict(r, size=size, cache="warm", table=table.name)
            print(summary_line(f"moss-decode {size}x{size}, warm, under cProfile ({table.name})", r), flush=True)
    out["medians"] = medians(out["runs"])
    Path(args.out).write_text(json.dumps(out, indent=1))
    shutil.rmtree(work, ignore_errors=True)


def medians(runs):
    """{"<command> <size> <cache>": {"wall_s", "teardown_s", "imports_s", and each timed label}}: medians over the
    runs that finished."""
    groups = {}
    for r in runs:
        if "error" not in r:
            groups.setdefault(f"{r['command']} {r['size']} {r['cache']}", []).append(r)
    out = {}
    for key, rs in groups.items():
        labels = sorted({k for r in rs for k in r["seconds"]})
        out[key] = {"runs": len(rs), "wall_s": statistics.median(r["wall_s"] for r in rs),
                    "teardown_s": statistics.median(r["teardown_s"] for r in rs),
                    "imports_s": statistics.median(sum(r["imports"].values()) for r in rs),
                    **{k: statistics.median(r["seconds"].get(k, 0.0) for r in rs) for k in labels}}
    return out


if __name__ == "__main__":
    main()
