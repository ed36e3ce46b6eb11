"""scripts/bench_tables.py turns a device run's raw outputs into BENCHMARKS.md's tables: checked on the raw
outputs of the one-call benchmark in results/h100 (at 2048 its decoder has no float64 decode), whose figures
the tables must carry."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "h100"
RUN = "c556c19"


def test_tables_carry_the_run_figures(tmp_path):
    for what in ("encoder_9b", "encoder_baseline_fla", "dit", "decoder", "load", "picture"):
        shutil.copy(RESULTS / f"{what}-{RUN}.json", tmp_path / f"{what}.json")
    out = tmp_path / "tables.md"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tables.py"), str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    for figure in ("7.63 ms", "63.6 ms", "8.34", "55.3 ms", "180.0 ms", "335.3 ms", "133.2 ms", "1.86", "0.0578",
                   "| 0.456 ms | 0.465 ms |  | 1.02", "89.9 ms, 0.033 % off", "242.0 ms", "| 24.7 ms | 1.01 |",
                   "472.2 ms, float64 out of memory", "| early |", "| 1.89 s |", "| cold |", "| 12.67 s |",
                   "the link's 54.5 GB/s", "| 0.44 s |", "1024x1024 #1", "8.29 s", "| 6.21 s |", "27.8 GB"):
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


def test_floors_are_the_runs_own_rates_applied_to_the_work():
    """Decoder: the floor as measured; loading: the bytes at the link run's rate (26.15 GB at 25 GB/s = 1.046 s);
    the picture: its denoise TFLOP at the DiT run's bf16 rate plus the decoder's floor (100 / 800 + 0.024 s)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_tables
    dec = {"fp16_product_tflops": 750.0, "sizes": {"1024x1024": {
        "ours_ms": 80.0, "torch_fp32_ms": 240.0, "torch_tf32_ms": 90.0, "floor_ms": 24.0,
        "ours_vs_float64": {"percent_off": 0.03}, "torch_fp32_vs_float64": {"percent_off": 0.02},
        "torch_tf32_vs_float64": {"percent_off": 6.0}}}}
    text = "\n".join(bench_tables.decoder(dec))
    assert "3 fp16 products at 750 TFLOP/s" in text and "| 24.0 ms | 1.12 |" in text
    runs = {"runs": [{"mode": "link", "gb": 1.07, "copy_s": 0.0428, "gb_per_s": 25.0},
                     {"mode": "warm", "how": "lanes", "since_process_start_s": 2.4, "gb": 26.15, "gb_per_s": 17.7}]}
    text = "\n".join(bench_tables.load(runs))
    assert "the link's 25.0 GB/s" in text and "| 1.05 s |" in text and "| link |" not in text
    pic = {"start_to_loaded_s": 2.3, "device_memory_in_use_GB": 27.7, "pictures": [
        {"size": 1024, "repeat": 1, "encode_s": 0.02, "denoise_s": 8.4, "decode_s": 0.09, "picture_s": 8.5,
         "denoise_tflop": 100.0}]}
    text = "\n".join(bench_tables.picture(pic, {"bf16_product_tflops": 800.0, "sizes": {}}, dec))
    assert "| 0.15 s |" in text
    # a run without the rates leaves the floor empty rather than guessing it
    assert "| 0.15 s |" not in "\n".join(bench_tables.picture(pic, None, dec))


def _dit_with_compile():
    """A DiT run with torch.compile beside eager: at 512 reduce-overhead wins and is ahead of ours, at 1024 the
    default mode wins and ours is ahead, at 2048 reduce-overhead failed to compile."""
    return {"torch": "2.11.0", "text_tokens": 300,
            "torch_compile": {"torch": "2.11.0", "triton": "3.5.0", "backend": "inductor",
                              "modes": ["default", "reduce-overhead"], "dynamic": False},
            "sizes": {
                "512": {"ours_ms": 60.0, "torch_bf16_ms": 100.0, "floor_ms": 40.0, "torch_compile_best": "reduce-overhead",
                        "torch_compile_ms": 55.0, "torch_compile": {
                            "default": {"ms": 70.0, "compile_s": 13.5}, "reduce-overhead": {"ms": 55.0, "compile_s": 20.25}}},
                "1024": {"ours_ms": 181.5, "torch_bf16_ms": 333.0, "floor_ms": 142.9, "torch_compile_best": "default",
                         "torch_compile_ms": 185.5, "torch_compile": {
                             "default": {"ms": 185.5, "compile_s": 13.5}, "reduce-overhead": {"ms": 186.0, "compile_s": 16.0}}},
                "2048": {"ours_ms": 700.0, "torch_bf16_ms": 1300.0, "floor_ms": 600.0, "torch_compile_best": "default",
                         "torch_compile_ms": 760.0, "torch_compile": {
                             "default": {"ms": 760.0, "compile_s": 30.0},
                             "reduce-overhead": {"error": "OutOfMemoryError: CUDA out of memory"}}}}}


def test_the_dit_table_names_torch_compile_and_its_best_mode_beside_eager():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_tables
    text = "\n".join(bench_tables.dit(_dit_with_compile()))
    assert "torch.compile (inductor, torch 2.11.0, triton 3.5.0), best mode | that / ours |" in text
    # eager's ratio, then the best compiled mode and its ratio (185.5 / 181.5 = 1.02; 55 / 60 = 0.92)
    assert "| step with CFG, 1024x1024 | 181.5 ms | 333.0 ms | 142.9 ms | 1.83 | 185.5 ms (default) | 1.02 |" in text
    assert "| step with CFG, 512x512 | 60.0 ms | 100.0 ms | 40.0 ms | 1.67 | 55.0 ms (reduce-overhead) | 0.92 |" in text
    # every mode with its compile time; the failed one says why
    assert "| 512x512 | reduce-overhead (best) | 55.0 ms | 20.2 s | 0.92 |" in text
    assert "| 1024x1024 | reduce-overhead | 186.0 ms | 16.0 s | 1.02 |" in text
    assert "| 2048x2048 | reduce-overhead | OutOfMemoryError: CUDA out of memory |  |  |" in text
    # said plainly where ours is not ahead, and only there
    assert "At 512x512 ours is behind torch.compile (reduce-overhead): 60.0 ms a step against 55.0 ms." in text
    assert "At 1024x1024 ours is behind" not in text and "At 2048x2048 ours is behind" not in text
    assert text.count("### ") == 1


def test_a_run_without_torch_compile_keeps_the_eager_table():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_tables
    run = _dit_with_compile()
    del run["torch_compile"]
    for s in run["sizes"].values():
        for key in ("torch_compile", "torch_compile_ms", "torch_compile_best"):
            del s[key]
    text = "\n".join(bench_tables.dit(run))
    assert "torch.compile" not in text and "behind" not in text
    assert "| step with CFG, 1024x1024 | 181.5 ms | 333.0 ms | 142.9 ms | 1.83 |" in text


def test_the_call_cost_table_has_a_row_per_command_and_cache_and_the_chain_against_one_call():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_tables
    part = {"runs": 3, "imports_s": 1.2, "teardown_s": 0.05, "checkpoint open": 0.1, "encode": 0.02}
    cost = {"medians": {
        "image 1024 first": dict(part, wall_s=12.5, **{"kernels: prebuilt lookups": 0.4, "denoise": 9.2}),
        "image 1024 warm": dict(part, wall_s=11.0, denoise=9.1),
        "decode 1024 warm": dict(part, wall_s=4.25),
        "encode 1024 warm": dict(part, wall_s=3.5),
        "denoise 1024 warm": dict(part, wall_s=12.0)}}
    text = "\n".join(bench_tables.call_cost(cost))
    rows = [line for line in text.splitlines() if line.startswith("| moss-")]
    assert [r.split(" | ")[:2] for r in rows] == [["| moss-image 1024x1024", "first"], ["| moss-image 1024x1024", "warm"],
                                                 ["| moss-encode 1024x1024", "warm"], ["| moss-denoise 1024x1024", "warm"],
                                                 ["| moss-decode 1024x1024", "warm"]]
    assert rows[0].startswith("| moss-image 1024x1024 | first | 3 | 12.50 s | 1.20 s | 0.10 s |  |  | 0.40 s |")
    assert rows[0].endswith("| 0.02 s | 9.20 s |  |  | 0.05 s |")
    assert "Chained at 1024x1024: 3.50 + 12.00 + 4.25 = 19.75 s, against 11.00 s in one call." in text
    assert text.startswith("### One call, from the command to its exit\n")
    assert "\n".join(bench_tables.call_cost(cost, "call_cost_no_prebuilt")).startswith(
        "### One call, from the command to its exit (call_cost_no_prebuilt)\n")


def test_the_budget_table_reads_gpu_budget_rows():
    from bench_tables import budget
    rows = [{"run": "warm-up", "budget_GB": "all", "seconds": 40.0, "peak_GB": 28.0, "plan": "", "equal_to_resident": False},
            {"run": "all", "budget_GB": "all", "seconds": 14.0, "peak_GB": 28.5,
             "plan": "memory plan: 79.1 GB (free GPU memory), all resident: encoder resident, DiT resident, peak 28.6 GB",
             "equal_to_resident": True},
            {"run": "8", "budget_GB": "8", "seconds": 28.0, "peak_GB": 7.9, "plan": "memory plan: 7.5 GB (free GPU "
             "memory), layers streamed", "equal_to_resident": True, "streamed_GB": 700.0, "stream_floor_s": 14.0,
             "chain": {"encode": {"seconds": 5.0, "peak_GB": 7.0, "plan": ""}, "equal_to_resident": True}}]
    lines = budget({"link_GBps": 50.0, "steps": 50, "rows": rows})
    assert lines[0] == "Host to device (pinned 1 GiB): 50.0 GB/s; 50 steps at 1024x1024."
    assert lines[4] == ("| everything free | 79.1 GB (free GPU memory), all resident: encoder resident, DiT resident, "
                        "peak 28.6 GB | 14.00 s | 1.00 | 28.5 GB |  | yes |")
    assert lines[5] == ("| 8 | 7.5 GB (free GPU memory), layers streamed | 28.00 s | 2.00 | 7.9 GB | 700.0 GB (14.00 s) "
                        "| yes |")
    assert "moss-encode 5.00 s (peak 7.0 GB)" in lines[-1] and "equals" in lines[-1]


def test_the_decoder_and_vae_encoder_tables_name_torch_compile_of_the_tf32_statement():
    """With torch.compile timed: its best mode and ratio as two more columns, a failed mode leaving its cells empty,
    and a plain sentence where it beat ours; without it the tables keep their columns."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_tables
    head = {"torch_compile": {"torch": "2.11.0", "triton": "3.5.0", "backend": "inductor"}}
    dec = dict(head, fp16_product_tflops=730.0, sizes={
        "512x512": {"ours_ms": 21.9, "torch_fp32_ms": 60.1, "torch_tf32_ms": 22.5, "floor_ms": 5.8,
                    "torch_compile": {"default": {"ms": 20.0, "compile_s": 30.0}},
                    "torch_compile_best": "default", "torch_compile_ms": 20.0},
        "1024x1024": {"ours_ms": 89.9, "torch_fp32_ms": 242.0, "torch_tf32_ms": 90.7, "floor_ms": 24.7,
                      "torch_compile": {"default": {"error": "OutOfMemoryError"}}}})
    text = "\n".join(bench_tables.decoder(dec))
    assert "torch.compile (inductor, torch 2.11.0, triton 3.5.0) of the TF32 statement, best mode | that / ours |" in text
    assert "| 20.0 ms (default) | 0.91 |" in text                  # 20.0 / 21.9
    assert text.count("\n| decode, 1024x1024") == 1 and "| 1.01 |  |  |" in text
    assert "At 512x512 ours is behind torch.compile (default): 21.9 ms a decode against 20.0 ms." in text
    assert "1024x1024 ours is behind" not in text
    venc = dict(head, sizes={"1024x1024": {
        "ours_ms": 69.5, "diffusers_fp32_ms": 186.2, "diffusers_tf32_ms": 72.1, "ours_vs_float64": {"rel_l2": 3.9e-6},
        "diffusers_fp32_vs_float64": {"rel_l2": 2.6e-6}, "diffusers_tf32_vs_float64": {"rel_l2": 9.9e-4},
        "torch_compile": {"default": {"ms": 75.0, "compile_s": 20.0}}, "torch_compile_best": "default",
        "torch_compile_ms": 75.0}})
    text = "\n".join(bench_tables.vae_encoder(venc))
    assert "| encode, 1024x1024 | 69.5 ms (3.9e-06) | 186.2 ms (2.6e-06) | 72.1 ms (0.00099) | 1.04 | 75.0 ms (default) | 1.08 |" in text
    assert "behind" not in text
    for d in (dec, venc):                    # without torch.compile: the columns as before
        del d["torch_compile"]
        for s in d["sizes"].values():
            for key in ("torch_compile", "torch_compile_best", "torch_compile_ms"):
                s.pop(key, None)
    assert "torch.compile" not in "\n".join(bench_tables.decoder(dec) + bench_tables.vae_encoder(venc))


def test_the_encoder_table_takes_torch_compile_from_the_baseline_runs():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_tables
    ours = {"speed": {"100": {"ours_into_pinned_ms": 7.63, "transformers_bf16_ms": 63.6}}}
    plain = {"torch_compile": {"torch": "2.11.0", "triton": "3.5.0", "backend": "inductor"}, "speed": {"100": {
        "ours_into_pinned_ms": 7.7, "transformers_bf16_ms": 63.0, "torch_compile_best": "default",
        "torch_compile_ms": 30.8, "torch_compile": {"default": {"ms": 30.8, "compile_s": 60.0}}}}}
    text = "\n".join(bench_tables.encoder(ours, None, plain))
    assert "of transformers (torch fallbacks), best mode | that / ours |" in text
    assert "| 30.8 ms (default) | 4.00 |" in text          # 30.8 / 7.7, the ratio within that process
    assert "torch.compile" not in "\n".join(bench_tables.encoder(ours, None, None))
