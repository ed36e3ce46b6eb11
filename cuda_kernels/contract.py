"""Run every kernel's gate and planted control; print "N kernels, N pass; N controls, N caught".

    NUMBA_ENABLE_CUDASIM=1 python -m cuda_kernels.contract --size tiny    # CI, simulator kernels only
    python -m cuda_kernels.contract --size real                          # on the GPU, every kernel
    python -m cuda_kernels.contract --only mma_tf32_product              # named cases alone
"""

import argparse
import sys
import time
import warnings

import numpy as np

from . import (conv, dit, embedding, elementwise, flash, gdn, gdn_chunk, gdn_inputs, gemm, layout, mma, norms, prefetch,
               rope_attention, sdpa)
from .core import SIMULATED, gate

MODULES = (elementwise, layout, prefetch, embedding, norms, rope_attention, flash, gdn, gdn_inputs, gdn_chunk, gemm,
           mma, dit, sdpa, conv)


def cases(simulator):
    return [c for m in MODULES for c in m.CASES if c.simulator or not simulator]


def run(size="tiny", seed=0, write=print, only=None):
    """Check each case (those named in `only`, if given); returns (kernels, passed, controls, caught)."""
    rng = np.random.default_rng(seed)
    counts = [0, 0, 0, 0]
    for case in cases(SIMULATED):
        if only and case.name not in only:
            continue
        start = time.perf_counter()
        inputs = case.make(rng, size)
        expected, bound = case.reference(inputs)
        with warnings.catch_warnings():
            # controls may divide by zero on purpose; the simulator's uint32 hashes wrap as on the GPU
            warnings.simplefilter("ignore", RuntimeWarning)
            ok, worst = gate(case.run(inputs, False), expected, bound)
            bad, worst_control = gate(case.run(inputs, True), expected, bound)
        counts[0] += 1
        counts[1] += ok
        counts[2] += 1
        counts[3] += not bad
        write(f"{case.name:24s} gate {'pass' if ok else 'FAIL'} (worst |err|/bound {worst:.3g})  "
              f"control {'caught' if not bad else 'MISSED'} ({worst_control:.3g})  "
              f"{time.perf_counter() - start:.2f} s")
    k, p, c, n = counts
    write(f"{k} kernels, {p} pass; {c} controls, {n} caught")
    return tuple(counts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", metavar="CASE", help="run these cases alone")
    args = parser.parse_args(argv)
    k, p, c, n = run(args.size, args.seed, only=args.only)
    return 0 if (k == p and c == n) else 1


if __name__ == "__main__":
    sys.exit(main())
