"""On a GPU: the shared pool over the tiny checkpoint's whole picture at two sizes, as moss-image runs it.

Every capture (the encoder's buckets, the DiT's step graphs, the decoder's) is lent the blocks planned from
its eager pass, take for take (no miss), some of them blocks the eager pass made; the second size's graphs fit
in the blocks the first left; the pictures equal, byte for byte, those of a process whose graphs were captured
in the other order.
"""

import pytest

import cuda_kernels

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")

SCRIPT = r'''
import json
import sys
from moss_cli import artifacts, stages
from moss_cli.checkpoint import open_checkpoint
from moss_cli.ops.cuda.table import shared_pool

shared_pool().watch_collector()       # blocks that come back inside a garbage collection (a diagnostic)
model = stages.Model(open_checkpoint(), device="cuda")
sizes = [int(s) for s in sys.argv[1:]]
after = []
for size in sizes:
    enc = artifacts.parse(stages.encode(model, "a red fox", ""), "ENC", "encode", model.fingerprint)
    lat, _ = stages.denoise(model, enc, stages.SamplingOptions(seed=7, steps=3, width=size, height=size))
    png = stages.decode(model, artifacts.parse(lat, "LAT", "denoise", model.fingerprint))
    after.append(shared_pool().bytes)
    sys.stdout.buffer.write(png.hex().encode() + b"\n")
print("plans", json.dumps(shared_pool().plans))     # per capture: takes, bytes asked, still lent, blocks made
print("collector_gives", shared_pool().collector_gives)
print("misses", shared_pool().misses, "pool", *after)
'''


def _run(*sizes):
    import json
    import subprocess
    import sys
    from pathlib import Path
    done = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, sizes)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    *pngs, plans, collector, last = done.stdout.split("\n")[:-1]
    words = last.split()
    return pngs, int(words[1]), [int(w) for w in words[3:]], f"{collector}; {plans}", json.loads(plans[6:])


def test_captures_follow_their_plans_and_sizes_share_blocks():
    pngs, misses, pool, why, plans = _run(128, 64)
    assert misses == 0
    assert sum(p["kept_blocks"] for p in plans) > 0, why      # plans keep the eager passes' blocks they need
    assert pool[1] <= pool[0] * 1.01, (pool, why)     # the 64x64 graphs in the 128x128 graphs' blocks
    other, _, _, _, _ = _run(64, 128)               # the other capture order: other blocks, the same bytes
    assert other == pngs[::-1]
