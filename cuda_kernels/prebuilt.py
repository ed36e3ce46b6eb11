"""Kernels compiled ahead of time, loaded at a kernel's first use instead of compiled.

One file per target: cubins for sm_80 (which also runs on 8.6 and 8.7), sm_89 and sm_90a, and PTX for
compute_90 that a newer GPU links for itself at load. Each holds every kernel recorded in a numba cache folder
(the kernels the runs that filled it compiled, with their NVVM IR), compiled anew for the target, so no GPU is
needed to build. A file made from other kernel sources (stale), by another numba-cuda, numba or CUDA major
version or for another target (foreign), or whose bytes fail its checksum (corrupt) is never loaded: its
kernels compile and go to the disk cache as they would without it, and `build` writes it anew.

    python -m cuda_kernels.prebuilt build [--cache DIR] [--out DIR] [--targets sm_80 sm_89 sm_90a compute_90]
    moss-cli-build-kernels ...      (the same, after compiling the upload lanes' host loop)
    python -m cuda_kernels.prebuilt check [--out DIR]     (each file's state for this install)
"""

import argparse
import hashlib
import json
import lzma
import os
import pickle
import sys
from pathlib import Path

FORMAT = 1
MAGIC = b"moss-cli kernels\n"
SUFFIX = ".kernels"
FOLDER = Path(__file__).with_name("prebuilt")
# target name -> the compute capability numba keys its code by (the "a" variant is what numba builds on a 9.0)
TARGETS = {"sm_80": (8, 0, ""), "sm_89": (8, 9, ""), "sm_90a": (9, 0, "a"), "compute_90": (9, 0, "")}

# what this process did: the file it opened (or why none), the kernels it loaded, and those it lacked
RECORD = {"file": None, "rejected": None, "loaded": [], "missing": [], "unusable": []}
_OPEN = {}


def folder():
    """Where the prebuilt files are read from: $MOSS_PREBUILT_KERNELS, else the package's prebuilt/ folder."""
    return Path(os.environ.get("MOSS_PREBUILT_KERNELS") or FOLDER)


# the package's tooling, which defines no kernel the product runs: its edits leave the files and caches current
TOOLING = ("contract.py", "prebuilt.py", "resources.py")


def sources_digest(sources=Path(__file__).parent):
    """sha256 of the kernel package's sources but its tooling (TOOLING): any edit of a module that holds kernels
    or what they call (a device function another module's kernel calls included) is another digest."""
    digest = hashlib.sha256()
    for path in sorted(Path(sources).glob("*.py")):
        if path.name not in TOOLING:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def toolchain():
    """What the stored code and its pickled form depend on besides the sources and the target."""
    import numba
    import numba_cuda
    from numba.cuda.cudadrv.runtime import runtime
    return {"numba-cuda": numba_cuda.__version__, "numba": numba.__version__, "cuda": runtime.get_version()[0]}


def kernel_key(func, sig):
    """A kernel's name in the files: its argument types, its code and the values its factory closed it over."""
    from .core import _digests
    return _name(sig, _digests(func))


def _name(sig, digests):
    return "|".join((", ".join(str(a) for a in getattr(sig, "args", sig)), *digests))


def targets_for(cc):
    """The targets whose code runs on a device of compute capability cc = (major, minor), best first: its own
    cubins, the cubins of a lower minor of its major (binary compatible; sm_90a runs on 9.0 only), then PTX of
    an older or equal architecture."""
    major, minor = cc
    cubins = sorted(((c, name) for name, c in TARGETS.items() if name.startswith("sm_")), reverse=True)
    ptx = sorted(((c, name) for name, c in TARGETS.items() if name.startswith("compute_")), reverse=True)
    own = [name for c, name in cubins if c[:2] == (major, minor)]
    lower = [name for c, name in cubins if c[0] == major and c[1] < minor and not c[2]]
    return own + lower + [name for c, name in ptx if c[:2] <= (major, minor)]


# --- the file ---------------------------------------------------------------------------------------
def write(path, target, kernels, digest=None, tools=None):
    """Write {key: entry bytes} as the file of `target`: a header (format, target, the sources' digest, the
    toolchain, a checksum of the body) and the body, the entries lzma-compressed."""
    body = lzma.compress(pickle.dumps(kernels, protocol=pickle.HIGHEST_PROTOCOL), preset=9)
    header = {"format": FORMAT, "target": target, "sources": digest or sources_digest(),
              "toolchain": tools or toolchain(), "kernels": len(kernels),
              "sha256": hashlib.sha256(body).hexdigest()}
    path = Path(path)
    part = path.with_name(path.name + ".part")
    part.write_bytes(MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + body)
    os.replace(part, path)


def read(path, target, digest=None, tools=None):
    """({key: entry bytes}, None) of the file at path, or (None, why not): absent, corrupt (the checksum or the
    form), stale (other sources), or foreign (another target, format or toolchain)."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return None, "absent"
    if not raw.startswith(MAGIC) or b"\n" not in raw[len(MAGIC):]:
        return None, "corrupt: not a prebuilt kernel file"
    line, body = raw[len(MAGIC):].split(b"\n", 1)
    try:
        header = json.loads(line)
    except ValueError:
        return None, "corrupt: unreadable header"
    if header.get("format") != FORMAT or header.get("target") != target:
        return None, f"foreign: made for {header.get('target')} (format {header.get('format')}), wanted {target}"
    if header.get("toolchain") != (tools or toolchain()):
        return None, f"foreign: made with {header.get('toolchain')}, this install is {tools or toolchain()}"
    if header.get("sources") != (digest or sources_digest()):
        return None, "stale: made from other kernel sources"
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        return None, "corrupt: checksum mismatch"
    try:
        kernels = pickle.loads(lzma.decompress(body))
    except Exception as e:          # a body that passes its checksum but does not unpack: still not loaded
        return None, f"corrupt: {type(e).__name__}"
    return kernels, None


def _store(cc):
    """(target, {key: entry bytes}) of the first usable file for compute capability cc, or (None, {})."""
    if cc not in _OPEN:
        reasons = []
        for target in targets_for(cc):
            kernels, why = read(folder() / (target + SUFFIX), target)
            if kernels is not None:
                RECORD.update(file=target + SUFFIX, rejected=None)
                _OPEN[cc] = (target, kernels)
                break
            reasons.append(f"{target}{SUFFIX}: {why}")
        else:
            RECORD.update(file=None, rejected="; ".join(reasons) or "no target for this GPU")
            _OPEN[cc] = (None, {})
    return _OPEN[cc]


# --- an entry ---------------------------------------------------------------------------------------
_LIBRARY_DROPS = ("codegen", "llvm_strs", "ptx_cache", "cubin_cache", "linkerinfo_cache")


def entry(payload, target):
    """A recorded kernel (numba's cache payload: the kernel's state, its code library with NVVM IR) as bytes
    holding only `target`'s code: a cubin, or PTX for a newer GPU to link."""
    lib = payload["codelibrary"]
    cc = TARGETS[target]
    code = bytes(lib.get_cubin(cc=cc).code) if target.startswith("sm_") else lib.get_asm_strs(cc=cc)
    states = {k: v for k, v in lib._reduce_states().items() if k not in _LIBRARY_DROPS}
    kernel = {k: v for k, v in payload.items() if k != "codelibrary"}
    return pickle.dumps({"kernel": kernel, "library": states, "code": code}, protocol=pickle.HIGHEST_PROTOCOL)


def kernel(data, cc):
    """The numba kernel of an entry, its code keyed by the device's compute capability as numba keys it."""
    from cuda.core import ObjectCode
    from numba.cuda.codegen import CUDACodeLibrary
    from numba.cuda.dispatcher import _Kernel
    stored = pickle.loads(data)
    key = (cc[0], cc[1], "a" if tuple(cc) >= (9, 0) else "")
    code = stored["code"]
    cubins, ptx = ({key: ObjectCode.from_cubin(code)}, {}) if isinstance(code, bytes) else ({}, {key: list(code)})
    states = dict(stored["library"])
    if ptx:           # PTX is linked as it is: the LTO-IR it came with is not kept
        states["lto"] = False
    lib = CUDACodeLibrary._rebuild(codegen=None, llvm_strs=[], ptx_cache=ptx, cubin_cache=cubins,
                                   linkerinfo_cache={}, **states)
    return _Kernel._rebuild(codelibrary=lib, **stored["kernel"])


def _device_cc():
    from numba import cuda
    return tuple(cuda.get_current_device().compute_capability)


def _bind(k):
    k.bind()


def load(func, sig):
    """The prebuilt kernel of `func` for argument types `sig` on the current device, loaded onto it; None where
    no usable file holds it or the device refuses its code (then it is compiled as without the file)."""
    cc = _device_cc()
    target, kernels = _store(cc)
    key = kernel_key(func, sig)
    data = kernels.get(key)
    if data is None:
        if target:
            RECORD["missing"].append(f"{func.__qualname__} ({key.split('|')[0]})")
        return None
    try:
        k = kernel(data, cc)
        _bind(k)
    except Exception as e:       # numba and the driver raise several types; the kernel compiles instead
        RECORD["unusable"].append(f"{func.__qualname__}: {type(e).__name__}: {e}"[:200])
        return None
    RECORD["loaded"].append(func.__qualname__)
    return k


# --- building ---------------------------------------------------------------------------------------
def recorded(cache):
    """{key: payload} of every kernel in a numba cache folder written by this numba and numba-cuda, keyed as
    load() looks them up (kernels keyed by a launch configuration are left to the disk cache)."""
    import numba
    import numba_cuda
    out = {}
    for index in sorted(Path(cache).rglob("*.nbi")):
        try:
            with open(index, "rb") as f:
                if pickle.load(f) != numba.__version__:
                    continue
                _, overloads = pickle.loads(f.read())
        except Exception:       # a half-written or foreign index: its kernels are not recorded
            continue
        for key, name in overloads.items():
            if len(key) != 4 or key[2] != numba_cuda.__version__:
                continue
            try:
                out[_name(key[0], key[3])] = pickle.loads((index.parent / name).read_bytes())
            except Exception:
                continue
    return out


def _build_target(cache, out, target):
    """(kernels, bytes, failures) of out/<target>.kernels written from the kernels recorded in `cache`, added to
    those of the file there where it is usable (a build from a run that used some kernels keeps the others); a
    kernel the target cannot compile (e.g. an instruction its architecture lacks) is left out, named in failures."""
    kept, _ = read(Path(out) / (target + SUFFIX), target)
    entries, failed = dict(kept or {}), []
    for key, payload in recorded(cache).items():
        try:
            entries[key] = entry(payload, target)
        except Exception as e:      # NVVM and the linker raise several types; the rest of the file still serves
            failed.append(f"{payload.get('name', key)}: {type(e).__name__}: {str(e)[:120]}")
    path = Path(out) / (target + SUFFIX)
    write(path, target, entries)
    return len(entries), path.stat().st_size, failed


def build(cache, out, targets=tuple(TARGETS), jobs=1):
    """Write out/<target>.kernels for each target from the kernels recorded in `cache` ({target: (kernels,
    bytes, failures)}), `jobs` targets at a time in their own processes."""
    Path(out).mkdir(parents=True, exist_ok=True)
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            report = dict(zip(targets, pool.map(_build_target, *zip(*((cache, out, t) for t in targets)))))
    else:
        report = {target: _build_target(cache, out, target) for target in targets}
    _OPEN.clear()
    return report


def _build_options(parser):
    parser.add_argument("--cache", default=None, help="numba cache folder the kernels were recorded in "
                        "(default: this install's kernel cache for the current sources)")
    parser.add_argument("--out", default=None, help="folder to write (default: $MOSS_PREBUILT_KERNELS or the package's)")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--jobs", type=_count, default=min(len(TARGETS), os.cpu_count() or 1),
                        help="targets built at once")


def _count(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive count")
    return int(text)


def build_arguments(argv, prog, description):
    """The build options parsed; a usage error exits 2 with `prog`'s usage, before any work."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    _build_options(parser)
    return parser.parse_args(argv)


def run_build(args, prog, prepare=None):
    """Build the files from the recording (with none recorded, tell their state); 1 where --cache names no folder.
    `prepare`: called once the arguments are found good, before anything is read or built."""
    out = Path(args.out) if args.out else folder()
    if args.cache and not Path(args.cache).is_dir():
        print(f"{prog}: error: --cache {args.cache}: no such folder", file=sys.stderr)
        return 1
    if prepare is not None:
        prepare()
    from .core import CACHE_DIR
    cache = args.cache or CACHE_DIR
    if not cache or not recorded(cache):
        print(f"no kernels recorded in {cache} (a run on a GPU records every kernel it compiles): the prebuilt "
              f"files in {out} stay as they are", file=sys.stderr)
        return check(out)
    for target, (n, size, failed) in build(cache, out, args.targets, args.jobs).items():
        print(f"{out / (target + SUFFIX)}: {n} kernels, {size / 1e6:.3f} MB"
              + (f"; left out: {'; '.join(failed)}" if failed else ""))
    return 0


def check(out):
    """Each target file's state for this install, a line each."""
    for target in TARGETS:
        kernels, why = read(out / (target + SUFFIX), target)
        print(f"{target}: " + (f"{len(kernels)} kernels, usable" if kernels is not None else why))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m cuda_kernels.prebuilt", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    _build_options(sub.add_parser("build", help="compile every recorded kernel for each target"))
    c = sub.add_parser("check", help="each file's state for this install")
    c.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.what == "check":
        return check(Path(args.out) if args.out else folder())
    return run_build(args, "python -m cuda_kernels.prebuilt build")


if __name__ == "__main__":
    sys.exit(main())
