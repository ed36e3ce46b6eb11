"""torch's CPU randn reproduced bit for bit (decoder_and_noise.md part 2), against torch itself."""

import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

from moss_cli import float32, noise
from moss_cli.errors import UsageError

AVX2_TORCH = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
needs_avx2 = pytest.mark.skipif(not AVX2_TORCH, reason="torch here does not run its AVX2 randn kernel")

SEEDS = [0, 42, 2**32 + 7, -1]
SHAPES = [(1, 128, 16, 16), (1, 128, 64, 64), (1, 128, 48, 80), (17,), (33,), (4099,),
          (1,), (3,), (15,), (2, 7), (1, 1, 4, 3), (0,)]


def torch_randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32).numpy()


def same_bits(a, b):
    return a.dtype == np.float32 and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_published_values_seed_0():
    # kornia's CenterCrop docstring: torch.manual_seed(0); torch.randn(1, 1, 4, 4) starts with these
    assert np.round(noise.randn((1, 1, 4, 4), 0)[0, 0, 0].astype(float), 4).tolist() == [-1.1258, -1.1524, -0.2506, -0.4339]
    # the small-tensor path: torch.manual_seed(0); Normal(0, 1).rsample((8,))
    assert np.round(noise.randn(8, 0).astype(float), 4).tolist() == [1.5410, -0.2934, -2.1788, 0.5684,
                                                       -1.0845, -1.3986, 0.4033, 0.8380]


@needs_avx2
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_randn_equals_torch_bit_for_bit(shape, seed):
    assert same_bits(noise.randn(shape, seed), torch_randn(shape, seed))


@needs_avx2
def test_successive_draws_on_one_generator_follow_torch():
    # odd sizes leave a cached double sample behind that the next small draw must consume first
    g, ours = torch.Generator("cpu").manual_seed(7), noise.Generator(7)
    for shape in [5, 17, 3, (1, 32, 16, 16), 1, 40, (2, 3), 1, 4099]:
        assert same_bits(ours.randn(shape), torch.randn(shape, generator=g).numpy()), shape


def test_negative_seeds_wrap_and_only_the_low_32_bits_seed_the_stream():
    assert noise.Generator(-1).initial_seed == torch.Generator().manual_seed(-1).initial_seed()
    assert same_bits(noise.randn(64, 2**32 + 7), noise.randn(64, 7))


@needs_avx2
def test_planted_control_without_fma_contraction_is_not_exact():
    blocks = noise.Generator(0)._uniform_float(64 * 64).reshape(-1, 16)
    ref = torch_randn(64 * 64, 0)
    assert same_bits(noise.fill16_avx2(blocks).ravel(), ref)
    assert not same_bits(noise.fill16_avx2(blocks, fma=float32.mul_add32).ravel(), ref)


@needs_avx2
def test_threaded_box_muller_equals_torch_for_any_thread_count_and_a_misplaced_cut_does_not():
    """fill16_threads shares the blocks out to threads; its bits equal torch's whatever the count, and a share
    that starts one block late (the planted control: a cut off by one, its last block made twice) does not."""
    n = 5 * noise.SHARE_BLOCKS * noise.BLOCK + 48
    blocks = noise.Generator(3)._uniform_float(n).reshape(-1, noise.BLOCK)
    ref = torch_randn(n, 3)
    for threads in (1, 2, 3, 5, 16):
        assert same_bits(noise.fill16_threads(blocks, threads).ravel(), ref)
    cut = len(blocks) // 2
    shifted = np.concatenate([noise.fill16_avx2(blocks[:cut]), noise.fill16_avx2(blocks[cut - 1:-1])])
    assert not same_bits(shifted.ravel(), ref)


def round_to_float32(q: Fraction) -> np.float32:
    """Correct rounding of an exact rational to float32, ties to even: the FMA's definition."""
    near = np.float32(float(q))
    candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(candidates, key=lambda r: (abs(Fraction(float(r)) - q), int(r.view(np.uint32)) & 1))


def test_fma32_rounds_once_like_a_hardware_fma():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(2, 3000)).astype(np.float32)
    c = (-(a * b) * rng.choice([1, 1 + 2**-20, 0.5], 3000)).astype(np.float32)   # heavy cancellation too
    # a*b + c lands on a float32 midpoint plus 2^-60 in float64's eyes: naive double rounding picks the wrong side
    a = np.append(a, np.float32(2**-24 * (1 + 2**-18)))
    b = np.append(b, np.float32(1 - 2**-18))
    c = np.append(c, np.float32(1 + 2**-23))
    # sums in float32's subnormal range, where its halfway points lie at other bits of a float64; the last one
    # is just under the midpoint between 2^-127 + 2^-149 and the next float, and a float64 midpoint again
    tiny = rng.normal(size=(3, 200)).astype(np.float32) * np.float32(2**-66)
    a = np.append(a, np.append(tiny[0], np.float32(2**-75 * (1 + 2**-23))))
    b = np.append(b, np.append(tiny[1], np.float32(2**-75 * (1 - 2**-23))))
    c = np.append(c, np.append(tiny[2] * np.float32(2**-10), np.float32(2**-127 + 2**-149)))
    exact = [round_to_float32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))) for x, y, z in zip(a, b, c)]
    assert same_bits(float32.fma32(a, b, c), np.array(exact, dtype=np.float32))
    m = 3000
    assert float32.fma32(a[m:m + 1], b[m:m + 1], c[m:m + 1])[0] == np.float32(1 + 2**-23)
    assert np.float32(np.float64(a[m]) * np.float64(b[m]) + np.float64(c[m])) == np.float32(1 + 2**-22)
    assert float32.fma32(a[-1:], b[-1:], c[-1:])[0] == np.float32(2**-127 + 2**-149)
    assert np.float32(np.float64(a[-1]) * np.float64(b[-1]) + np.float64(c[-1])) == np.float32(2**-127 + 2**-148)


GENERIC_SCRIPT = """
import sys, numpy as np, torch
assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
out = {}
for seed in (0, 42):
    for shape in [(1, 128, 16, 16), (17,), (4099,), (5,)]:
        g = torch.Generator("cpu").manual_seed(seed)
        out[f"{seed}-{shape}"] = torch.randn(shape, generator=g).numpy()
g = torch.Generator("cpu").manual_seed(3)
for i, shape in enumerate([5, 33, 3]):
    out[f"seq-{i}"] = torch.randn(shape, generator=g).numpy()
np.savez(sys.argv[1], **out)
"""


def test_generic_kernel_equals_torch_default_capability(tmp_path):
    path = tmp_path / "generic.npz"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    subprocess.run([sys.executable, "-c", GENERIC_SCRIPT, str(path)], env=env, check=True)
    ref = np.load(path)
    for seed in (0, 42):
        for shape in [(1, 128, 16, 16), (17,), (4099,), (5,)]:
            assert same_bits(noise.randn(shape, seed, kernel="generic"), ref[f"{seed}-{shape}"]), (seed, shape)
    g = noise.Generator(3, kernel="generic")
    for i, shape in enumerate([5, 33, 3]):
        assert same_bits(g.randn(shape), ref[f"seq-{i}"])
    # the two kernels differ in the last bits, which is why the kernel is a choice
    assert not same_bits(noise.randn((1, 128, 16, 16), 0, kernel="generic"), noise.randn((1, 128, 16, 16), 0))


def test_unknown_kernel_is_a_usage_error():
    assert noise.KERNELS == ("avx2", "generic")
    with pytest.raises(UsageError):
        noise.randn((1, 128, 16, 16), 0, kernel="neon")


def test_1024px_noise_is_float32_standard_normal():
    x = noise.randn((1, 128, 64, 64), 0)
    assert x.shape == (1, 128, 64, 64) and x.dtype == np.float32 and np.all(np.isfinite(x))
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01
