"""scripts/bench_tables.py turns a device run's raw outputs into BENCHMARKS.md's tables: checked on the raw
outputs in results/h200, whose figures the tables must carry."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "h200"


def test_tables_carry_the_run_figures(tmp_path):
    for src, name in (("encoder_9b-11c18d1-1.json", "encoder_9b.json"), ("dit-2ec4951.json", "dit.json"),
                      ("decoder-55fa271.json", "decoder.json"), ("load-a63d93f.json", "load.json"),
                      ("picture-6e43fa0.json", "picture.json")):
        shutil.copy(RESULTS / src, tmp_path / name)
    out = tmp_path / "tables.md"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tables.py"), str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    for figure in ("5.77 ms", "192.2 ms", "301.0 ms", "134.4 ms", "1.57", "0.0578", "217.3 ms, 0.221 % off",
                   "240.2 ms", "3.72 s", "1024x1024 #0", "14.37 s", "28.2 GB"):
        assert figure in text, figure
    assert text.count("### ") == 5


def test_a_missing_output_leaves_its_table_out(tmp_path):
    shutil.copy(RESULTS / "dit-2ec4951.json", tmp_path / "dit.json")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tables.py"), str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("### ") == 1 and "### DiT" in done.stdout
