"""What every kernel module shares: the jit wrapper, bf16 bits <-> float32, block reductions, the gate.

Importing this module imports numba.cuda; the simulator is chosen by NUMBA_ENABLE_CUDASIM=1 before that.
"""

import hashlib
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from numba import config, cuda, float32, uint16, uint32, uint64

from . import prebuilt

SIMULATED = bool(config.ENABLE_CUDASIM)
if SIMULATED:            # thread blocks that wait on their barrier instead of polling it (sim_barrier)
    from . import sim_barrier
    sim_barrier.install()

# The simulator's jit() rejects these keyword arguments (numba_cuda.md section 7.6).
_GPU_ONLY_KWARGS = ("lineinfo", "launch_bounds", "max_registers", "forceinline", "lto")

# One block size for every block-per-row kernel; the simulator pays ~0.2 ms per thread, so it gets few.
BLOCK = 32 if SIMULATED else 256
SHARED = BLOCK if SIMULATED else BLOCK // 32    # floats of shared memory team_sum needs in a BLOCK-thread block
EPS32 = float(np.finfo(np.float32).eps) / 2      # unit roundoff of float32
EPS16 = 2.0 ** -8                                # unit roundoff of bfloat16


def _cache_dir(sources=Path(__file__).parent):
    """Where compiled kernels are kept between processes: NUMBA_CACHE_DIR when set, else a folder named by a
    hash of this package's sources. numba keys a cached kernel by its own file's time stamp only, so an edit
    to a device function in another module would reuse a stale kernel; the hash makes any edit a new folder.
    MOSS_KERNEL_CACHE=0 turns the cache off."""
    if os.environ.get("MOSS_KERNEL_CACHE", "1") == "0":
        return None
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(root / "moss-cli" / "kernels" / prebuilt.sources_digest(sources)[:16])


CACHE_DIR = None if SIMULATED else _cache_dir()
if CACHE_DIR:
    from numba.cuda.core import config as _cuda_config
    _cuda_config.CACHE_DIR = CACHE_DIR


_CACHE_WRITABLE = []


def _cache_writable():
    """Whether CACHE_DIR can be made and written (checked once). Where it cannot, kernels are not cached at
    all: numba would fall back to a __pycache__ beside the sources, keyed by time stamps, or fail."""
    if not _CACHE_WRITABLE:
        try:
            os.makedirs(CACHE_DIR, exist_ok=True)
            _CACHE_WRITABLE.append(os.access(CACHE_DIR, os.W_OK))
        except OSError:
            _CACHE_WRITABLE.append(False)
    return _CACHE_WRITABLE[0]


def _closure_bytes(func):
    """The values a kernel factory closed `func` over, as bytes that are the same in every process: a device
    function among them by its code and, recursively, its own closure (numba's cache key pickles it, and a
    pickled device function can differ between processes, which made the flash kernel a cache miss in
    every process); any other value pickled."""
    from numba.cuda.serialize import dumps
    parts = []
    for name, cell in zip(func.__code__.co_freevars, func.__closure__ or ()):
        value = cell.cell_contents
        inner = getattr(value, "py_func", None)
        if inner is not None:
            code = inner.__code__
            parts.append(b"F" + name.encode() + code.co_code + repr((code.co_consts, code.co_names)).encode()
                         + _closure_bytes(inner))
        else:
            parts.append(b"V" + name.encode() + dumps(value))
    return b"\0".join(parts)


def _index_key(func, sig, codegen):
    """numba's cache index key for kernel `func` (signature, target, numba-cuda's version, code and closure)
    with the closure as _closure_bytes: a kernel compiled once loads from the disk in later processes. The
    sources themselves are in the cache folder's name (_cache_dir)."""
    import numba_cuda
    return (sig, codegen.magic_tuple(), numba_cuda.__version__, _digests(func))


def _digests(func):
    """(sha256 of a kernel's code, of its closure as _closure_bytes): its part of every key it is stored by."""
    digest = lambda b: hashlib.sha256(b).hexdigest()       # noqa: E731
    return digest(func.__code__.co_code), digest(_closure_bytes(func))


def _prebuilt_first(dispatcher, cache):
    """Make `cache` look a kernel up in the prebuilt files (prebuilt.py) before its own folder."""
    own = cache.load_overload

    def load_overload(sig, target_context):
        kernel = prebuilt.load(dispatcher.py_func, sig)
        return kernel if kernel is not None else own(sig, target_context)
    cache.load_overload = load_overload
    return cache


def _cached(dispatcher):
    """Take the kernel's compiled code from the prebuilt files, else keep it on disk; a kernel numba cannot
    pickle (linked code) is compiled each process instead of failing. Where the folder cannot be written the
    prebuilt files still serve."""
    if not CACHE_DIR or getattr(dispatcher, "targetoptions", {}).get("device"):
        return dispatcher
    if not _cache_writable():
        from numba.cuda.core.caching import NullCache
        dispatcher._cache = _prebuilt_first(dispatcher, NullCache())
        return dispatcher
    try:
        dispatcher.enable_caching()
    except (RuntimeError, OSError):       # no usable cache location: compile each process
        return dispatcher
    cache, save = _prebuilt_first(dispatcher, dispatcher._cache), dispatcher._cache.save_overload
    cache._index_key = lambda sig, codegen: _index_key(dispatcher.py_func, sig, codegen)

    def save_or_skip(sig, data):
        try:
            save(sig, data)
        except (RuntimeError, TypeError, OSError, pickle.PicklingError):
            pass
    cache.save_overload = save_or_skip
    return dispatcher


def ptx_op(text, result, operand, constraints, doc):
    """A device intrinsic of one inline-PTX instruction on one operand (numba types float32 or uint16, the
    inline-asm constraints in LLVM's spelling, e.g. "=f,f"). The simulator cannot run inline PTX: callers keep
    a statement of the instruction for it."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic
    lowered = {types.float32: ir.FloatType(), types.uint16: ir.IntType(16)}

    @intrinsic
    def op(typingctx, x):
        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(lowered[result], [lowered[operand]]), text, constraints,
                               side_effect=False)
            return builder.call(asm, args)
        return result(operand), codegen
    op.__doc__ = doc
    return op


def jit(*args, **kwargs):
    """numba.cuda.jit that drops the keyword arguments the simulator does not accept, and keeps kernels'
    compiled code on disk (_cache_dir)."""
    if SIMULATED:
        for key in _GPU_ONLY_KWARGS:
            kwargs.pop(key, None)
        return cuda.jit(*args, **kwargs)
    if args and callable(args[0]):
        return _cached(cuda.jit(*args, **kwargs))
    decorate = cuda.jit(*args, **kwargs)
    return lambda func: _cached(decorate(func))


def allow_shared(kernel, args, nbytes):
    """Let `kernel` (compiled now for `args` if it is not yet) take `nbytes` of dynamic shared memory: past
    48 KB a kernel must ask for it (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES). The simulator has no
    such limit."""
    if SIMULATED or nbytes <= 48 * 1024:
        return
    from numba.cuda.cudadrv.driver import binding, driver
    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    func = compiled._codelibrary.get_cufunc()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, int(nbytes), func.handle, func.device.id)


@jit(device=True, forceinline=True)
def as_float32(bits):
    """The float32 whose bits are `bits` (uint32): a reinterpretation, no conversion."""
    buf = cuda.local.array(1, uint32)
    buf[0] = bits
    return buf.view(np.float32)[0]


@jit(device=True, forceinline=True)
def float32_bits(x):
    """The bits of float32 x as a uint32 (as_float32's inverse)."""
    buf = cuda.local.array(1, float32)
    buf[0] = x
    return buf.view(np.uint32)[0]


@jit(device=True)
def widen(bits):
    """bf16 bits (uint16) -> float32: the bf16 is the high half of the float32. (Its own reinterpretation:
    through as_float32 the packed swiglu's sm_90 code grows by 8 instructions, RESOURCES.json.)"""
    buf = cuda.local.array(1, uint32)
    buf[0] = uint32(bits) << uint32(16)
    return buf.view(np.float32)[0]


@jit(device=True)
def narrow(x):
    """float32 -> bf16 bits, round to nearest even (NaN not special-cased)."""
    b = float32_bits(x)
    b = b + uint32(0x7FFF) + ((b >> uint32(16)) & uint32(1))
    return uint16(b >> uint32(16))


# Row teams: team threads per row (a power of two), about TEAM_PER of the row's elements each in registers,
# up to TEAM_PER_MAX once the team is a whole block. The simulator pays per thread and has no shuffles: small
# teams there, and rows longer than team x per (read twice) already at tiny sizes.
TEAM_MIN, TEAM_MAX = (8, 8) if SIMULATED else (16, BLOCK)
TEAM_PER, TEAM_PER_MAX = (4, 4) if SIMULATED else (8, 16)


def row_team(d):
    """(team, per) for rows of d elements; BLOCK // team rows per block."""
    team = TEAM_MIN
    while team < TEAM_MAX and team * TEAM_PER < d:
        team *= 2
    return team, max(1, min(TEAM_PER_MAX, -(-d // team)))


@jit(device=True, forceinline=True)
def team_row(rows, team):
    """This thread's (row, clamped to the last, as uint64; its lane in the row's team; whether the row exists)
    where a team of `team` threads takes a row and a block BLOCK // team rows. A thread past the last row
    still joins its team's sums (on the last row's values) and returns before it stores."""
    row = cuda.blockIdx.x * (BLOCK // team) + cuda.threadIdx.x // team
    return uint64(min(row, rows - 1)), cuda.threadIdx.x % team, row < rows


@jit(device=True, forceinline=True)
def team_reduce(sh, value, team, maximum):
    """Sum (or max) of `value` over each aligned group of `team` threads (a power of two dividing blockDim.x,
    a multiple of 32; every thread of the block calls it). GPU: xor shuffles (they stay inside an aligned
    team), and teams wider than a warp combine their warps' partials through sh (>= blockDim.x / 32 floats).
    Simulator: a tree in sh (>= blockDim.x floats)."""
    tid = cuda.threadIdx.x
    if not SIMULATED:
        for step in (16, 8, 4, 2, 1):
            if step < team:
                other = cuda.shfl_xor_sync(0xFFFFFFFF, value, step)
                value = max(value, other) if maximum else value + other
        if team <= 32:
            return value
        if tid % 32 == 0:
            sh[tid // 32] = value
        cuda.syncthreads()
        first = (tid - tid % team) // 32
        total = sh[first]
        for w in range(1, team // 32):
            total = max(total, sh[first + w]) if maximum else total + sh[first + w]
        cuda.syncthreads()
        return total
    sh[tid] = value
    cuda.syncthreads()
    step = team // 2
    while step > 0:
        if tid % team < step:
            sh[tid] = max(sh[tid], sh[tid + step]) if maximum else sh[tid] + sh[tid + step]
        cuda.syncthreads()
        step //= 2
    total = sh[tid - tid % team]
    cuda.syncthreads()
    return total


@jit(device=True, forceinline=True)
def team_sum(sh, value, team):
    return team_reduce(sh, value, team, False)


@jit(device=True, forceinline=True)
def team_max(sh, value, team):
    return team_reduce(sh, value, team, True)


class DeviceView:
    """The memory of `base` (anything with a __cuda_array_interface__) seen with another shape, byte strides
    (None: C-contiguous) or element type (a typestr such as "<u8"; None: base's), without a copy. It keeps
    base alive; cuda.as_cuda_array makes it a numba device array."""

    def __init__(self, base, shape, strides=None, typestr=None):
        face = base.__cuda_array_interface__
        self.base = base
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr or face["typestr"],
            "strides": None if strides is None else tuple(strides),
            "data": (face["data"][0], False), "version": 3, "stream": None}


def columns(x, start, stop):
    """x[..., start:stop] of a device array, as a view. numba's own slicing visits every contiguous run of a
    strided result in Python (a column block of an [L, N] matrix costs L steps of host time, which a graph's
    capture pays per view); this makes the view from its shape, strides and byte span at once."""
    index = (slice(None),) * (x.ndim - 1) + (slice(start, stop),)
    if SIMULATED:
        return x[index]
    if not 0 <= start <= stop <= x.shape[-1]:
        raise IndexError(f"columns [{start}, {stop}) of an array of shape {x.shape}")
    shape = tuple(x.shape[:-1]) + (stop - start,)
    if 0 in shape:
        return x[index]
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    offset = start * x.strides[-1]
    span = x.dtype.itemsize + sum((n - 1) * s for n, s in zip(shape, x.strides))
    return DeviceNDArray(shape, x.strides, x.dtype, stream=x.stream,
                         gpu_data=x.gpu_data.view(offset, offset + span))


def heads_view(rows, start, heads, d):
    """Columns [start, start + heads d) of a device matrix as a strided [L, heads, d] view, as the graph
    hands a column block of a stacked product to a kernel (numba's reshape refuses strided arrays)."""
    block = columns(rows, start, start + heads * d) if rows.ndim == 2 else rows[:, start:start + heads * d]
    if SIMULATED:
        return block.reshape(rows.shape[0], heads, d)
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    item = block.dtype.itemsize
    return DeviceNDArray((rows.shape[0], heads, d), (block.strides[0], d * item, item), block.dtype,
                         gpu_data=block.gpu_data)


def bf16_bound(bound):
    """The bound of a float32 result within `bound` (relative) once rounded to bf16 bits: the rounding
    adds half a bf16 ulp of the float32 value, itself within (1 + bound) of the exact one."""
    return bound + EPS16 * (1 + bound)


def gamma(n, u=EPS32):
    """Higham's gamma_n = n u / (1 - n u): the error factor of an n-term float sum or dot product."""
    return n * u / (1.0 - n * u)


# --- host-side bf16 helpers (tests, references, weight upload) -------------------------------
def to_bf16_bits(x):
    """float array -> bf16 bits (uint16), round to nearest even, through ml_dtypes."""
    import ml_dtypes
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def from_bf16_bits(bits):
    """bf16 bits (uint16) -> float64, exact."""
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


@dataclass
class Case:
    """One kernel's contract: inputs, its float64 reference, its gate, and the planted control.

    `run(inputs, control)` launches the kernel (control=True: the planted wrong variant) and returns
    the host result; `reference(inputs)` returns (expected float64, bound float64), the gate passes
    when |result - expected| <= bound everywhere and nothing is NaN.
    """
    name: str
    make: Callable            # (rng, size: "tiny" | "real") -> dict of host arrays and scalars
    run: Callable             # (inputs, control: bool) -> np.ndarray
    reference: Callable       # inputs -> (expected, bound)
    simulator: bool = True    # runs in the numba CUDA simulator
    notes: str = field(default="")


def gate(result, expected, bound):
    """True when every element is within its bound (and finite); also returns the worst ratio."""
    result = np.asarray(result, dtype=np.float64)
    if result.shape != expected.shape or not np.all(np.isfinite(result)):
        return False, float("inf")
    ratio = np.abs(result - expected) / np.maximum(bound, np.finfo(np.float64).tiny)
    worst = float(ratio.max()) if ratio.size else 0.0
    return worst <= 1.0, worst
