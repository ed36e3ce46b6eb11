"""scripts/gpu_picture.py, the device call's whole-picture benchmark, run on the CPU with the tiny checkpoint:
its flow is the product's (its first picture equals, byte for byte, the PNG `moss-image` makes with the same
prompt, seed and options), and its report and host profile are written as the device step reads them."""

import importlib.util
import json
import pstats
import subprocess
import sys
from pathlib import Path

from cli_util import run

ROOT = Path(__file__).resolve().parents[1]


def test_the_script_makes_moss_images_picture_and_writes_its_report_and_profile(tmp_path):
    out = tmp_path / "run" / "picture.json"          # a folder that does not exist yet
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_picture.py"), str(ROOT / "moss_cli" / "tiny"),
                           "--device", "cpu", "--sizes", "64", "--steps", "2", "--out", str(out),
                           "--host-profile", str(tmp_path / "run" / "profile.txt")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(p["size"], p["repeat"]) for p in report["pictures"]] == [(64, 0), (64, 1)]
    assert set(report["load_parts_s"]) == {"encoder", "transformer", "decoder"}
    # the start-up figures the device step reads are there (their values are timings: benchmarks, not tests)
    assert all(isinstance(report[k], float) for k in ("start_to_made_s", "start_to_loaded_s", "start_to_first_step_s"))
    # each picture's text lengths and its denoise's products (the picture floor's FLOPs), from the ENC it made
    first = report["pictures"][0]
    assert len(first["text_tokens"]) == 2 and min(first["text_tokens"]) >= 1 and first["denoise_tflop"] > 0
    gil = report["gil_probe_to_first_step"]
    assert set(gil) == {"wakeups", "late_5ms", "late_5ms_s", "latest_ms"} and gil["wakeups"] > 0, gil

    spec = importlib.util.spec_from_file_location("gpu_picture", ROOT / "scripts" / "gpu_picture.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    image = tmp_path / "fox.png"
    made = run("moss-image", "--prompt", script.PROMPT, "--negative", "", "--seed", "42", "--width", "64", "--height", "64",
               "--steps", "2", "--guidance", "3", "--device", "cpu", "--quiet", "--picture", image)
    assert made.code == 0, made.stderr
    assert (out.parent / "picture-64.png").read_bytes() == image.read_bytes()

    text = (tmp_path / "run" / "profile.txt").read_text()
    assert "Ordered by: cumulative time" in text and "Ordered by: internal time" in text
    stats = pstats.Stats(str(tmp_path / "run" / "profile.prof"))
    assert any(name == "run" for (_, _, name) in stats.stats)    # the script's own run() was profiled
