"""scripts/gpu_load.py's runs in the CUDA simulator on a --scale 64 random folder: every expected tensor goes
to the device under the 2-D bf16 rule (bytes counted): handed over at once (the product's uploader; in the
simulator the feeder, as the product's), tensor by tensor through the feeder, and through cuda.to_device; the
product's load (`early`) moves all but the encoder's embedding table."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moss_cli.checkpoint import expected_tensors, open_checkpoint

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")


def test_load_runs_move_every_expected_tensor(tmp_path):
    model = tmp_path / "model"
    made = subprocess.run([sys.executable, str(ROOT / "scripts/make_real_checkpoint.py"), str(model), "--scale", "64",
                           "--threads", "2"], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    out = tmp_path / "load.json"
    done = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "scripts/gpu_load.py"), str(model), "--out",
                           str(out), "--runs", "early,warm,feeder,baseline", "--staging-mb", "1", "--threads", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    ckpt = open_checkpoint(model)
    want = {}
    for name in ("text_encoder", "transformer", "vae"):
        shapes = expected_tensors(name, ckpt.config(name))
        want[name] = sum(int(np.prod(s)) * (2 if len(s) == 2 else 4) for s in shapes.values())
    runs = {r["mode"]: r for r in summary["runs"]}
    assert set(runs) == {"early", "warm", "feeder", "baseline"}
    early = runs.pop("early")            # the product's load: the encoder's embedding table stays on the host
    table = ckpt.component("text_encoder").tensors["embed_tokens.weight"]
    assert {n: c["bytes"] for n, c in early["components"].items()} == dict(want, text_encoder=want["text_encoder"]
                                                                            - table.size * 2)
    assert early["marks"]["preload_bytes"] == 0          # the simulator: the preload leaves it to the components
    for r in runs.values():
        assert {n: c["bytes"] for n, c in r["components"].items()} == want
        assert r["bytes"] == sum(want.values()) and r["since_process_start_s"] > r["upload_s"] > 0
    assert runs["warm"]["uploader"]["bytes"] == runs["feeder"]["uploader"]["bytes"] == sum(want.values())
    assert runs["baseline"]["uploader"]["bytes"] == 0
    assert summary["best_warm"]["staging_mb"] == 1


def test_evict_alone_empties_the_folders_weight_files_and_runs_nothing(monkeypatch, capsys):
    """`gpu_load.py MODEL --evict` (the picture step's cold process comes after it): the folder's weight files
    go to `evict`, and no load runs; the eviction itself is stood in for (it would empty this machine's cache)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_load
    finally:
        sys.path.pop(0)
    model = ROOT / "moss_cli" / "tiny"
    evicted = []
    monkeypatch.setattr(gpu_load, "evict", lambda files: evicted.append(files) or {"drop_caches": "ok", "evict_s": 0.0})
    monkeypatch.setattr(gpu_load, "run_child", lambda *args: pytest.fail("--evict ran a load"))
    gpu_load.main([str(model), "--evict"])
    assert evicted == [sorted(model.rglob("*.safetensors"))] and len(evicted[0]) == 4     # the transformer in two
    assert "still in the page cache" in capsys.readouterr().out
