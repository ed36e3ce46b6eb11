"""Prebuilt kernels (cuda_kernels/prebuilt.py), without a GPU: a kernel recorded in the disk cache the way the
product records it is compiled for each target from its NVVM IR; a dispatcher then takes it from the file
(a cache hit, nothing compiled) with the code of the device's target; a corrupt, stale or foreign file is never
loaded (the kernel is compiled as without it) and a build writes it anew. (That the product's first process
runs on prebuilt kernels alone runs on a GPU: tests/gpu/test_prebuilt_gpu.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_kernels import prebuilt
from sim_util import COUNT_COMPILES, toolchain_present

ROOT = Path(__file__).resolve().parents[1]


def test_each_device_takes_its_own_cubins_else_binary_compatible_ones_else_ptx():
    assert prebuilt.targets_for((9, 0)) == ["sm_90a", "compute_90"]
    assert prebuilt.targets_for((8, 0)) == ["sm_80"]
    assert prebuilt.targets_for((8, 6)) == ["sm_80"]                 # sm_80 code runs on 8.6
    assert prebuilt.targets_for((8, 9)) == ["sm_89", "sm_80"]
    assert prebuilt.targets_for((10, 0)) == ["compute_90"]           # a newer GPU links the PTX at load
    assert prebuilt.targets_for((12, 0)) == ["compute_90"]
    assert prebuilt.targets_for((9, 2)) == ["compute_90"]            # sm_90a code runs on 9.0 only
    assert prebuilt.targets_for((7, 5)) == []


def test_a_file_is_read_back_only_for_its_target_sources_toolchain_and_bytes(tmp_path):
    tools = {"numba-cuda": "0.30.4", "numba": "0.68.1", "cuda": 13}
    path = tmp_path / "sm_90a.kernels"
    prebuilt.write(path, "sm_90a", {"k": b"entry"}, digest="a" * 64, tools=tools)
    assert prebuilt.read(path, "sm_90a", "a" * 64, tools) == ({"k": b"entry"}, None)
    assert prebuilt.read(path, "sm_80", "a" * 64, tools)[1].startswith("foreign: made for sm_90a")
    assert prebuilt.read(path, "sm_90a", "b" * 64, tools) == (None, "stale: made from other kernel sources")
    assert prebuilt.read(path, "sm_90a", "a" * 64, dict(tools, cuda=12))[1].startswith("foreign: made with")
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert prebuilt.read(path, "sm_90a", "a" * 64, tools) == (None, "corrupt: checksum mismatch")
    path.write_bytes(b"\x7fELF not ours")
    assert prebuilt.read(path, "sm_90a", "a" * 64, tools)[1].startswith("corrupt")
    assert prebuilt.read(tmp_path / "none.kernels", "sm_90a", "a" * 64, tools) == (None, "absent")


SCENARIO = r"""
import json, os, shutil, sys
from pathlib import Path
from numba.core import types as t
from cuda_kernels import core, elementwise, prebuilt, resources
# no GPU here: numba asks the device for its compute capability while compiling and keying; answer 9.0
resources._no_gpu_shim()
from numba.cuda import codegen, dispatcher
codegen.CUDACodeLibrary._ensure_cc = lambda self, cc: cc or (9, 0, "a")
codegen.JITCUDACodegen.magic_tuple = lambda self: ((13, 5), (9, 0))
""" + COUNT_COMPILES + r"""prebuilt._bind = lambda k: None          # loading a module onto a device needs one
from numba.cuda.core.caching import Cache     # and the disk cache's lookup refreshes the device's context first
dispatcher.CUDACache.load_overload = lambda self, sig, ctx: Cache._load_overload(self, sig, ctx)

work = Path(sys.argv[1])
out = {}
cast = elementwise._cast[False]
sig = (t.Array(t.float32, 1, "C"), t.Array(t.uint16, 1, "C"))
# record: a run of the product keeps the kernel in its disk cache, IR and all
cast._cache.save_overload(sig, dispatcher._Kernel(cast.py_func, sig, **cast.targetoptions))
out["recorded"] = len(prebuilt.recorded(core.CACHE_DIR))
report = prebuilt.build(core.CACHE_DIR, work / "prebuilt", ("sm_80", "sm_90a", "compute_90"))
out["built"] = {target: [n, failed] for target, (n, size, failed) in report.items()}
# each cubin file holds code for its own architecture, as nvdisasm reads it
import pickle, subprocess
out["arch"] = {}
for target in ("sm_80", "sm_90a"):
    kernels, _ = prebuilt.read(work / "prebuilt" / (target + ".kernels"), target)
    cubin = work / (target + ".cubin")
    cubin.write_bytes(pickle.loads(next(iter(kernels.values())))["code"])
    sass = subprocess.run([resources.nvdisasm(), str(cubin)], capture_output=True, text=True).stdout
    out["arch"][target] = [line.split()[-1] for line in sass.splitlines() if line.strip().startswith(".target")]
shutil.copytree(core.CACHE_DIR, work / "recording")
compiled.clear()

def fresh():
    d = type(cast)(cast.py_func, targetoptions=cast.targetoptions)
    prebuilt._OPEN.clear()
    for key in ("loaded", "missing", "unusable"):
        prebuilt.RECORD[key] = []
    return core._cached(d)

# a device of each kind takes its target's code; nothing is compiled
for cc in ((9, 0), (8, 6), (12, 0)):
    prebuilt._device_cc = lambda cc=cc: cc
    d = fresh()
    k = d.compile(sig)
    lib = k._codelibrary
    code = {str(key): (bytes(v.code)[:4].decode("latin1") if hasattr(v, "code") else v[0][:200])
            for key, v in list(lib._cubin_cache.items()) + list(lib._ptx_cache.items())}
    out[str(cc)] = {"hits": sum(d.stats.cache_hits.values()), "misses": sum(d.stats.cache_misses.values()),
                    "compiled": list(compiled), "file": prebuilt.RECORD["file"], "loaded": prebuilt.RECORD["loaded"],
                    "code": code, "entry": k.entry_name == lib._entry_name}

# a corrupt file: not loaded; the kernel is compiled (the disk cache emptied first so it must be)
prebuilt._device_cc = lambda: (9, 0)
os.remove(work / "prebuilt" / "compute_90.kernels")
for f in Path(core.CACHE_DIR).rglob("*.nb*"):
    f.unlink()
path = work / "prebuilt" / "sm_90a.kernels"
raw = bytearray(path.read_bytes()); raw[-5] ^= 1; path.write_bytes(bytes(raw))
compiled.clear()
d = fresh()
try:
    d.compile(sig)          # compiling goes on to load the module onto a device, which this machine lacks
except Exception as e:
    out["after_compile"] = f"{type(e).__name__}: {e}"[:300]
out["corrupt"] = {"rejected": prebuilt.RECORD["rejected"], "loaded": prebuilt.RECORD["loaded"], "error": out.get("after_compile"),
                  "compiled": list(compiled)}
# built anew, it is loaded again
prebuilt.build(work / "recording", work / "prebuilt", ("sm_90a",))
compiled.clear()
d = fresh()
d.compile(sig)
out["rebuilt"] = {"loaded": prebuilt.RECORD["loaded"], "compiled": list(compiled), "file": prebuilt.RECORD["file"]}
print(json.dumps(out))
"""


@pytest.mark.skipif(not toolchain_present(), reason="numba-cuda's cu13 extra (NVVM, NVRTC, nvJitLink) is not installed")
def test_prebuilt_kernels_are_loaded_instead_of_compiled_and_a_bad_file_is_rebuilt(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "cache"), MOSS_PREBUILT_KERNELS=str(tmp_path / "prebuilt"),
               PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCENARIO, str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["recorded"] == 1
    assert out["built"] == {"sm_80": [1, []], "sm_90a": [1, []], "compute_90": [1, []]}
    assert out["arch"] == {"sm_80": ["sm_80"], "sm_90a": ["sm_90a"]}
    for cc, target, key in (("(9, 0)", "sm_90a.kernels", "(9, 0, 'a')"), ("(8, 6)", "sm_80.kernels", "(8, 6, '')")):
        got = out[cc]
        assert (got["hits"], got["misses"], got["compiled"]) == (1, 0, []), got
        assert got["file"] == target and got["loaded"] == ["_make_cast.<locals>.cast_bf16"] and got["entry"]
        assert got["code"] == {key: "\x7fELF"}           # a cubin, keyed as numba keys the device's code
    newer = out["(12, 0)"]
    assert newer["file"] == "compute_90.kernels" and newer["compiled"] == []
    (key, ptx), = newer["code"].items()
    assert key == "(12, 0, 'a')" and ".target sm_90" in ptx and ".target sm_90a" not in ptx
    assert out["corrupt"]["rejected"].startswith("sm_90a.kernels: corrupt: checksum mismatch")
    assert out["corrupt"]["loaded"] == [], out
    assert out["corrupt"]["compiled"] == ["_make_cast.<locals>.cast_bf16"], out
    assert out["rebuilt"] == {"loaded": ["_make_cast.<locals>.cast_bf16"], "compiled": [], "file": "sm_90a.kernels"}


def test_the_shipped_files_are_current_for_the_pinned_toolchain():
    """The files in cuda_kernels/prebuilt/ were built from these kernel sources with the toolchain the GPU extra
    pins (numba-cuda, numba, CUDA major): a kernel edit without a rebuild fails here, not silently on a user's
    first call. Rebuild on a GPU: `bash scripts/gpu_run.sh kernels`, then commit cuda_kernels/prebuilt/."""
    if not toolchain_present():
        pytest.skip("numba-cuda's cu13 extra is not installed")
    states = {target: prebuilt.read(prebuilt.FOLDER / (target + prebuilt.SUFFIX), target)
              for target in prebuilt.TARGETS}
    why = {target: reason for target, (kernels, reason) in states.items() if kernels is None}
    assert not why, f"{why}: rebuild them on a GPU (bash scripts/gpu_run.sh kernels)"
    counts = {len(kernels) for kernels, _ in states.values()}
    assert len(counts) == 1 and counts.pop() > 0       # every target holds the same kernels
    # the check sees an edit: another sources digest makes the same files stale
    kernels, reason = prebuilt.read(prebuilt.FOLDER / "sm_90a.kernels", "sm_90a", digest="0" * 64)
    assert kernels is None and reason.startswith("stale")


def test_an_edit_of_a_kernel_module_changes_the_digest_and_one_of_the_tooling_does_not(tmp_path):
    import shutil
    for path in (ROOT / "cuda_kernels").glob("*.py"):
        shutil.copy(path, tmp_path / path.name)
    before = prebuilt.sources_digest(tmp_path)
    assert before == prebuilt.sources_digest()
    for name in prebuilt.TOOLING:              # the contract, the resource record and this loader
        (tmp_path / name).write_text((tmp_path / name).read_text() + "\n# edited\n")
    assert prebuilt.sources_digest(tmp_path) == before
    (tmp_path / "norms.py").write_text((tmp_path / "norms.py").read_text() + "\n# edited\n")
    assert prebuilt.sources_digest(tmp_path) != before


def test_a_build_adds_the_recorded_kernels_to_a_usable_file_and_replaces_a_bad_one(tmp_path, monkeypatch):
    """A build from a run that recorded some kernels keeps the others a usable file holds; an unusable file's
    are not kept."""
    path = tmp_path / "sm_90a.kernels"
    prebuilt.write(path, "sm_90a", {"old": b"old entry", "both": b"stale entry"})
    monkeypatch.setattr(prebuilt, "recorded", lambda cache: {"new": {}, "both": {}})
    monkeypatch.setattr(prebuilt, "entry", lambda payload, target: b"fresh entry")
    assert prebuilt._build_target("cache", tmp_path, "sm_90a")[0] == 3
    assert prebuilt.read(path, "sm_90a")[0] == {"old": b"old entry", "both": b"fresh entry", "new": b"fresh entry"}
    prebuilt.write(path, "sm_90a", {"old": b"old entry"}, digest="0" * 64)        # stale: nothing kept
    assert prebuilt._build_target("cache", tmp_path, "sm_90a")[0] == 2
    assert set(prebuilt.read(path, "sm_90a")[0]) == {"new", "both"}
