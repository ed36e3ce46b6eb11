"""scripts/bench_tables.py turns a device run's raw outputs into BENCHMARKS.md's tables: checked on the raw
outputs of the one-call benchmark in results/h100 (at 2048 its decoder has no float64 decode), whose figures
the tables must carry."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "h100"
RUN = "91eb408"


def test_tables_carry_the_run_figures(tmp_path):
    for what in ("encoder_9b", "encoder_baseline_fla", "dit", "decoder", "load", "picture"):
        shutil.copy(RESULTS / f"{what}-{RUN}.json", tmp_path / f"{what}.json")
    out = tmp_path / "tables.md"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tables.py"), str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    for figure in ("7.87 ms", "58.0 ms", "1.82", "185.8 ms", "340.6 ms", "135.7 ms", "1.83", "0.0578",
                   "| 0.470 ms | 0.480 ms |  | 1.02", "90.4 ms, 0.033 % off", "241.6 ms",
                   "485.7 ms, float64 out of memory", "| cold |", "| 18.83 s |", "1024x1024 #1", "8.42 s", "27.7 GB"):
        assert figure in text, figure
    assert text.count("### ") == 5


def test_the_second_encoder_baseline_only_where_it_bound_flash_linear_attention(tmp_path):
    """A baseline run whose transformers fell back to torch (the package missing) is not shown as fla's."""
    shutil.copy(RESULTS / f"encoder_9b-{RUN}.json", tmp_path / "encoder_9b.json")
    shutil.copy(RESULTS / f"encoder_baseline_torch-{RUN}.json", tmp_path / "encoder_baseline_fla.json")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tables.py"), str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "### Encoder" in done.stdout and "flash-linear-attention" not in done.stdout


def test_a_missing_output_leaves_its_table_out(tmp_path):
    shutil.copy(RESULTS / f"dit-{RUN}.json", tmp_path / "dit.json")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tables.py"), str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("### ") == 1 and "### DiT" in done.stdout


def test_the_picture_line_splits_the_memory_where_the_run_reported_it():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_tables
    run = {"start_to_loaded_s": 3.0, "device_memory_in_use_GB": 31.04, "device_memory_after_load_GB": 26.61,
           "pool_GB": 4.374, "pictures": []}
    assert "31.0 GB of device memory in use (after the load 26.6 GB, the shared pool 4.37 GB)" in \
        "\n".join(bench_tables.picture(run))
    del run["pool_GB"], run["device_memory_after_load_GB"]
    assert "31.0 GB of device memory in use." in "\n".join(bench_tables.picture(run))
