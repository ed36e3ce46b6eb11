"""Run every kernel's gate and planted control; print "N kernels, N pass; N controls, N caught".

    NUMBA_ENABLE_CUDASIM=1 python -m cuda_kernels.contract --size tiny    # CI, simulator kernels only
    python -m cuda_kernels.contract --size real                          # on the GPU, every kernel
    python -m cuda_kernels.contract --only mma_tf32_product              # named cases alone
"""

import argparse
import sys
import time
import warnings
import zlib

import numpy as np

from . import (conv, dit, embedding, elementwise, flash, gdn, gdn_chunk, gdn_inputs, gemm, layout, lora, mma,
               norms, rope_attention, sdpa)
from .core import SIMULATED, gate

MODULES = (elementwise, layout, embedding, norms, rope_attention, flash, gdn, gdn_inputs, gdn_chunk, gemm,
           mma, dit, sdpa, conv, lora)

# Each case's bound is what its arithmetic can do at worst; where the error measured far below it (a sum's
# rounding errors cancel, a bound over every term's magnitude), the gate is MARGIN times the worst |err| / bound
# recorded for that size (tiny: the simulator; real: the largest of the H100 and H200 runs), so a bug of a few
# times the rounding error fails it. Cases not listed gate at their bound (measured within 8x of it, or exact).
MARGIN = 4.0
MEASURED = {                   # case: (tiny, real) worst |err| / bound; None: gate at the bound
    "rms_norm_rope": (None, 0.0409),
    "rms_norm": (0.102, 0.0365),
    "l2_norm": (0.106, 0.0466),
    "gated_rms_norm": (0.108, 0.00339),
    "softmax_causal": (0.0516, 0.0034),
    "attention_gqa": (None, 0.0227),
    "gated_delta_rule": (0.00578, 6.07e-5),
    "linear_bf16_residual": (None, 0.00269),
    "linear_bf16_f32out_bias": (None, 0.00267),
    "mma_bf16_product": (0.00817, 0.0012),
    "mma_tf32_product": (None, 0.0366),
    "conv1x1_split": (0.0364, 0.0147),
    "conv3x3_taps": (0.00518, 0.00062),
    "conv3x3_up_taps": (0.00468, 0.000559),
    "conv3x3_norm_taps": (0.0114, 0.00114),
    "conv3x3_down_taps": (0.00337, None),
    "group_norm": (None, 0.0185),
}


def gate_fraction(name, size):
    """The fraction of its bound a case's gate sits at for this size (1 where nothing is recorded)."""
    tiny, real = MEASURED.get(name, (None, None))
    recorded = tiny if size == "tiny" else real
    return 1.0 if recorded is None else min(1.0, MARGIN * recorded)


def cases(simulator):
    return [c for m in MODULES for c in m.CASES if c.simulator or not simulator]


def run(size="tiny", seed=0, write=print, only=None):
    """Check each case (those named in `only`, if given); returns (kernels, passed, controls, caught)."""
    counts = [0, 0, 0, 0]
    for case in cases(SIMULATED):
        if only and case.name not in only:
            continue
        start = time.perf_counter()
        # each case draws from its own generator, seeded by its name: its inputs (and so its measured error)
        # are the same whether it runs alone (--only) or among the others
        inputs = case.make(np.random.default_rng([seed, zlib.crc32(case.name.encode())]), size)
        expected, bound = case.reference(inputs)
        fraction = gate_fraction(case.name, size)
        bound = bound * fraction
        with warnings.catch_warnings():
            # controls may divide by zero on purpose; the simulator's uint32 hashes wrap as on the GPU
            warnings.simplefilter("ignore", RuntimeWarning)
            ok, worst = gate(case.run(inputs, False), expected, bound)
            bad, worst_control = gate(case.run(inputs, True), expected, bound)
        counts[0] += 1
        counts[1] += ok
        counts[2] += 1
        counts[3] += not bad
        at = f", gate at {fraction:.3g} of the bound" if fraction < 1 else ""
        write(f"{case.name:24s} gate {'pass' if ok else 'FAIL'} (worst |err|/bound {worst * fraction:.3g}{at})  "
              f"control {'caught' if not bad else 'MISSED'} ({worst_control * fraction:.3g})  "
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
