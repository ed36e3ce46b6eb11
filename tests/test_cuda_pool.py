"""The shared device pool's lending (moss_cli/ops/cuda_pool.py), with a counting allocator: best fit, the
small requests' exact sizes, the order among equal blocks, growth only when nothing free fits."""

import pytest

from moss_cli.ops import cuda_pool
from moss_cli.ops.cuda_pool import Pool

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


def test_the_decoder_plan_at_real_sizes_shares_blocks_between_sizes():
    """scripts/pool_plan.py: the real small decoder's requests (kernels skipped, in the simulator) at 1024x1024
    and then 512x512. The best-fit pool holds less than an exact-size pool would, at least what is lent at once,
    and the smaller decode adds almost nothing to it."""
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
        big, small = json.loads(out.read_text())["decoder"]
    assert (big["size"], small["size"]) == (1024, 512)
    assert big["live_peak_GB"] <= big["best_fit_GB"] < big["exact_size_GB"]
    assert small["best_fit_GB"] < 1.01 * big["best_fit_GB"]
    assert small["exact_size_GB"] > 1.1 * big["exact_size_GB"]      # exact sizes: the 512 decode's own blocks


LEASE_SCRIPT = r'''
import gc
import numpy as np
from moss_cli.ops.cuda_table import CudaOps
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
