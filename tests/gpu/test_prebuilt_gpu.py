"""On a GPU: the kernels a moss-image run on the tiny checkpoint recorded, built into prebuilt files for this
device's targets, serve a later process with an empty disk cache: it compiles nothing, loads every kernel from
the files and writes the same PNG. A stale or corrupt file is not loaded (every kernel is compiled, the PNG is
the same) and a build makes it usable again."""

import json
import os
import subprocess
import sys

import pytest

import cuda_kernels
from sim_util import COUNT_COMPILES

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")

IMAGE = ["--prompt", "a red fox", "--seed", "7", "--steps", "3", "--device", "cuda", "--quiet"]

# moss-image in this process, then what the prebuilt loader did and how many kernels numba compiled
PROBE = """
import json, sys
from numba.cuda import dispatcher
""" + COUNT_COMPILES + """import os
from moss_cli.cli import image_command
from cuda_kernels import prebuilt
leave = os._exit
def report_and_leave(code):          # the command ends its process itself: report first
    print(json.dumps({"compiled": len(compiled), "names": sorted(set(compiled)), "file": prebuilt.RECORD["file"],
                      "rejected": prebuilt.RECORD["rejected"], "loaded": len(prebuilt.RECORD["loaded"]),
                      "missing": prebuilt.RECORD["missing"], "unusable": prebuilt.RECORD["unusable"]}), flush=True)
    leave(code)
os._exit = report_and_leave
sys.argv[0] = "moss-image"
image_command()
"""


def _image(tmp_path, cache, store, png):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / cache), MOSS_PREBUILT_KERNELS=str(tmp_path / store))
    r = subprocess.run([sys.executable, "-c", PROBE, *IMAGE, "--picture", str(tmp_path / png)], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _build(tmp_path, targets):
    r = subprocess.run([sys.executable, "-m", "cuda_kernels.prebuilt", "build", "--cache", str(tmp_path / "record"),
                        "--out", str(tmp_path / "prebuilt"), "--targets", *targets], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)


def test_a_fresh_process_runs_on_prebuilt_kernels_alone(tmp_path):
    from numba import cuda
    from cuda_kernels import prebuilt
    targets = prebuilt.targets_for(tuple(cuda.get_current_device().compute_capability))
    recording = _image(tmp_path, "record", "none", "recorded.png")
    assert recording["compiled"] > 0 and recording["loaded"] == 0
    _build(tmp_path, targets[:1])
    first = _image(tmp_path, "empty", "prebuilt", "prebuilt.png")
    print(recording, first)
    assert first["file"] == targets[0] + prebuilt.SUFFIX
    assert (first["compiled"], first["missing"], first["unusable"]) == (0, [], []), first["names"]
    assert first["loaded"] >= recording["compiled"]     # a kernel the recording loaded from its own cache is loaded too
    assert (tmp_path / "prebuilt.png").read_bytes() == (tmp_path / "recorded.png").read_bytes()

    path = tmp_path / "prebuilt" / (targets[0] + prebuilt.SUFFIX)
    kernels, why = prebuilt.read(path, targets[0])
    assert why is None
    prebuilt.write(path, targets[0], kernels, digest="0" * 64)          # made from other sources
    stale = _image(tmp_path, "empty-stale", "prebuilt", "stale.png")
    assert stale["rejected"].startswith(f"{targets[0]}{prebuilt.SUFFIX}: stale") and stale["loaded"] == 0
    assert stale["compiled"] == recording["compiled"]
    assert (tmp_path / "stale.png").read_bytes() == (tmp_path / "recorded.png").read_bytes()

    _build(tmp_path, targets[:1])
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))
    corrupt = _image(tmp_path, "empty-corrupt", "prebuilt", "corrupt.png")
    assert "corrupt" in corrupt["rejected"] and corrupt["loaded"] == 0 and corrupt["compiled"] == recording["compiled"]
    _build(tmp_path, targets[:1])
    again = _image(tmp_path, "empty-again", "prebuilt", "again.png")
    assert again["compiled"] == 0 and again["loaded"] == first["loaded"]
    assert (tmp_path / "again.png").read_bytes() == (tmp_path / "recorded.png").read_bytes()


def test_every_target_builds_from_the_recording(tmp_path):
    """sm_80, sm_89, sm_90a cubins and compute_90 PTX of every kernel the tiny run recorded, none left out."""
    from cuda_kernels import prebuilt
    recording = _image(tmp_path, "record", "none", "recorded.png")
    report = prebuilt.build(tmp_path / "record", tmp_path / "prebuilt", jobs=4)
    print({t: (n, size) for t, (n, size, _) in report.items()})
    assert {t: (n, failed) for t, (n, size, failed) in report.items()} == \
        {t: (recording["compiled"], []) for t in prebuilt.TARGETS}
