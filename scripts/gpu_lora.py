"""LoRA on the GPU at the real size, on a random real-size folder (scripts/make_real_checkpoint.py): a random adapter
of rank --rank (kohya keys, bf16 factors) on every linear of the DiT, then

  merge_s     merging it into the resident DiT on the GPU (moss_cli/gpu/lora_merge.py), the base weights uploaded
              and landed first: the factors sent, each weight's delta a cuBLAS product, the merge kernel (target:
              under a second)
  remerge_s   the switch a server makes to another set (the same adapter at scale 0.5): every touched weight sent
              again from the memory-mapped base, then merged; unmerge_s: back to the base model alone
  accuracy    the GPU merge against the host merge (lora.merge_one) on a sample of weights: elements differing,
              the largest difference in bf16 ulps
  step_ms     denoising steps with CFG at --size with a 300-token text, without and with the adapter merged
              (the same captured graphs), the median of --steps steps
  server      moss-server's engine (the encoder, the DiT and the decoder loaded, warmed) switching between the
              adapter and the base model between requests: each switch's seconds and each request's
Writes JSON.

    python scripts/gpu_lora.py MODEL_DIR --out lora.json [--rank 64] [--steps 8] [--size 1024] [--no-server]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from moss_cli import lora, safetensors_io
from moss_cli.checkpoint import open_checkpoint

SAMPLE = ("time_embedding.2.weight", "text_embedder.blocks.0.qkv.weight", "layers.0.proj.q.weight",
          "layers.0.proj.ffn_up_gate.weight", "layers.20.proj.v.weight", "layers.41.proj.ffn_down.weight")
TEXT = 300
TARGET_S = 1.0


def make_adapter(ckpt, rank, path, seed=0):
    """A kohya adapter of RANK on every 2-D weight of the DiT (bf16 factors, alpha = rank); returns its key count."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in ckpt.shapes()["transformer"].items():
        if len(shape) != 2:
            continue
        rows, cols = shape
        stem = "lora_unet_" + name[:-len(".weight")].replace(".", "_")
        tensors[stem + ".lora_up.weight"] = (rng.standard_normal((rows, rank), np.float32) * 0.01).astype(
            ml_dtypes.bfloat16)
        tensors[stem + ".lora_down.weight"] = (rng.standard_normal((rank, cols), np.float32) * 0.01).astype(
            ml_dtypes.bfloat16)
        tensors[stem + ".alpha"] = np.array(float(rank), np.float32)
    safetensors_io.save(path, tensors)
    return len(tensors) // 3


def landed(dit):
    """Every weight of the DiT on the device (the uploads done)."""
    from numba import cuda
    from moss_cli.memory.upload import uploader
    for name in dit.model.weight_names():
        dit.ops.params(dit.model.tensors, name) if isinstance(name, tuple) else dit.ops.param(dit.model.tensors, name)
    uploader().finish()
    cuda.synchronize()


def ulps(a, b):
    ia, ib = (np.asarray(x).view(np.int16).astype(np.int32) for x in (a, b))
    ia, ib = (np.where(i < 0, -32768 - i, i) for i in (ia, ib))
    return np.abs(ia - ib)


def accuracy(dit, tensors, adapters):
    """Per sampled weight: elements, elements differing from the host merge, the largest difference in ulps."""
    from moss_cli.memory.host_weights import stored_form
    uses = lora.uses(adapters, "transformer")
    out = {}
    for name in SAMPLE:
        if name not in uses:
            continue
        stack = next((n for n in dit.model.weight_names() if isinstance(n, tuple) and name in n), None)
        if stack is None:
            got = dit.ops.param(tensors, name).copy_to_host()
        else:
            weight = dit.ops.params(tensors, stack).weight.copy_to_host()
            row = sum(tensors[n].shape[0] for n in stack[:stack.index(name)])
            got = weight[row:row + tensors[name].shape[0]]
        d = ulps(got, stored_form(lora.merge_one(tensors[name], uses[name])))
        out[name] = {"elements": int(d.size), "differ": int(np.count_nonzero(d)), "worst_ulps": int(d.max())}
    return out


def step_ms(dit, rows, size, steps):
    """The median ms of `steps` CFG steps at size x size (the graphs captured by a 2-step run first)."""
    from moss_cli.schedule import sigmas as schedule_sigmas
    dit.forget_texts()           # the refiner's weights may have changed
    cond = dit.prepare_text(rows)
    uncond = dit.prepare_text(rows[:TEXT // 3])
    h = w = size // 16
    noise = np.random.default_rng(1).standard_normal((1, dit.config["latent_channels"], h, w)).astype(np.float32)
    dit.sample(noise, schedule_sigmas(2, shift=5.0), cond, uncond, 3.0, skip_layers=(22,))
    dit.sample(noise, schedule_sigmas(steps, shift=5.0), cond, uncond, 3.0, skip_layers=(22,))
    return statistics.median(dit.timings["step_ms"])


def server(model, file, size, steps):
    """The engine switching between the adapter FILE and the base model, in a process of its own as moss-server
    runs (the weights preloaded before the kernel library): per request its set, switch and picture seconds."""
    from moss_cli.server.engine import Engine
    ckpt = open_checkpoint(model)
    engine = Engine(ckpt, device="cuda", adapters={"random": ckpt.read_adapters([(file, 1.0)])[0]}).start()
    engine.loaded.wait()
    if engine.state != "ready":
        raise engine.error
    out = []
    try:
        for lora_field in ([], [("random", 1.0)], [], [("random", 0.5)], [("random", 1.0)]):
            began = time.perf_counter()
            request = engine.submit(engine.request("a red fox in the snow", seed=1, lora=lora_field, steps=steps,
                                                   width=size, height=size))
            request.future.result()
            seconds = time.perf_counter() - began
            out.append({"lora": lora_field, "switch_s": engine.switch_s, "request_s": seconds})
            print(f"server request with lora {lora_field}: switch {engine.switch_s} s, request {seconds:.2f} s")
            engine.switch_s = None
    finally:
        engine.close()
        engine.join()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--no-server", action="store_true", help="leave out the server's switches")
    ap.add_argument("--server-part", type=Path, help=argparse.SUPPRESS)     # the adapter file: the server alone
    args = ap.parse_args()
    if args.server_part:
        Path(args.out).write_text(json.dumps(server(args.model, args.server_part, args.size, 4), indent=1))
        return
    from moss_cli.gpu import lora_merge as cuda_lora
    from moss_cli.gpu.denoiser import CudaDenoiser
    from moss_cli.gpu.capture import release
    ckpt = open_checkpoint(args.model)
    out = {"rank": args.rank, "size": args.size, "target_s": TARGET_S}
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "random.safetensors"
        began = time.perf_counter()
        out["layers"] = make_adapter(ckpt, args.rank, file)
        out["adapter_bytes"] = file.stat().st_size
        adapter = ckpt.read_adapters([(file, 1.0)])[0]
        out["adapter_made_s"] = time.perf_counter() - began
        print(f"adapter: rank {args.rank} on {out['layers']} DiT weights, {out['adapter_bytes'] / 1e6:.0f} MB, "
              f"made in {out['adapter_made_s']:.1f} s")

        comp = ckpt.base_component("transformer")
        dit = CudaDenoiser(comp.tensors, comp.config)
        dit.upload()
        landed(dit)
        names = dit.model.weight_names()
        rows = np.random.default_rng(2).standard_normal((TEXT, comp.config["text_dim"])).astype(np.float32)
        out["step_ms_base"] = step_ms(dit, rows, args.size, args.steps)
        count, out["merge_s"] = cuda_lora.apply(dit.ops, comp.tensors, names, "transformer", (), (adapter,))
        out["merged_weights"] = count
        print(f"merge: {count} weights in {out['merge_s']:.3f} s (target under {TARGET_S} s)")
        out["accuracy"] = accuracy(dit, comp.tensors, (adapter,))
        for name, a in out["accuracy"].items():
            print(f"  {name}: {a['differ']} of {a['elements']} differ from the host merge, "
                  f"at most {a['worst_ulps']} ulp")
        out["step_ms_lora"] = step_ms(dit, rows, args.size, args.steps)
        print(f"step at {args.size}: {out['step_ms_base']:.1f} ms without, {out['step_ms_lora']:.1f} ms with "
              "the adapter")
        half = ckpt.read_adapters([(file, 0.5)])[0]
        _, out["remerge_s"] = cuda_lora.apply(dit.ops, comp.tensors, names, "transformer", (adapter,), (half,))
        _, out["unmerge_s"] = cuda_lora.apply(dit.ops, comp.tensors, names, "transformer", (half,), ())
        print(f"switch to scale 0.5: {out['remerge_s']:.3f} s; back to the base: {out['unmerge_s']:.3f} s")
        release(dit)
        if not args.no_server:
            part = Path(tmp) / "server.json"
            subprocess.run([sys.executable, __file__, args.model, "--out", str(part), "--size", str(args.size),
                            "--server-part", str(file)], check=True)
            out["server"] = json.loads(part.read_text())
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
