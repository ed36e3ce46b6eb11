"""The shared device pool's lending (moss_cli/memory/pool.py), with a counting allocator: best fit, the
small requests' exact sizes, the order among equal blocks, growth only when nothing free fits."""

import numpy as np
import pytest

from moss_cli.memory import pool as cuda_pool
from moss_cli.memory.pool import Pool

MB = 1 << 20


def counting_pool():
    made = []
    return Pool(lambda n: made.append(n) or f"block{len(made) - 1}"), made


def test_a_freed_block_is_lent_again_and_nothing_new_is_made():
    pool, made = counting_pool()
    a = pool.take(8 * MB)
    pool.give(a)
    assert pool.take(8 * MB) is a
    assert made == [8 * MB] and pool.bytes == 8 * MB


def test_the_smallest_free_block_that_fits_is_lent():
    pool, made = counting_pool()
    blocks = [pool.take(n * MB) for n in (16, 4, 9, 6)]
    for b in blocks:
        pool.give(b)
    assert pool.take(5 * MB).base == "block3"       # 6 MB: the smallest of 16, 4, 9, 6 that holds 5
    assert pool.take(5 * MB).base == "block2"       # then 9
    assert pool.take(3 * MB).base == "block1"       # 4
    assert pool.take(17 * MB).base == "block4"      # none holds 17: a new block of exactly 17
    assert made == [16 * MB, 4 * MB, 9 * MB, 6 * MB, 17 * MB]
    assert pool.bytes == 52 * MB and pool.free_bytes == 16 * MB


def test_equal_blocks_are_lent_oldest_first_whatever_order_they_came_back_in():
    pool, _ = counting_pool()
    a, b, c = (pool.take(2 * MB) for _ in range(3))
    for block in (c, a, b):
        pool.give(block)
    assert [pool.take(2 * MB).base for _ in range(3)] == ["block0", "block1", "block2"]


def test_small_requests_take_only_blocks_of_their_own_size():
    pool, made = counting_pool()
    big, small = pool.take(2 * MB), pool.take(4096)
    pool.give(big)
    pool.give(small)
    assert pool.take(4096) is small
    assert pool.take(4096).base == "block2"         # the 2 MB block is free but not lent to a small request
    assert pool.take(1000).base == "block3"
    assert pool.take(cuda_pool.SMALL).base == "block0"    # the first size lent a larger block
    assert made == [2 * MB, 4096, 4096, 1000]


def test_a_smaller_run_of_the_same_sequence_fits_in_the_blocks_of_the_larger():
    """What the 512x512 decode does after the 1024x1024 one: the same requests at a quarter the size, two
    alive at a time, make no new block; an exact-size pool would have made every size again."""
    pool, made = counting_pool()

    def run(scale):
        alive = []
        for n in (96, 192, 96, 384, 48, 192):
            alive.append(pool.take(n * MB // scale))
            if len(alive) > 2:
                pool.give(alive.pop(0))
        for b in alive:
            pool.give(b)

    run(1)
    first = list(made)
    run(4)
    assert made == first
    assert pool.bytes == sum(first)


@pytest.mark.parametrize("nbytes", [0, 1])
def test_an_empty_request_still_gets_a_block(nbytes):
    pool, made = counting_pool()
    pool.take(nbytes)
    assert made == [1]


def test_the_pool_plan_at_real_sizes_shares_blocks_between_sizes_and_components():
    """scripts/pool_plan.py: the real small decoder's requests (kernels skipped, in the simulator) at 1024x1024
    and then 512x512. The planned pool holds less than best fit alone, which holds less than an exact-size pool
    would; all hold at least what is lent at once; the smaller decode adds almost nothing. The whole picture's
    pool is shared by the DiT and the decoder, and the encoder keeps every weight but its embedding table."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        done = subprocess.run([sys.executable, "-W", "ignore", "scripts/pool_plan.py", "--out", str(out)], cwd=root,
                              env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"), capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        plan = json.loads(out.read_text())
        big, small = plan["decoder"]
        whole = {row["stage"]: row["pool_GB"] for row in plan["picture"] if "pool_GB" in row}
        weights = next(row for row in plan["picture"] if row["stage"] == "weights on the device")
    assert (big["size"], small["size"]) == (1024, 512)
    assert big["live_peak_GB"] <= big["planned_GB"] < big["best_fit_GB"] < big["exact_size_GB"]
    assert small["planned_misses"] == 0
    assert small["planned_GB"] < 1.01 * big["planned_GB"] and small["best_fit_GB"] < 1.01 * big["best_fit_GB"]
    assert small["exact_size_GB"] > 1.1 * big["exact_size_GB"]      # exact sizes: the 512 decode's own blocks
    # the whole picture's pool: the DiT's and the decoder's graphs share blocks; the 512 graphs add ~nothing
    assert whole["1024x1024: the decoder's graph"] < big["planned_GB"] + whole["1024x1024: the DiT's step graphs (2)"]
    assert whole["512x512: the decoder's graph"] < 1.01 * whole["1024x1024: the decoder's graph"]
    # the encoder's device weights: every tensor it reads (matrices bf16, the rest float32) but the token
    # embedding table, which stays on the host
    sys.path.insert(0, str(root / "scripts"))
    from make_real_checkpoint import configs
    from moss_cli.checkpoint import expected_tensors
    shapes = expected_tensors("text_encoder", configs(1)["text_encoder"])
    want = sum(int(np.prod(v)) * (2 if len(v) == 2 else 4) for k, v in shapes.items() if k != "embed_tokens.weight")
    assert weights["text_encoder"] == pytest.approx(want / 1e9, rel=1e-6)


LEASE_SCRIPT = r'''
import gc
import numpy as np
from moss_cli.ops.cuda.table import CudaOps
ops = CudaOps()
a = ops.new((4, 1 << 18))                       # 4 MB: past SMALL, so any free block that holds it is lent
view = a.reshape(1 << 20)[8:]                    # a view the op table might keep past `a`
view[:] = 7.0
del a
gc.collect()
b = ops.new((4, 1 << 18))
b.reshape(1 << 20)[:] = 1.0
held = float(view[0])                            # the view's block was not lent to b
del view, b
gc.collect()
c = ops.new((4, 1 << 18))
print(held, ops.pool.blocks, ops.pool.bytes >> 20)
'''


def test_in_the_simulator_a_block_comes_back_only_when_its_last_view_dies():
    """The simulator lends real host blocks as the GPU path lends device ones: a view made from a lent array
    keeps its block out of the pool (else an op's later output would overwrite what the view still reads)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", LEASE_SCRIPT], cwd=root, capture_output=True,
                          text=True, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["7.0", "2", "8"]     # b took a second block; c reused one of the two


def test_a_planned_replay_packs_what_best_fit_stranded():
    """Two 10 MB arrays alive together, then one of 20 MB: best fit makes 40 MB of blocks. The plan puts the
    20 MB take in a 20 MB block, the first 10 MB take there too (their lives do not overlap), the second in a
    10 MB block: 30 MB, the recording's own blocks of those sizes (the older 10 MB one), the other let go; the
    scripted replay is lent exactly those, and nothing was allocated for the plan."""
    pool, made = counting_pool()

    def run():
        a, b = pool.take(10 * MB), pool.take(10 * MB)
        pool.give(a)
        pool.give(b)
        c = pool.take(20 * MB)
        pool.give(c)
        return [a.base, b.base, c.base]

    pool.record()
    assert run() == ["block0", "block1", "block2"] and pool.bytes == 40 * MB
    planned = pool.plan()
    assert [b.base for b in planned] == ["block2", "block0", "block2"]
    assert pool.bytes == 30 * MB and sorted(n for n, _, _ in pool._free) == [10 * MB, 20 * MB]
    pool.script(planned)
    assert run() == ["block2", "block0", "block2"]
    pool.script(None)
    assert pool.misses == 0 and made == [10 * MB, 10 * MB, 20 * MB]
    assert pool.plans[-1]["kept_blocks"] == 2 and pool.plans[-1]["new_blocks"] == 0


def test_blocks_made_before_the_recording_are_filled_first_and_never_let_go():
    """Blocks made before the recording take planned takes first; one the plan leaves empty stays (an earlier
    graph still addresses it); a block made while recording is kept where the plan needs one of its size."""
    pool, _ = counting_pool()
    old_big, old_small = pool.take(64 * MB), pool.take(5 * MB)
    pool.give(old_big)
    pool.give(old_small)
    pool.record()
    hold = pool.take(64 * MB)                         # best fit lends the old 64 MB block
    a = pool.take(16 * MB)                            # so this makes block2
    pool.give(hold)
    pool.give(a)
    planned = pool.plan()
    # largest first: hold into the old 64 MB block; a overlaps it and the old 5 MB block is too small: a's own
    assert [b.base for b in planned] == ["block0", "block2"]
    assert pool.bytes == (64 + 5 + 16) * MB
    pool.script(planned)
    x, y = pool.take(64 * MB), pool.take(16 * MB)
    assert (x.base, y.base) == ("block0", "block2")
    pool.give(x)
    pool.give(y)
    pool.record()                                     # a later graph's recording: every block is old now
    pool.give(pool.take(64 * MB))
    pool.give(pool.take(16 * MB))
    assert [b.base for b in pool.plan()] == ["block0", "block2"] and pool.bytes == (64 + 5 + 16) * MB


def test_the_plan_keeps_only_recorded_blocks_of_the_exact_size_it_needs():
    """x (12 MB) comes back, y (8 MB) is lent x's block, z (12 MB) is made while y lives: the recording made two
    12 MB blocks. The plan puts x and z in one 12 MB block (their lives do not overlap) and needs an 8 MB one
    for y: it keeps the first 12 MB block and allocates 8 MB rather than keeping the other 12 MB one (4 MB
    the plan never asks for), which is let go."""
    pool, made = counting_pool()
    pool.record()
    x = pool.take(12 * MB)
    pool.give(x)
    y = pool.take(8 * MB)                   # best fit: x's block
    z = pool.take(12 * MB)
    pool.give(y)
    pool.give(z)
    planned = pool.plan()
    assert [b.base for b in planned] == ["block0", "block2", "block0"]
    assert made == [12 * MB, 12 * MB, 8 * MB] and pool.bytes == 20 * MB
    assert sorted(n for n, _, _ in pool._free) == [8 * MB, 12 * MB]
    assert pool.plans[-1]["kept_blocks"] == 1 and pool.plans[-1]["new_blocks"] == 1


def test_a_planned_block_that_is_lent_falls_back_to_best_fit():
    pool, _ = counting_pool()
    pool.record()
    pool.give(pool.take(8 * MB))
    planned = pool.plan()
    squatter = pool.take(8 * MB)                      # lends the planned block before the script runs
    pool.script(planned)
    other = pool.take(8 * MB)
    assert other is not squatter and pool.misses == 1


ALIGN_SCRIPT = r'''
import sys
import numpy as np
from numba import cuda
sys.path.insert(0, "scripts")
from pool_plan import skip_work
from moss_cli.checkpoint import open_checkpoint
from moss_cli.ops.cuda import table as cuda_table
from moss_cli.gpu.decoder import CudaDecoder
from moss_cli.gpu.encoder import CudaEncoder
from moss_cli.gpu.denoiser import CudaDenoiser

skip_work()                   # the requests only: no kernel runs, no product
pool = cuda_table.shared_pool()
ckpt = open_checkpoint()


def twice(name, eager):
    """What planned_capture does around a capture, with the capture's ops run eagerly."""
    pool.record()
    eager()
    before = pool.bytes
    pool.script(pool.plan())
    misses = pool.misses
    eager()
    pool.script(None)
    print(name, pool.misses - misses, pool.bytes <= before)


enc = CudaEncoder(ckpt.component("text_encoder").tensors, ckpt.component("text_encoder").config)
enc.upload()
twice("encoder", lambda: enc.model(np.zeros(12, np.int64)))
comp = ckpt.component("transformer")
dit = CudaDenoiser(comp.tensors, comp.config)
dit.upload()
rows = np.zeros((7, dit.config["text_dim"]), np.float32)
cond, uncond = dit._slot("cond", dit.prepare_text(rows)), dit._slot("uncond", dit.prepare_text(rows[:5]))
x, step, velocity = dit._buffers(dit.config["latent_channels"], 4, 6)
twice("dit", lambda: dit._step((4, 6), x, step, cond, uncond, frozenset({1}), True, velocity))
vae = ckpt.component("vae")
dec = CudaDecoder(vae.tensors, vae.config, graphs=False)
latents = cuda.to_device(np.zeros((128, 3, 2), np.float32))
twice("decoder", lambda: dec._run(latents))
'''


def test_a_capture_asks_the_pool_what_its_eager_pass_asked():
    """Each component's capture follows its eager pass's plan take for take (the tiny checkpoint, in the
    simulator, kernels skipped): no request finds its planned block lent or too small, and the planned blocks
    hold no more than the eager pass's best fit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", ALIGN_SCRIPT], cwd=root, capture_output=True,
                          text=True, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["encoder", "0", "True", "dit", "0", "True", "decoder", "0", "True"], done.stdout


def test_each_plan_records_its_takes_the_ones_still_lent_and_the_blocks_it_made():
    """A recording of three takes, one kept lent past the eager pass (as an array held by a cycle or a cache
    would be): the plan's record counts it, and the blocks made for the plan (the recording's own let go)."""
    pool, _ = counting_pool()
    pool.record()
    a, b = pool.take(8 * MB), pool.take(4 * MB)
    pool.give(a)
    c = pool.take(2 * MB)
    pool.give(c)
    pool.plan()
    # a (8 MB) keeps its own block, which c shares; b, still lent, overlaps both: a new 4 MB block
    assert pool.plans == [{"takes": 3, "asked_bytes": 14 * MB, "held_takes": 1, "held_bytes": 4 * MB,
                           "made_bytes": 8 * MB + 4 * MB, "kept_blocks": 1, "new_blocks": 1}]
    pool.give(b)


def test_blocks_given_back_by_the_cyclic_collector_are_counted():
    import gc
    import weakref

    class Holder:
        pass
    pool, _ = counting_pool()
    pool.watch_collector()
    plain, cyclic = Holder(), Holder()
    cyclic.me = cyclic                      # a reference cycle: only the collector frees it
    for holder in (plain, cyclic):
        weakref.finalize(holder, pool.give, pool.take(MB))
    del holder
    gc.disable()
    try:
        del plain                           # refcount: given back at once, not by the collector
        assert pool.collector_gives == 0 and len(pool._free) == 1
        del cyclic
        assert len(pool._free) == 1         # still lent: the cycle keeps it
        gc.collect()
    finally:
        gc.enable()
    assert pool.collector_gives == 1 and len(pool._free) == 2
