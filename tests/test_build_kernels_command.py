"""moss-cli-build-kernels on a machine without a GPU: the upload lanes' host loop is compiled into numba's cache
(a later process loads it, nothing compiled), and with no kernels recorded the prebuilt files are left as they
are (none written) and their state is told."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LATER = """
import json
from moss_cli.memory import lanes as cuda_lanes
cuda_lanes.warm_without_gpu()
stats = cuda_lanes.run_lane.stats
print(json.dumps([sum(stats.cache_hits.values()), sum(stats.cache_misses.values())]))
"""


def test_the_host_loop_is_compiled_for_later_processes_and_no_recording_writes_no_files(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "cache"), MOSS_PREBUILT_KERNELS=str(tmp_path / "prebuilt"),
               PYTHONPATH=str(ROOT))
    built = subprocess.run([sys.executable, "-c", "from moss_cli.cli import build_kernels_command as c; c()"], env=env,
                           capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-2000:]
    assert "the upload lanes' loop is compiled" in built.stderr and "no kernels recorded" in built.stderr
    assert built.stdout.splitlines() == [f"{t}: absent" for t in ("sm_80", "sm_89", "sm_90a", "compute_90")]
    assert not (tmp_path / "prebuilt").exists()
    later = subprocess.run([sys.executable, "-c", LATER], env=env, capture_output=True, text=True, timeout=600)
    assert later.returncode == 0, later.stderr[-2000:]
    assert json.loads(later.stdout) == [1, 0]        # loaded from the cache, not compiled


def test_usage_errors_and_a_missing_cache_folder_are_told_before_any_work(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "cache"), MOSS_PREBUILT_KERNELS=str(tmp_path / "prebuilt"),
               PYTHONPATH=str(ROOT))
    run = lambda *args: subprocess.run([sys.executable, "-c", "from moss_cli.cli import build_kernels_command as c; c()",
                                        *args], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    bad = run("--jobs", "0")
    assert bad.returncode == 2 and "usage: moss-cli-build-kernels" in bad.stderr
    assert "loop is compiled" not in bad.stderr and not (tmp_path / "cache").exists()     # no work done
    missing = run("--cache", str(tmp_path / "nowhere"))
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines()[-1] == f"moss-cli-build-kernels: error: --cache {tmp_path / 'nowhere'}: no such folder"
    assert not (tmp_path / "prebuilt").exists()
