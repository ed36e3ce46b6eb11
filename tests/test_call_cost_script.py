"""scripts/gpu_call_cost.py on the CPU with the tiny checkpoint: every process timed from its spawn to its exit, the
command's parts (imports, checkpoint open, loads, encode, steps, decode, PNG) inside that span in their order,
the teardown after the command's return, and the medians per command, size and kernel cache."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_calls_time_is_split_into_its_parts(tmp_path):
    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_call_cost.py"), str(ROOT / "moss_cli" / "tiny"),
                           "--out", str(out), "--sizes", "64", "--runs", "1", "--steps", "2", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    d = json.loads(out.read_text())
    runs = d["runs"]
    assert [(r["command"], r["cache"]) for r in runs] == [("image", "first"), ("image", "warm"), ("encode", "warm"),
                                                          ("denoise", "warm"), ("decode", "warm")]
    for r in runs:
        assert r["exit_code"] == 0 and min(r["returned_s"], r["wall_s"], r["teardown_s"]) >= 0
        times = [t for t, _ in r["events"]]
        assert times == sorted(times) and r["events"][-1][1] == "command returned"
        assert r["calls"]["checkpoint open"] == 1 and "moss_cli" in r["imports"] and r["untimed"] == []
    image = runs[0]
    names = [name for _, name in image["events"]]
    for name in ("python started", "moss_cli imported", "cli imported", "step 1/2 done", "step 2/2 done",
                 "decoding 64x64"):
        assert name in names, names
    assert names.index("step 2/2 done") < names.index("decoding 64x64")
    assert {k: image["calls"][k] for k in ("encode", "denoise", "decode", "PNG", "encoder load", "transformer load",
                                           "decoder load")} == dict.fromkeys(("encode", "denoise", "decode", "PNG",
                                                                              "encoder load", "transformer load",
                                                                              "decoder load"), 1)
    assert min(image["seconds"][k] for k in ("encode", "denoise", "decode", "PNG")) >= 0
    assert set(d["medians"]) == {"image 64 first", "image 64 warm", "encode 64 warm", "denoise 64 warm",
                                 "decode 64 warm"}
    assert d["medians"]["image 64 warm"]["runs"] == 1 and d["medians"]["image 64 warm"]["wall_s"] == runs[1]["wall_s"]


def test_another_tree_runs_its_own_sources_and_no_first_leaves_out_the_first_processes(tmp_path):
    """--tree (an earlier revision measured in the same call): the processes import that folder's moss_cli, as each
    report says; --no-first: warm processes only (one untimed process fills their kernel folder)."""
    tree = tmp_path / "tree"
    for package in ("moss_cli", "cuda_kernels"):
        shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_call_cost.py"), str(ROOT / "moss_cli" / "tiny"),
                           "--out", str(out), "--sizes", "64", "--runs", "1", "--steps", "2", "--device", "cpu",
                           "--tree", str(tree), "--no-first", "--no-chain"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["tree"] == str(tree) and [(r["command"], r["cache"]) for r in d["runs"]] == [("image", "warm")]
    assert d["runs"][0]["from_tree"] is True
    (tree / "moss_cli").rename(tree / "elsewhere")      # the control: without the tree's package, not from it
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_call_cost.py"), str(ROOT / "moss_cli" / "tiny"),
                           "--out", str(out), "--sizes", "64", "--runs", "1", "--steps", "2", "--device", "cpu",
                           "--tree", str(tree), "--no-first", "--no-chain"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(out.read_text())["runs"][0]["from_tree"] is False
