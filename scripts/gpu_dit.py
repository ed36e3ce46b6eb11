"""The 5B MOSS DiT on the GPU at the real size, random weights made on the GPU: accuracy and speed.

Accuracy: one CFG step's guided velocity at 1024x1024 with a 300-token context (both prompts), relative L2
error against a float64 statement of the same step (torch, on the GPU), for ours and for the baseline.
Speed: ms per denoising step with CFG (both passes, block 22 skipped on the negative one) at 512, 1024 and
2048, ours (graph replays) vs the baseline vs the floor (the step's FLOPs at the bf16 product rate measured
in this run); host time per step; attention alone vs torch's SDPA backends; memory.

The baseline is a torch eager statement of the official bf16 chain (scripts/reference/dit.py's Statement in
bf16: every op in bf16 as denoiser.md's rounding contract says, F.scaled_dot_product_attention with torch's
default backend choice), and the same statement under torch.compile (inductor, each of --compile-modes compiled
afresh per size with static shapes, its compile time reported; the fastest mode is the best baseline); the same
statement in float64 is the reference. It is checked against moss_cli's float64 numpy graph on the
tiny checkpoint first (printed), so it is the model and not a copy of our kernels.

    python scripts/gpu_dit.py --out dit.json
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from numba import cuda

from cuda_kernels import sdpa
from cuda_kernels.core import DeviceView
from cuda_kernels.layout import random_bf16
from moss_cli.gpu.denoiser import CudaDenoiser
from moss_cli.ops.cuda.table import CudaOps, numba_stream
from moss_cli.gpu.capture import capture
from moss_cli.schedule import sigmas as schedule_sigmas, timesteps
from moss_cli.transformer import DEFAULTS, expected_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floors import step_flops  # noqa: E402
from reference.dit import Statement as TorchDit, random_vector  # noqa: E402
from torch_timing import (COMPILE_MODES, best_mode, compile_description, compiled_ms, cuda_spans,  # noqa: E402
                          kernel_table, matmul_tflops, median_ms, table_lines)

TEXT = 300
SKIP = (22,)


def check_statement(out):
    """The torch statement in float64 against moss_cli's float64 numpy graph, on the tiny checkpoint."""
    from moss_cli.checkpoint import open_checkpoint
    from moss_cli.ops import numpy_ops
    from moss_cli.transformer import MossTransformer
    comp = open_checkpoint().component("transformer")
    weights = {k: torch.as_tensor(np.asarray(comp.tensors[k], dtype=np.float64)) for k in expected_tensors(comp.config)}
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((9, 32)).astype(np.float32)
    lat = rng.standard_normal((1, 128, 4, 6)).astype(np.float32)
    ours = MossTransformer(numpy_ops(np.float64), comp.tensors, comp.config)
    want = ours.velocity(lat, 700.0, ours.prepare_text(rows), SKIP)
    st = TorchDit(weights, {**DEFAULTS, **comp.config}, torch.float64)
    mod, head = st.conditioning(700.0, "cpu")
    got = st.velocity(torch.as_tensor(lat, dtype=torch.float64), mod, head, st.text(torch.as_tensor(rows)), SKIP)
    err = float(np.linalg.norm(got.double().numpy() - want) / np.linalg.norm(want))
    out["statement_vs_moss_cli_float64"] = err
    print(f"torch statement vs moss_cli float64 numpy graph (tiny checkpoint): relative error {err:.3g}")
    assert err < 1e-10


# --- weights --------------------------------------------------------------------------------
def make_weights(cfg, seed=0):
    """Numba device arrays: 2-D bf16 bits N(0, 0.02) made on the GPU; 1-D float32 of realistic scale."""
    rng = np.random.default_rng(seed)
    ours, theirs = {}, {}
    for i, (name, shape) in enumerate(expected_tensors(cfg).items()):
        if len(shape) == 2:
            arr = cuda.device_array(shape, np.uint16)
            random_bf16(arr.reshape(arr.size), seed * 100003 + i, 0.02)
            ours[name] = arr
            theirs[name] = torch.as_tensor(arr.view(np.int16), device="cuda").view(torch.bfloat16)
        else:
            v = random_vector(name, shape, rng.standard_normal)
            v = torch.as_tensor(v, dtype=torch.float32).to(torch.bfloat16)       # the checkpoint's bf16
            ours[name] = v.float().numpy()
            theirs[name] = v.cuda()
    cuda.synchronize()
    return ours, theirs


def profile_step(dit, cond, uncond):
    """Kernels of two 1024x1024 CFG steps (graph replays) under CUPTI: ms per name and step, the idle gaps."""
    noise = np.zeros((1, 128, 64, 64), np.float32)
    sig = schedule_sigmas(3, shift=5.0)
    dit.sample(noise, sig[:3], cond, uncond, 3.0, SKIP, 0.01, 1.0)
    table = kernel_table(cuda_spans(lambda: dit.sample(noise, sig[:3], cond, uncond, 3.0, SKIP, 0.0, 1.0)), repeats=2)
    print(f"profile of two 1024 steps, per step: span {table['span_ms']:.1f} ms, kernels busy {table['busy_ms']:.1f} "
          f"ms; longest idle gaps (ms, after, before): {table['idle_gaps_ms']}")
    print("\n".join(table_lines(table)[:25]))
    return table


def accuracy(out, dit, theirs_w, cfg, rows, cond, uncond):
    """One CFG step at 1024x1024 (step 0 of a 50-step schedule: the negative pass runs every block) against the
    float64 statement, ours and torch bf16 eager; returns the bf16 statement and its text for the timings."""
    h = w = 1024 // 16
    noise = torch.randn(1, 128, h, w, device="cuda")
    sig = schedule_sigmas(50, shift=5.0)
    t, dt = float(timesteps(sig)[0]), float(np.float32(sig[1]) - np.float32(sig[0]))
    got = []
    dit.sample(noise.cpu().numpy(), sig[:2], cond, uncond, 3.0, SKIP, 0.01, 1.0,
               on_step=lambda i, s, x, v: got.append(v), arrays=True)
    v_ours = torch.as_tensor(got[0], device="cuda", dtype=torch.float64)
    with torch.no_grad():
        ref = TorchDit(theirs_w, cfg, torch.float64)
        _, v_ref = ref.step(noise.double(), t, dt, ref.text(rows[0].double()), ref.text(rows[1].double()), 3.0, ())
        base = TorchDit(theirs_w, cfg, torch.bfloat16)
        tb = (base.text(rows[0]), base.text(rows[1]))
        _, v_base = base.step(noise, t, dt, tb[0], tb[1], 3.0, ())
    del ref
    rel = lambda a: float(torch.linalg.norm(a.double() - v_ref) / torch.linalg.norm(v_ref))
    out["accuracy_1024"] = {"ours_rel_l2": rel(v_ours), "torch_bf16_rel_l2": rel(v_base)}
    print(f"velocity of one CFG step at 1024x1024 vs float64: ours {rel(v_ours):.3g}, torch bf16 eager {rel(v_base):.3g}",
          flush=True)
    return base, tb


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per size (ours)")
    ap.add_argument("--profile", action="store_true", help="GPU time per kernel name over one 1024 step")
    ap.add_argument("--compile-modes", nargs="*", default=list(COMPILE_MODES),
                    help="torch.compile modes timed beside eager (none: eager only), e.g. max-autotune-no-cudagraphs")
    ap.add_argument("--speed-only", action="store_true",
                    help="the step times alone (ours, eager, torch.compile): no float64 velocity, 50-step "
                         "trajectory, kernel variants or attention alone")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "text_tokens": TEXT}
    if args.compile_modes:
        out["torch_compile"] = compile_description(args.compile_modes)
    check_statement(out)
    cfg = dict(DEFAULTS)
    torch.manual_seed(0)
    free0, _ = cuda.current_context().get_memory_info()
    ours_w, theirs_w = make_weights(cfg)
    dit = CudaDenoiser(ours_w, cfg)
    t0 = time.perf_counter()
    dit.upload()
    out["upload_s"] = time.perf_counter() - t0
    rows = [torch.randn(TEXT, cfg["text_dim"], device="cuda") for _ in range(2)]
    cond, uncond = (dit.prepare_text(r.cpu().numpy()) for r in rows)
    print("weights made and uploaded", flush=True)

    if args.speed_only:
        with torch.no_grad():
            base = TorchDit(theirs_w, cfg, torch.bfloat16)
            tb = (base.text(rows[0]), base.text(rows[1]))
    else:
        base, tb = accuracy(out, dit, theirs_w, cfg, rows, cond, uncond)
    torch.cuda.empty_cache()

    rate = matmul_tflops(4396, 3072, 16384, torch.bfloat16)     # the up/gate product at 1024x1024
    out["bf16_product_tflops"] = rate
    out["sizes"] = {}
    for size in args.sizes:
        h = w = size // 16
        noise = np.random.default_rng(size).standard_normal((1, 128, h, w)).astype(np.float32)
        sig = schedule_sigmas(args.steps + 1, shift=5.0)
        dit.sample(noise, sig[:3], cond, uncond, 3.0, SKIP, 0.01, 1.0)      # captures both kinds
        dit.sample(noise, sig, cond, uncond, 3.0, SKIP, 0.01, 1.0)
        tm = dict(dit.timings)
        ours_ms = tm["gpu_s"] / tm["steps"] * 1e3
        trajectory_ms = []
        if size == 1024 and not args.speed_only:     # a whole trajectory's steps, each timed: does a step slow down under sustained load?
            dit.sample(noise, schedule_sigmas(50, shift=5.0), cond, uncond, 3.0, SKIP, 0.01, 1.0)
            trajectory_ms = dit.timings["step_ms"]
        # the same trajectory with a progress callback (the product's path), and single steps on an idle GPU
        dit.sample(noise, sig, cond, uncond, 3.0, SKIP, 0.01, 1.0, on_step=lambda *a: None)
        progress_ms = dit.timings["gpu_s"] / dit.timings["steps"] * 1e3
        single = []
        for _ in range(5):
            dit.sample(noise, sig[:2], cond, uncond, 3.0, SKIP, 0.01, 1.0)
            single.append(dit.timings["gpu_s"] * 1e3)
        x = torch.as_tensor(noise, device="cuda")
        with torch.no_grad():
            base_ms = median_ms(lambda: base.step(x, 900.0, -0.01, tb[0], tb[1], 3.0, SKIP), 3, warm=1)
            compiled = compiled_ms(lambda: base.step(x, 900.0, -0.01, tb[0], tb[1], 3.0, SKIP), 5,
                                   args.compile_modes, static=list(base.P.values())) if args.compile_modes else {}
        best = best_mode(compiled)
        if compiled:        # ours again after the compiled runs: a drift of the clock over them shows here
            dit.sample(noise, sig, cond, uncond, 3.0, SKIP, 0.01, 1.0)
            ours_after_ms = dit.timings["gpu_s"] / dit.timings["steps"] * 1e3
        flops = step_flops(cfg, h * w, TEXT, 2 * cfg["num_layers"] - len(SKIP))
        floor_ms = flops / (rate * 1e12) * 1e3
        row = {"ours_ms": ours_ms, "ours_50_step_ms": trajectory_ms, "ours_with_progress_ms": progress_ms,
               "ours_single_step_ms": statistics.median(single),
               "host_ms_per_step": tm["launch_s"] * 1e3, "torch_bf16_ms": base_ms,
               "floor_ms": floor_ms, "ratio": base_ms / ours_ms, "step_tflop": flops / 1e12}
        if compiled:
            row.update(torch_compile=compiled, ours_after_compile_ms=ours_after_ms)
        if best:
            row.update(torch_compile_best=best, torch_compile_ms=compiled[best]["ms"],
                       ratio_vs_compile=compiled[best]["ms"] / ours_ms)
        out["sizes"][str(size)] = row
        if size == 1024 and not args.speed_only:     # variants beside the default, then the default again (the clock drifts with heat)
            for name, attrs in (("qk_words4", {"qk_width": 2}), ("qk_group1", {"qk_group": 1}), ("again", {})):
                for key, value in attrs.items():
                    setattr(dit.ops, key, value)
                dit._graphs.clear()
                dit.sample(noise, sig[:3], cond, uncond, 3.0, SKIP, 0.01, 1.0)
                dit.sample(noise, sig, cond, uncond, 3.0, SKIP, 0.01, 1.0)
                row[f"ours_{name}_ms"] = dit.timings["gpu_s"] / dit.timings["steps"] * 1e3
                for key in attrs:
                    setattr(dit.ops, key, None)
                print(f"1024x1024 {name} {attrs}: {row[f'ours_{name}_ms']:.1f} ms/step", flush=True)
            dit._graphs.clear()
        if trajectory_ms:
            print(f"{size}x{size}: 50 steps, ms each: first 5 {[round(t, 1) for t in trajectory_ms[:5]]}, last 5 "
                  f"{[round(t, 1) for t in trajectory_ms[-5:]]}", flush=True)
        print(f"{size}x{size}: ours {ours_ms:.1f} ms/step (with progress {progress_ms:.1f}, one step alone "
              f"{row['ours_single_step_ms']:.1f}, host {row['host_ms_per_step']:.2f}), torch bf16 eager "
              f"{base_ms:.1f}, floor {floor_ms:.1f}, ratio {row['ratio']:.2f}x", flush=True)
        for mode, c in compiled.items():
            print(f"{size}x{size}: torch.compile {mode}: " + (f"{c['ms']:.1f} ms/step (compiled in {c['compile_s']:.1f} s), "
                  f"that / ours {c['ms'] / ours_ms:.2f}x" if "ms" in c else c["error"]), flush=True)
        if compiled:
            print(f"{size}x{size}: ours after the compiled runs {ours_after_ms:.1f} ms/step", flush=True)
        if size == 1024:
            free1, _ = cuda.current_context().get_memory_info()
            ours_bytes = sum(a.nbytes for a in dit.ops._params.values() if hasattr(a, "nbytes")) + \
                sum(s.weight.nbytes for s in dit.ops._params.values() if hasattr(s, "sizes"))
            out["memory_1024"] = {"ours_weights_GB": ours_bytes / 1e9, "ours_pool_GB": dit.ops.pool_bytes / 1e9,
                                  "device_used_delta_GB": (free0 - free1) / 1e9,
                                  "torch_peak_allocated_GB": torch.cuda.max_memory_allocated() / 1e9}
            print("memory at 1024:", out["memory_1024"], flush=True)
        with open(args.out, "w") as fh:      # after each size: a run its step limit cuts keeps the sizes it finished
            json.dump(out, fh, indent=1)

    if args.profile:
        out["profile_1024"] = profile_step(dit, cond, uncond)

    # attention alone at N = 4096 + 300
    n, H, D = 4096 + TEXT, cfg["num_heads"], cfg["dim"] // cfg["num_heads"]
    qkv = torch.randn(n, 3, H, D, device="cuda", dtype=torch.bfloat16)
    o = torch.empty(n, H, D, device="cuda", dtype=torch.bfloat16)
    def as_nb(t_):
        bits = t_.view(torch.int16)
        return cuda.as_cuda_array(DeviceView(bits, bits.shape, [2 * s_ for s_ in bits.stride()], "<u2"))
    qn, kn, vn, on = as_nb(qkv[:, 0]), as_nb(qkv[:, 1]), as_nb(qkv[:, 2]), as_nb(o)
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    ours_att = median_ms(lambda: [sdpa.attention(qn, kn, vn, on, D ** -0.5, stream=stream) for _ in range(10)], 5) / 10
    ops = CudaOps()        # ten calls captured in a CUDA graph, as the DiT's step graph runs them
    graph, gstream, _ = capture(ops, lambda: [sdpa.attention(qn, kn, vn, on, D ** -0.5, stream=ops.stream)
                                              for _ in range(10)])
    queue = numba_stream(gstream)
    graph.launch(gstream)
    queue.synchronize()
    a, b = cuda.event(), cuda.event()
    a.record(queue)
    for _ in range(20):
        graph.launch(gstream)
    b.record(queue)
    b.synchronize()
    ours_graph = cuda.event_elapsed_time(a, b) / 200
    try:        # every plan cuDNN ranks for this geometry, each timed alone (index 0 is ours)
        plans = [[name, ms] for name, ms in sdpa.plan_times(qn, kn, vn, on, D ** -0.5, stream)]
    except Exception as e:
        plans = f"{type(e).__name__}: {e}"[:200]
    q, k, v = (qkv[:, i].transpose(0, 1)[None] for i in range(3))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {}
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                backends[name] = median_ms(lambda: [F.scaled_dot_product_attention(q, k, v) for _ in range(10)], 5) / 10
        except RuntimeError as e:
            backends[name] = f"unavailable: {e}"[:120]
    best = min(t_ for t_ in backends.values() if isinstance(t_, float))
    # the same three again in alternation (ours eager, torch's fastest, ours in the graph; 11 rounds of 10 calls
    # each): a clock or power drift over the measurement then falls on both sides alike
    fastest = min((be for be in backends if isinstance(backends[be], float)), key=backends.get)
    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}[fastest]
    rounds = {"ours_eager": [], "torch_" + fastest: [], "ours_graph": []}
    for _ in range(11):
        rounds["ours_eager"].append(median_ms(
            lambda: [sdpa.attention(qn, kn, vn, on, D ** -0.5, stream=stream) for _ in range(10)], 1, warm=1) / 10)
        with sdpa_kernel([chosen]):
            rounds["torch_" + fastest].append(median_ms(
                lambda: [F.scaled_dot_product_attention(q, k, v) for _ in range(10)], 1, warm=1) / 10)
        a.record(queue)
        graph.launch(gstream)
        b.record(queue)
        b.synchronize()
        rounds["ours_graph"].append(cuda.event_elapsed_time(a, b) / 10)
    alternating = {key: float(np.median(ms)) for key, ms in rounds.items()}
    alternating["ratio_graph_vs_torch"] = alternating["torch_" + fastest] / alternating["ours_graph"]
    alternating["ratio_eager_vs_torch"] = alternating["torch_" + fastest] / alternating["ours_eager"]
    out["attention_4396"] = {"ours_cudnn_frontend_eager_ms": ours_att, "ours_cudnn_frontend_graph_ms": ours_graph,
                             "cudnn_plans_ms": plans,
                             "torch": backends, "ratio_vs_best_torch_eager": best / ours_att,
                             "ratio_graph_vs_best_torch": best / ours_graph, "alternating_medians_ms": alternating}
    print(f"attention N={n}: ours {ours_att:.3f} ms eager, {ours_graph:.3f} ms in a graph; torch {backends}; "
          f"alternating {alternating}", flush=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
