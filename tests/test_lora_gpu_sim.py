"""The GPU's LoRA merge (moss_cli/gpu/lora_merge.py, cuda_kernels/lora.py) in the numba CUDA simulator, against the
host merge (lora.merge) byte for byte: three adapters (kohya LoRA with ComfyUI's fused q/k/v rows and bf16 factors,
peft with float32 factors, LyCORIS LoKr) at scales 0.7, -0.4 and 1 over resident matrices, the rows of a stacked
q/k/v and a streamed layer's pinned host arena; then switched to another set and to none (every weight back to its
base bits). The simulator has no cuBLAS: its product is numpy's float32 one, as lora.py states it, so here the two
merges must agree in every bit (on a GPU cuBLAS's summation order may move a counted few by one ulp:
tests/gpu/test_lora_gpu.py). Planted controls: the scale and alpha ignored, the sum truncated to bf16 instead of
rounded, a fused layer's rows taken from its first part, each changes the merged bits."""

from sim_util import simulated_lines

SCRIPT = r'''
import sys
import tempfile
from pathlib import Path
import ml_dtypes
import numpy as np
from cuda_kernels import lora as kernels
from moss_cli import lora, safetensors_io
from moss_cli.gpu import lora_merge as cuda_lora
from moss_cli.ops.cuda.table import CudaOps
from moss_cli.gpu.capture import make_window
from moss_cli.memory.host_weights import stored_form

sys.path.insert(0, "tests")
import held_weights

BF16 = ml_dtypes.bfloat16
rng = np.random.default_rng(0)
tensors = {"time_embedding.2.weight": (rng.standard_normal((24, 16)) * 0.1).astype(BF16)}
names = ["time_embedding.2.weight"]
for i in range(3):
    p = f"layers.{i}."
    tensors[p + "norm2.weight"] = rng.standard_normal(16).astype(np.float32)
    for n, shape in (("q", (16, 16)), ("k", (16, 16)), ("v", (16, 16)), ("o", (16, 16)), ("ffn_up_gate", (32, 16)),
                     ("ffn_down", (16, 32))):
        tensors[p + f"proj.{n}.weight"] = (rng.standard_normal(shape) * 0.1).astype(BF16)
    names += [tuple(p + f"proj.{n}.weight" for n in "qkv"), p + "norm2.weight", p + "proj.o.weight",
              p + "proj.ffn_up_gate.weight", p + "proj.ffn_down.weight"]
shapes = {"transformer": {k: v.shape for k, v in tensors.items()}}
matrices = [k for k, v in tensors.items() if v.ndim == 2]
folder = Path(tempfile.mkdtemp())


def save(name, entries):
    safetensors_io.save(folder / name, entries)
    return folder / name


def factor(*shape, dtype=BF16):
    return (rng.standard_normal(shape) * 0.3).astype(dtype)


kohya = {"lora_unet_layers_1_proj_qkv.lora_down.weight": factor(4, 16),    # ComfyUI's fused q/k/v: one delta
         "lora_unet_layers_1_proj_qkv.lora_up.weight": factor(48, 4),      # for the rows of three weights
         "lora_unet_layers_1_proj_qkv.alpha": np.array(3.0, np.float32)}
for k in matrices:
    if ".proj.q." not in k and ".proj.k." not in k and ".proj.v." not in k:
        stem = "lora_unet_" + k[:-len(".weight")].replace(".", "_")
        kohya.update({stem + ".lora_down.weight": factor(4, tensors[k].shape[1]),
                      stem + ".lora_up.weight": factor(tensors[k].shape[0], 4),
                      stem + ".alpha": np.array(3.0, np.float32)})
peft = {}
for k in ("layers.0.proj.q.weight", "layers.2.proj.ffn_up_gate.weight", "layers.2.proj.v.weight"):
    stem = "transformer." + k[:-len(".weight")]
    peft.update({stem + ".lora_A.weight": factor(2, 16, dtype=np.float32),
                 stem + ".lora_B.weight": factor(tensors[k].shape[0], 2, dtype=np.float32)})
lokr = {"lycoris_layers_2_proj_o.lokr_w1": factor(4, 4, dtype=np.float32),
        "lycoris_layers_2_proj_o.lokr_w2": factor(4, 4, dtype=np.float32),
        "lycoris_time_embedding_2.lokr_w1": factor(6, 4, dtype=np.float32),
        "lycoris_time_embedding_2.lokr_w2_a": factor(4, 2, dtype=np.float32),
        "lycoris_time_embedding_2.lokr_w2_b": factor(2, 4, dtype=np.float32),
        "lycoris_time_embedding_2.alpha": np.array(1.0, np.float32)}
files = [save("kohya.safetensors", kohya), save("peft.safetensors", peft), save("lokr.safetensors", lokr)]
A, B, C = (lora.read(f, s, shapes) for f, s in zip(files, (0.7, -0.4, 1.0)))
B2 = lora.read(files[1], 0.5, shapes)


def device_bits(ops):
    return held_weights.device_bits(ops, tensors, names)


def host_bits(adapters):
    merged = lora.merge("transformer", tensors, adapters)
    return {k: stored_form(merged[k]) for k in matrices}


def differing(got, want):
    return sum(int(np.count_nonzero(got[k] != want[k])) for k in matrices)


def fresh():
    ops = CudaOps()
    ops.window = make_window(tensors, names, (2,))        # block 2's matrices stay in pinned host memory
    ops.preload(tensors, names)
    return ops


ops = fresh()
print("streamed", sorted(k for k in ops.window.layout if not isinstance(k, tuple)))
count, _ = cuda_lora.apply(ops, tensors, names, "transformer", (), (A, B, C))
want = host_bits((A, B, C))
print("merged", count, "weights; differing elements", differing(device_bits(ops), want),
      "changed from base", differing(want, host_bits(())) > 0)
count, _ = cuda_lora.apply(ops, tensors, names, "transformer", (A, B, C), (B2,))
print("switched", count, "weights; differing elements", differing(device_bits(ops), host_bits((B2,))))
count, _ = cuda_lora.apply(ops, tensors, names, "transformer", (B2,), ())
print("none", count, "weights; differing elements", differing(device_bits(ops), host_bits(())))

cuda_lora.CHUNK = 40                                       # a weight merged two rows of 16 at a time
ops = fresh()
cuda_lora.apply(ops, tensors, names, "transformer", (), (A, B, C))
print("in chunks, differing elements", differing(device_bits(ops), want))
cuda_lora.CHUNK = 1 << 24


def planted(name, patch):
    saved = {k: getattr(mod, k) for mod, k, _ in patch}
    for mod, k, v in patch:
        setattr(mod, k, v)
    try:
        ops = fresh()
        cuda_lora.apply(ops, tensors, names, "transformer", (), (A, B, C))
        print("planted", name, "differing elements", differing(device_bits(ops), want) > 0)
    finally:
        for mod, k, _ in patch:
            setattr(mod, k, saved[k])


product, merge, rows = kernels.product, kernels.merge, lora.Layer.rows
planted("alpha ignored", [(kernels, "product", lambda up, down, out, alpha, stream=0: product(up, down, out, 1.0))])
planted("truncated", [(kernels, "merge", lambda *a, **k: merge(*a, control=True))])
planted("first rows", [(lora.Layer, "rows", lambda self, i: slice(0, self.target.rows[i]))])
'''


def test_the_gpu_merge_equals_the_host_merge_bit_for_bit_and_the_planted_controls_are_caught():
    lines = simulated_lines(SCRIPT, timeout=600)
    assert lines == [
        "streamed ['layers.2.proj.ffn_down.weight', 'layers.2.proj.ffn_up_gate.weight', 'layers.2.proj.o.weight']",
        "merged 15 weights; differing elements 0 changed from base True",
        "switched 15 weights; differing elements 0",
        "none 3 weights; differing elements 0",
        "in chunks, differing elements 0",
        "planted alpha ignored differing elements True",
        "planted truncated differing elements True",
        "planted first rows differing elements True"]
