"""The device memory the decoder's pool holds at real sizes, worked out on the CPU from the op sequence.

    python scripts/pool_plan.py [--sizes 1024 512] [--out FILE]

Runs CudaDecoder (the small config: widths 96/192/384/384, as on the H200) in the numba CUDA simulator with
every kernel launch and product skipped and the simulator's chunk constants set to the device's, so the ops
ask the pool for exactly what they ask on the GPU, in the same order. It prints, after each size in turn,
the bytes the shared pool (moss_cli/ops/cuda_pool.py) holds as the product leaves it (each size's eager pass
recorded, its blocks planned, the capture's requests lent the planned blocks), with best fit alone, and with
blocks only of the exact size asked: the same requests and lifetimes. No GPU needed;
values are not computed (a few seconds).
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
from moss_cli.ops import cuda_table  # noqa: E402
from moss_cli.ops.cuda_pool import Pool  # noqa: E402

DEVICE_COLUMN_BYTES = 384 << 20     # conv.py's values off the simulator
DEVICE_GN_PARTS = 64


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
    from moss_cli.ops.cuda_decoder import CudaDecoder

    conv.COLUMN_BYTES, conv.GN_PARTS = DEVICE_COLUMN_BYTES, DEVICE_GN_PARTS
    sim_kernel.FakeCUDAKernel.__getitem__ = lambda self, config: (lambda *args: None)
    conv.half_product = lambda a, w, d, stream=0: None
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 512])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = plan(args.sizes)
    if args.out:
        args.out.write_text(json.dumps({"decoder": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
