"""The device memory the shared pool holds at real sizes, worked out on the CPU from the op sequence.

    python scripts/pool_plan.py [--sizes 1024 512] [--out FILE]

Runs the GPU op table in the numba CUDA simulator with every kernel launch and product skipped, the weights
shapes without values, and the simulator's chunk constants set to the device's, so the ops ask the pool
(moss_cli/memory/pool.py) for exactly what they ask on the GPU, in the same order.

* The decoder (the small config, widths 96/192/384/384): after each size in turn, the pool as the product
  leaves it (each size's eager pass recorded, its blocks planned, the capture's requests lent the planned
  blocks), with best fit alone, and with blocks only of the exact size asked, beside the most lent at once.
* The whole picture as `moss-image --device cuda` runs it from the real-size folder's configs (the 9B
  encoder, the 42-block DiT, the decoder; a short prompt and the empty negative, 50 steps, guidance 3, block
  22 skipped): the weights each component keeps on the device, and the planned pool after each stage, for
  each size in turn.

No GPU needed; values are not computed (seconds).
"""

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402
from numba.cuda.simulator import kernel as sim_kernel  # noqa: E402

from cuda_kernels import conv  # noqa: E402
from moss_cli.gpu import encoder as gpu_encoder  # noqa: E402
from moss_cli.ops.cuda import table as cuda_table  # noqa: E402
from moss_cli.memory.pool import Pool  # noqa: E402



class RecordingPool(Pool):
    """The best-fit pool, also counting what a pool of exact sizes would hold for the same leases."""

    def __init__(self):
        super().__init__(lambda n: np.empty(n, np.uint8))    # host blocks never touched: the kernels are skipped
        self.alive = Counter()       # leases alive now, by size
        self.peak = Counter()        # the most alive at once, by size: the exact-size pool's blocks
        self.asked = {}              # block order -> the size its lease asked for
        self.live = self.live_peak = 0   # bytes asked by the leases alive now, and the most at once

    def take(self, nbytes):
        block = super().take(nbytes)
        n = max(1, int(nbytes))
        self.alive[n] += 1
        self.peak[n] = max(self.peak[n], self.alive[n])
        self.asked[block.order] = n
        self.live += n
        self.live_peak = max(self.live_peak, self.live)
        return block

    def give(self, block):
        n = self.asked.pop(block.order, None)      # None: a block the plan made, put free unlent
        if n is not None:
            self.alive[n] -= 1
            self.live -= n
        super().give(block)

    @property
    def exact_bytes(self):
        return sum(n * k for n, k in self.peak.items())


def plan(sizes):
    """Per size in turn: the best-fit pool after one decode each, and the pool as the product leaves it (each
    size's eager pass recorded and planned, then the capture's requests lent the planned blocks)."""
    from gpu_decoder import SMALL, random_tensors
    from moss_cli.gpu.decoder import CudaDecoder

    skip_work()
    tensors = random_tensors(SMALL)
    pools = {"best_fit": RecordingPool(), "planned": RecordingPool()}
    decoders = {}
    for name, pool in pools.items():
        cuda_table._POOL[:] = [pool]
        decoders[name] = CudaDecoder(tensors, SMALL, graphs=False)
    rows = []
    for size in sizes:
        latents = np.zeros((1, 128, size // 16, size // 16), np.float32)
        for name, pool in pools.items():
            cuda_table._POOL[:] = [pool]
            if name == "planned":
                pool.record()
            decoders[name].decode(latents)
            if name == "planned":
                pool.script(pool.plan())
                decoders[name].decode(latents)
                pool.script(None)
        best, planned = pools["best_fit"], pools["planned"]
        rows.append({"size": size, "best_fit_GB": best.bytes / 1e9, "planned_GB": planned.bytes / 1e9,
                     "planned_misses": planned.misses, "exact_size_GB": best.exact_bytes / 1e9,
                     "live_peak_GB": best.live_peak / 1e9})
        print(f"after the {size}x{size} decode: planned {planned.bytes / 1e9:.2f} GB ({planned.misses} takes off "
              f"the plan), best fit alone {best.bytes / 1e9:.2f} GB, exact sizes {best.exact_bytes / 1e9:.2f} GB; "
              f"at most {best.live_peak / 1e9:.2f} GB lent at once", flush=True)
    return rows


def _shapes_only():
    """Weights as shapes: the op table's uploads become zero-strided host arrays of the shape it would make."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    from moss_cli.ops.cuda.table import CudaOps, Stacked

    def fake(shape, dtype):
        return FakeCUDAArray(np.broadcast_to(np.zeros((), dtype), tuple(shape)))

    def param(self, tensors, name, later=False):
        shape = tensors[name].shape
        return self._params.setdefault((id(tensors), name), fake(shape, np.uint16 if len(shape) == 2 else np.float32))

    def params(self, tensors, names, later=False):
        sizes = [tensors[n].shape[0] for n in names]
        key = (id(tensors), tuple(names))
        return self._params.setdefault(key, Stacked(fake((sum(sizes), tensors[names[0]].shape[1]), np.uint16), sizes))

    CudaOps.param, CudaOps.params = param, params


def skip_work():
    """Every kernel launch, product and attention call a no-op; the device's chunk constants."""
    from cuda_kernels import core, sdpa
    conv.COLUMN_BYTES, conv.GN_PARTS = conv.DEVICE_COLUMN_BYTES, conv.DEVICE_GN_PARTS
    conv.TAP_BYTES = conv.DEVICE_TAP_BYTES
    core.TEAM_MAX, core.TEAM_PER_MAX = core.BLOCK, 256      # the DiT's rows of 3072 fit a simulated team
    sim_kernel.FakeCUDAKernel.__getitem__ = lambda self, config: (lambda *args: None)
    conv.half_product = lambda a, w, d, stream=0: None
    conv.tap_product = lambda image, w, d, span, stream=0, origin=0: None

    class NoBlas:
        def linear(self, *args, **kwargs):
            pass
    cuda_table.blas = lambda: NoBlas()
    sdpa.supports = lambda *args: True          # the device's attention: cuDNN, its workspace outside the pool
    sdpa.attention = lambda *args, **kwargs: None


def _device_bytes(ops):
    """Bytes of the distinct device arrays an op table keeps in its params (weights, stacks, split weights)."""
    seen = {}

    def add(v):
        if isinstance(v, (tuple, list)):
            for x in v:
                add(x)
        elif hasattr(v, "weight") and hasattr(v, "sizes"):
            add(v.weight)
        elif hasattr(v, "__cuda_array_interface__") or type(v).__name__ == "FakeCUDAArray":
            seen[id(v)] = int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
    for value in ops._params.values():
        add(value)
    return sum(seen.values())


def picture(sizes, steps=50):
    """The planned pool after each stage of `moss-image --device cuda` at each size in turn (GB)."""
    from make_real_checkpoint import configs
    from moss_cli.checkpoint import expected_tensors
    from moss_cli.gpu.decoder import CudaDecoder
    from moss_cli.gpu.denoiser import CudaDenoiser
    from moss_cli.schedule import sigmas
    from moss_cli.stages import DEFAULT_SKIP_LAYERS, DEFAULT_SKIP_START, DEFAULT_SKIP_STOP

    skip_work()
    _shapes_only()
    pool = RecordingPool()
    cuda_table._POOL[:] = [pool]
    cfg = configs(1)
    tensors = {name: {k: np.broadcast_to(np.zeros((), np.float32), shape) for k, shape in
                      expected_tensors(name, cfg[name]).items()} for name in cfg}

    def planned(eager):
        """What planned_capture does around a capture, the capture's ops run eagerly."""
        pool.record()
        eager()
        pool.script(pool.plan())
        eager()
        pool.script(None)

    rows = []

    def mark(stage):
        rows.append({"stage": stage, "pool_GB": pool.bytes / 1e9, "live_peak_GB": pool.live_peak / 1e9})
        print(f"{stage:40s} pool {pool.bytes / 1e9:6.2f} GB  (at most {pool.live_peak / 1e9:.2f} GB lent at once "
              f"so far)", flush=True)

    enc = gpu_encoder.CudaEncoder(tensors["text_encoder"], cfg["text_encoder"])
    enc.upload()
    for role, n in (("prompt", 24), ("negative", 12)):      # a short prompt and "" in the chat template
        planned(lambda: enc.model(np.zeros(gpu_encoder.bucket(n), np.int64)))
        mark(f"encoded the {role} ({gpu_encoder.bucket(n)} tokens)")
    dit = CudaDenoiser(tensors["transformer"], cfg["transformer"])
    dit.upload()
    dec = CudaDecoder(tensors["vae"], cfg["vae"], graphs=False)
    dec.decoder.decode_image(dec.ops.array(np.zeros((cfg["vae"]["latent_channels"], 2, 2), np.float32)))
    weights = {"text_encoder": _device_bytes(enc.ops), "transformer": _device_bytes(dit.ops),
               "vae": _device_bytes(dec.ops)}
    rows.append({"stage": "weights on the device", **{k: v / 1e9 for k, v in weights.items()}})
    print("weights on the device: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in weights.items())
          + f"; {sum(weights.values()) / 1e9:.2f} GB in all", flush=True)
    text = dit.config["text_dim"]
    cond = dit._slot("cond", dit.prepare_text(np.zeros((24, text), np.float32)))
    uncond = dit._slot("uncond", dit.prepare_text(np.zeros((12, text), np.float32)))
    kinds = {frozenset(DEFAULT_SKIP_LAYERS) if DEFAULT_SKIP_START <= i / steps < DEFAULT_SKIP_STOP else frozenset()
             for i in range(len(sigmas(steps)) - 1)}
    for size in sizes:
        h = size // 16
        x, step, velocity = dit._buffers(dit.config["latent_channels"], h, h)
        for kind in sorted(kinds, key=len):
            planned(lambda: dit._step((h, h), x, step, cond, uncond, kind, True, velocity))
        mark(f"{size}x{size}: the DiT's step graphs ({len(kinds)})")
        latents = cuda_table.cuda.to_device(np.zeros((dit.config["latent_channels"], h, h), np.float32))
        planned(lambda: dec._run(latents))
        mark(f"{size}x{size}: the decoder's graph")
    rows.append({"stage": "each plan", "plans": pool.plans})     # gpu_picture.py records the device's alike
    for i, p in enumerate(pool.plans):
        print(f"plan {i}: {p['takes']} takes asking {p['asked_bytes'] / 1e9:.2f} GB, {p['held_takes']} still lent "
              f"after the eager pass ({p['held_bytes'] / 1e9:.3f} GB), {p['made_bytes'] / 1e9:.2f} GB of blocks added: "
              f"{p['kept_blocks']} of the eager pass's kept, {p['new_blocks']} allocated", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 512])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = plan(args.sizes)
    whole = picture(args.sizes)
    if args.out:
        args.out.write_text(json.dumps({"decoder": rows, "picture": whole}, indent=1) + "\n")


if __name__ == "__main__":
    main()
