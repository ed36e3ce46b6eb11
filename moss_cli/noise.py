"""torch's CPU `randn` in numpy, bit for bit (decoder_and_noise.md part 2).

The stream is MT19937 seeded like torch's CPU generator. Tensors of 16 or more elements turn 24-bit
float uniforms into normals 16 at a time (Box-Muller pairing j with j+8); smaller ones draw doubles
one value at a time and keep the spare sine in the generator. The Box-Muller maths comes in two
kernels: "avx2" (official x86 wheels: Cephes log/sincos with the compiler's FMAs) and "generic"
(libm logf/cosf/sinf, what ATEN_CPU_CAPABILITY=default or aarch64 run).
"""

import ctypes
import ctypes.util
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .errors import UsageError
from .float32 import fma32

KERNELS = ("avx2", "generic")
SMALL_NUMEL = 16            # below this torch draws doubles one value at a time (§2.6)
BLOCK = 16                  # uniforms per Box-Muller block (§2.4)
FLOAT_BITS = 24             # float uniforms keep the low 24 bits of one draw
DOUBLE_BITS = 53            # double uniforms keep the low 53 bits of two draws

MT_N = 624
MT_INIT_MULT = 1812433253   # init_genrand multiplier

F32 = np.float32

# avx_mathfun.h constants, each a double literal rounded to float
TWO_PI = F32(2.0 * math.pi)
SQRTHF = F32(0.707106781186547524)
LOG_P = tuple(F32(p) for p in (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
                               1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
                               3.3333331174e-1))
LOG_Q1 = F32(-2.12194440e-4)
LOG_Q2 = F32(0.693359375)
FOPI = F32(1.27323954473516)                  # 4/pi
DP1 = F32(-0.78515625)
DP2 = F32(-2.4187564849853515625e-4)
DP3 = F32(-3.77489497744594108e-8)
COS_P = (F32(2.443315711809948e-5), F32(-1.388731625493765e-3), F32(4.166664568298827e-2))
SIN_P = (F32(-1.9515295891e-4), F32(8.3321608736e-3), F32(-1.6666654611e-1))
SIGN = np.uint32(0x80000000)


def log_avx2(x, fma=fma32):
    """avx_mathfun.h log256_ps for x in (0, 1], with the FMAs the AVX2 build contracts."""
    bits = x.view(np.uint32)
    e = ((bits >> 23).astype(np.int32) - 127).astype(F32) + F32(1)
    m = ((bits & np.uint32(0x807FFFFF)) | np.uint32(0x3F000000)).view(F32)
    small = m < SQRTHF
    tmp = np.where(small, m, F32(0))
    x = m - F32(1)
    e = e - np.where(small, F32(1), F32(0))
    x = x + tmp
    z = x * x
    y = np.full_like(x, LOG_P[0])
    for p in LOG_P[1:]:
        y = fma(y, x, p)
    y = y * x
    y = fma(y, z, e * LOG_Q1)
    y = y - z * F32(0.5)
    x = x + y
    return x + e * LOG_Q2


def sincos_avx2(theta, fma=fma32):
    """avx_mathfun.h sincos256_ps, with the FMAs the AVX2 build contracts; returns (sin, cos)."""
    sign_sin = theta.view(np.uint32) & SIGN
    x = np.abs(theta)
    j = (x * FOPI).astype(np.int32)
    j = (j + 1) & ~1
    y = j.astype(F32)
    swap_sin = ((j & 4) << 29).view(np.uint32)
    poly = (j & 2) == 0
    sign_cos = ((~(j - 2) & 4) << 29).view(np.uint32)
    sign_sin = sign_sin ^ swap_sin
    x = fma(y, DP1, x)
    x = fma(y, DP2, x)
    x = fma(y, DP3, x)
    z = x * x
    c = fma(COS_P[0], z, COS_P[1])
    c = fma(c, z, COS_P[2])
    c = c * z
    c = fma(c, z, -(z * F32(0.5)))
    c = c + F32(1)
    s = fma(SIN_P[0], z, SIN_P[1])
    s = fma(s, z, SIN_P[2])
    s = s * z
    s = fma(s, x, x)
    # the kernel's masked select, computed literally: it decides the signs of zeros
    zero = F32(0)
    s_part = np.where(poly, s, zero)
    c_part = np.where(poly, zero, c)
    sin = c_part + s_part
    cos = (c - c_part) + (s - s_part)
    return (sin.view(np.uint32) ^ sign_sin).view(F32), (cos.view(np.uint32) ^ sign_cos).view(F32)


def fill16_avx2(blocks, fma=fma32):
    """NormalFill16<float> AVX2: uniforms [k, 16] -> normals [k, 16] (cosines first, sines last)."""
    u1 = F32(1) - blocks[:, :8]
    u2 = blocks[:, 8:]
    radius = np.sqrt(F32(-2) * log_avx2(u1, fma))
    sin, cos = sincos_avx2(TWO_PI * u2, fma)
    # the closing fma(n, std=1, mean=0) is exact except that it turns -0 into +0
    return np.concatenate([radius * cos + F32(0), radius * sin + F32(0)], axis=1)


_libm = None


def _libm_f(name):
    global _libm
    if _libm is None:
        _libm = ctypes.CDLL(ctypes.util.find_library("m"))
    fn = getattr(_libm, name)
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn


def fill16_generic(blocks):
    """NormalFill16 scalar template: libm logf/cosf/sinf, the angle computed in double then rounded."""
    logf, cosf, sinf = _libm_f("logf"), _libm_f("cosf"), _libm_f("sinf")
    u1 = (F32(1) - blocks[:, :8]).ravel()
    u2 = blocks[:, 8:].ravel()
    radius = np.sqrt(F32(-2) * np.array([logf(v) for v in u1.tolist()], dtype=F32))
    theta = (2.0 * math.pi * u2.astype(np.float64)).astype(F32).tolist()
    cos = np.array([cosf(v) for v in theta], dtype=F32)
    sin = np.array([sinf(v) for v in theta], dtype=F32)
    shape = blocks[:, :8].shape
    return np.concatenate([(radius * cos + F32(0)).reshape(shape),
                           (radius * sin + F32(0)).reshape(shape)], axis=1)


SHARE_BLOCKS = 4096         # blocks a thread takes at least, where fill16_avx2's arrays are shared out


def fill16_threads(blocks, threads=None):
    """fill16_avx2 over shares of the blocks on threads (numpy lets go of the GIL inside each op): a block's
    normals depend on its own 16 uniforms only, so the bits are those of one call, for any thread count."""
    threads = threads or min(os.cpu_count() or 1, 16)
    shares = max(1, min(threads, len(blocks) // SHARE_BLOCKS))
    if shares == 1:
        return fill16_avx2(blocks)
    cuts = np.linspace(0, len(blocks), shares + 1).astype(int)
    with ThreadPoolExecutor(shares) as pool:
        return np.concatenate(list(pool.map(fill16_avx2, [blocks[a:b] for a, b in zip(cuts, cuts[1:])])))


FILL16 = {"avx2": fill16_threads, "generic": fill16_generic}


def mt19937_key(seed):
    """init_genrand state of std::mt19937 for the low 32 bits of `seed`."""
    key = [seed & 0xFFFFFFFF]
    for i in range(1, MT_N):
        prev = key[-1]
        key.append((MT_INIT_MULT * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return np.array(key, dtype=np.uint32)


class Generator:
    """torch.Generator('cpu').manual_seed(seed): successive randn draws continue one stream."""

    def __init__(self, seed: int, kernel: str = "avx2"):
        if kernel not in KERNELS:
            raise UsageError(f"unknown noise kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
        self.kernel = kernel
        self.initial_seed = int(seed) % 2**64       # torch stores the seed as uint64
        self._mt = np.random.MT19937(0)
        # pos = N makes the first draw run a full twist, as torch's engine does
        self._mt.state = {"bit_generator": "MT19937",
                          "state": {"key": mt19937_key(self.initial_seed), "pos": MT_N}}
        self._spare = None                          # torch's cached double normal sample

    def _draws(self, n):
        return self._mt.random_raw(n).astype(np.uint32)

    def _uniform_float(self, n):
        return (self._draws(n) & np.uint32((1 << FLOAT_BITS) - 1)).astype(F32) * F32(2.0 ** -FLOAT_BITS)

    def _uniform_double(self):
        hi, lo = (int(v) for v in self._draws(2))   # random64: the first draw is the high word
        return (((hi << 32) | lo) & ((1 << DOUBLE_BITS) - 1)) * 2.0 ** -DOUBLE_BITS

    def _normal_double(self):
        if self._spare is not None:
            value, self._spare = self._spare, None
            return value
        u1 = self._uniform_double()
        u2 = self._uniform_double()
        r = math.sqrt(-2.0 * math.log1p(-u2))
        theta = 2.0 * math.pi * u1
        self._spare = r * math.sin(theta)
        return r * math.cos(theta)

    def randn(self, shape) -> np.ndarray:
        """float32 standard normals of `shape`, as torch.randn(shape, generator=self) gives them."""
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise UsageError(f"noise shape {shape} has a negative size")
        n = math.prod(shape)
        if n < SMALL_NUMEL:
            values = [self._normal_double() + 0.0 for _ in range(n)]
            return np.array(values, dtype=np.float64).astype(F32).reshape(shape)
        full = n // BLOCK * BLOCK
        tail = n != full
        u = self._uniform_float(n + (BLOCK if tail else 0))
        blocks = u[:full].reshape(-1, BLOCK)
        if tail:
            # torch redraws 16 fresh uniforms for the last 16 slots, over the end of the last block
            blocks = np.concatenate([blocks, u[n:].reshape(1, BLOCK)])
        normals = FILL16[self.kernel](blocks).ravel()
        out = normals[:n].copy()
        if tail:
            out[n - BLOCK:] = normals[full:]
        return out.reshape(shape)


def randn(shape, seed: int, kernel: str = "avx2") -> np.ndarray:
    """torch.randn(shape, generator=torch.Generator('cpu').manual_seed(seed), dtype=torch.float32)."""
    return Generator(seed, kernel).randn(shape)
