"""The GPU decoder's host side (chunked convolutions, the split weights and scales, group norm, the attention's
split products, latents in, pixels out) run in the CUDA simulator on the tiny checkpoint: its pixels equal the
numpy float32 decoder's but for rare ones off by one, its raw image the float64 decode's to float32 level.
The products run on the host there (cuda_kernels.conv.half_product); on a GPU, tests/gpu/test_decoder_gpu.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

SCRIPT = r'''
import json
import numpy as np
from moss_cli import vae
from moss_cli.checkpoint import open_checkpoint
from moss_cli.ops import numpy_ops
from moss_cli.ops.cuda_decoder import CudaDecoder

comp = open_checkpoint().component("vae")
lat = np.random.default_rng(0).standard_normal((1, 128, 1, 1)).astype(np.float32)
ref = vae.Decoder(numpy_ops(np.float64), comp.tensors, comp.config).raw(lat)
cpu = vae.to_pixels(vae.Decoder(numpy_ops(np.float32), comp.tensors, comp.config)(lat))
dec = CudaDecoder(comp.tensors, comp.config)
gpu = dec.decode(lat)
ops, d = dec.ops, dec.decoder
raw = ops.host(d.decode_image(ops.unpack_latents(ops.array(lat[0]), d.bn_std, d.bn_mean)))
diff = np.abs(gpu.astype(int) - cpu.astype(int))
print(json.dumps({"shape": list(gpu.shape), "dtype": gpu.dtype.name, "worst": int(diff.max()),
                  "off": int((diff > 0).sum()), "raw": float(np.abs(raw - ref).max() / np.abs(ref).max())}))
'''


def test_simulated_decoder_pixels_equal_the_numpy_decoder():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["shape"] == [16, 16, 3] and got["dtype"] == "uint8"
    assert got["worst"] <= 1 and got["off"] <= 1          # 768 values: 0.1% allows none, one at a boundary
    assert got["raw"] <= 2e-6
