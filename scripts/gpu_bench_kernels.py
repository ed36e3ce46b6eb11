"""Row norms, elementwise kernels and the causal softmax on the GPU: the library's kernels against the previous
ones (kept below, only here) at the Qwen3.5-9B encoder's shapes and strides, L = 112 and 1024 tokens.

    python scripts/gpu_bench_kernels.py --out kernels.json
    NUMBA_ENABLE_CUDASIM=1 python scripts/gpu_bench_kernels.py --tiny --out /tmp/kernels.json   # dry run

Each kernel is timed alone: a spinning kernel holds the stream while every (event, launch, event) triple is
queued, so the host's launch cost (tens of us in numba) is not in the time; the median over the launches is
reported, with the bytes the kernel must move, its GB/s and the fraction of the copy bandwidth measured here
(1 GiB device-to-device, the better of cuMemcpy and a copy kernel). New and old outputs are held to the
kernel's gate against the float64 reference, and to each other within two gates; exit 1 if any fails.
"""

import argparse
import collections
import json
import math
import statistics
import sys
import time

import numpy as np
from numba import cuda, float32

from cuda_kernels import elementwise, norms, rope_attention
from cuda_kernels.core import BLOCK, SIMULATED, from_bf16_bits, gate, jit, narrow

# encoder dimensions (Qwen3.5-9B) and a tiny set with the same structure for the simulator
FULL = dict(hidden=4096, heads=16, kv=4, hd=256, gk=16, dk=128, gv=32, dv=128, inter=12288, lengths=(112, 1024))
TINY = dict(hidden=40, heads=2, kv=1, hd=12, gk=2, dk=8, gv=2, dv=8, inter=24, lengths=(3, 5))
EPS = 1e-6


# --- the previous kernels: one block of up to 1024 threads per row; SwiGLU and the gate one element a thread
OLD_MAXBLOCK = 1024
OLD_PER = 4
OLD_WARP = 1 if SIMULATED else 32


@jit(device=True)
def _old_reduce(sh, value, maximum):
    """Sum (or max) over the block: warp shuffles, one barrier, every thread combines the warps' partials
    (simulator: a shared-memory tree)."""
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    if not SIMULATED:
        for step in (16, 8, 4, 2, 1):
            other = cuda.shfl_xor_sync(0xFFFFFFFF, value, step)
            value = max(value, other) if maximum else value + other
        if tid % 32 == 0:
            sh[tid // 32] = value
        cuda.syncthreads()
        total = sh[0]
        for w in range(1, nt // 32):
            total = max(total, sh[w]) if maximum else total + sh[w]
        cuda.syncthreads()
        return total
    sh[tid] = value
    cuda.syncthreads()
    step = nt // 2
    while step > 0:
        if tid < step:
            sh[tid] = max(sh[tid], sh[tid + step]) if maximum else sh[tid] + sh[tid + step]
        cuda.syncthreads()
        step //= 2
    total = sh[0]
    cuda.syncthreads()
    return total


@jit(device=True)
def block_sum(sh, value):
    return _old_reduce(sh, value, False)


@jit(device=True)
def block_max(sh, value):
    return _old_reduce(sh, value, True)


def _old_threads(d):
    t, most = OLD_WARP, BLOCK if SIMULATED else OLD_MAXBLOCK
    while t < most and t * OLD_PER < d:
        t *= 2
    return t


@jit(device=True)
def _old_store(out, row, i, y, bits):
    if bits:
        out[row, i] = narrow(y)
    else:
        out[row, i] = y


@jit(device=True)
def _old_silu(g):
    s = float32(1.0) / (float32(1.0) + math.exp(-g))
    return g * s


def _old_make_rms(bits):
    @jit(max_registers=64)
    def rms_norm(x, w, out, eps, offset):
        row, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        t, h = row // x.shape[1], row % x.shape[1]
        sh = cuda.shared.array(OLD_MAXBLOCK, float32)
        vals = cuda.local.array(OLD_PER, float32)
        d = x.shape[2]
        acc = float32(0.0)
        for j in range(OLD_PER):
            i = tid + j * nt
            vals[j] = x[t, h, i] if i < d else float32(0.0)
            acc += vals[j] * vals[j]
        for i in range(tid + OLD_PER * nt, d, nt):
            acc += x[t, h, i] * x[t, h, i]
        r = float32(1.0) / math.sqrt(block_sum(sh, acc) / float32(d) + eps)
        for j in range(OLD_PER):
            i = tid + j * nt
            if i < d:
                _old_store(out[t], h, i, vals[j] * r * (offset + w[i]), bits)
        for i in range(tid + OLD_PER * nt, d, nt):
            _old_store(out[t], h, i, x[t, h, i] * r * (offset + w[i]), bits)
    return rms_norm


@jit(max_registers=64)
def _old_l2(x, out, eps, scale):
    row, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    t, h = row // x.shape[1], row % x.shape[1]
    sh = cuda.shared.array(OLD_MAXBLOCK, float32)
    vals = cuda.local.array(OLD_PER, float32)
    d = x.shape[2]
    acc = float32(0.0)
    for j in range(OLD_PER):
        i = tid + j * nt
        vals[j] = x[t, h, i] if i < d else float32(0.0)
        acc += vals[j] * vals[j]
    for i in range(tid + OLD_PER * nt, d, nt):
        acc += x[t, h, i] * x[t, h, i]
    r = scale / math.sqrt(block_sum(sh, acc) + eps)
    for j in range(OLD_PER):
        i = tid + j * nt
        if i < d:
            out[t, h, i] = vals[j] * r
    for i in range(tid + OLD_PER * nt, d, nt):
        out[t, h, i] = x[t, h, i] * r


def _old_make_gated(bits):
    @jit(max_registers=64)
    def gated_rms_norm(x, z, w, out, eps):
        row, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        t, h = row // x.shape[1], row % x.shape[1]
        sh = cuda.shared.array(OLD_MAXBLOCK, float32)
        vals = cuda.local.array(OLD_PER, float32)
        d = x.shape[2]
        acc = float32(0.0)
        for j in range(OLD_PER):
            i = tid + j * nt
            vals[j] = x[t, h, i] if i < d else float32(0.0)
            acc += vals[j] * vals[j]
        for i in range(tid + OLD_PER * nt, d, nt):
            acc += x[t, h, i] * x[t, h, i]
        r = float32(1.0) / math.sqrt(block_sum(sh, acc) / float32(d) + eps)
        for j in range(OLD_PER):
            i = tid + j * nt
            if i < d:
                _old_store(out[t], h, i, w[i] * (vals[j] * r) * _old_silu(z[t, h, i]), bits)
        for i in range(tid + OLD_PER * nt, d, nt):
            _old_store(out[t], h, i, w[i] * (x[t, h, i] * r) * _old_silu(z[t, h, i]), bits)
    return gated_rms_norm


def _old_make_swiglu(bits):
    @jit
    def swiglu(gate, up, out):
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i >= out.shape[1]:
            return
        for r in range(cuda.blockIdx.y, out.shape[0], cuda.gridDim.y):
            y = elementwise.silu(gate[r, i]) * up[r, i]
            if bits:
                out[r, i] = narrow(y)
            else:
                out[r, i] = y
    return swiglu


def _old_make_sigmoid_gate(bits):
    @jit
    def sigmoid_gate(x, g, out):
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        h = cuda.blockIdx.y
        if i >= out.shape[2]:
            return
        for t in range(cuda.blockIdx.z, out.shape[0], cuda.gridDim.z):
            y = x[t, h, i] * elementwise.sigmoid(g[t, h, i])
            if bits:
                out[t, h, i] = narrow(y)
            else:
                out[t, h, i] = y
    return sigmoid_gate


@jit(max_registers=64)
def _old_softmax(s, scale, causal):
    row, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    sh = cuda.shared.array(OLD_MAXBLOCK, float32)
    vals = cuda.local.array(OLD_PER, float32)
    n_q, n_k = s.shape[1], s.shape[2]
    h, t = row // n_q, row % n_q
    last = n_k - 1
    if causal:
        last = t + n_k - n_q
    m = -math.inf
    for j in range(OLD_PER):
        i = tid + j * nt
        vals[j] = s[h, t, i] * scale if i <= last else -math.inf
        m = max(m, vals[j])
    for i in range(tid + OLD_PER * nt, last + 1, nt):
        m = max(m, s[h, t, i] * scale)
    m = block_max(sh, m)
    acc = float32(0.0)
    for j in range(OLD_PER):
        i = tid + j * nt
        vals[j] = math.exp(vals[j] - m) if i <= last else float32(0.0)
        acc += vals[j]
    for i in range(tid + OLD_PER * nt, n_k, nt):
        p = math.exp(s[h, t, i] * scale - m) if i <= last else float32(0.0)
        s[h, t, i] = p
        acc += p
    inv = float32(1.0) / block_sum(sh, acc)
    for j in range(OLD_PER):
        i = tid + j * nt
        if i < n_k:
            s[h, t, i] = vals[j] * inv
    for i in range(tid + OLD_PER * nt, last + 1, nt):
        s[h, t, i] *= inv


_OLD = {"rms": {b: _old_make_rms(b) for b in (False, True)}, "gated": {b: _old_make_gated(b) for b in (False, True)},
        "swiglu": {b: _old_make_swiglu(b) for b in (False, True)},
        "sigmoid_gate": {b: _old_make_sigmoid_gate(b) for b in (False, True)}}


def _bits(out):
    return out.dtype == np.uint16


def old_rms_norm(x, w, out, eps, offset):
    _OLD["rms"][_bits(out)][x.shape[0] * x.shape[1], _old_threads(x.shape[2])](x, w, out, np.float32(eps),
                                                                               np.float32(offset))


def old_l2_norm(x, out, eps, scale):
    _old_l2[x.shape[0] * x.shape[1], _old_threads(x.shape[2])](x, out, np.float32(eps), np.float32(scale))


def old_gated_rms_norm(x, z, w, out, eps):
    _OLD["gated"][_bits(out)][x.shape[0] * x.shape[1], _old_threads(x.shape[2])](x, z, w, out, np.float32(eps))


def old_swiglu(gate, up, out):
    rows, n = out.shape
    grid = ((n + BLOCK - 1) // BLOCK, max(1, min(rows, 2 if SIMULATED else 65535)))
    _OLD["swiglu"][_bits(out)][grid, BLOCK](gate, up, out)


def old_sigmoid_gate(x, g, out):
    n, heads, d = out.shape
    grid = ((d + BLOCK - 1) // BLOCK, heads, max(1, min(n, 2 if SIMULATED else 65535)))
    _OLD["sigmoid_gate"][_bits(out)][grid, BLOCK](x, g, out)


def old_softmax(s, scale, causal):
    _old_softmax[s.shape[0] * s.shape[1], _old_threads(s.shape[2])](s, np.float32(scale), bool(causal))


# --- inputs as the encoder hands them over ---------------------------------------------------
class Inputs:
    """Host arrays and their device copies; `view` makes the strided views the op table's split/reshape make."""

    def __init__(self, rng):
        self.rng = rng

    def matrix(self, rows, cols, scale=1.0):
        host = (self.rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        return host, cuda.to_device(host)

    @staticmethod
    def view(host, dev, start, shape, strides):
        """Elements of the matrix from column `start` as `shape` with element `strides` (host view, device view)."""
        item = host.itemsize
        hv = np.lib.stride_tricks.as_strided(host[:, start:], shape, tuple(s * item for s in strides))
        if SIMULATED:
            return hv, cuda.to_device(np.ascontiguousarray(hv))
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        block = dev[:, start:]
        return hv, DeviceNDArray(shape, tuple(s * item for s in strides), dev.dtype, gpu_data=block.gpu_data)


# a kernel's benchmark: bytes it must move, the new and old launches, the output they write, its float64
# reference and gate; reset() restores the inputs of an in-place kernel (else the output is filled with NaN)
Bench = collections.namedtuple("Bench", "name nbytes new old out ref bound reset", defaults=(None,))


def cases(dims, L, rng):
    """The Bench of each kernel at L tokens."""
    inp = Inputs(rng)
    hid, H, KV, hd = dims["hidden"], dims["heads"], dims["kv"], dims["hd"]
    gk, dk, gv, dv, inter = dims["gk"], dims["dk"], dims["gv"], dims["dv"], dims["inter"]
    w_h = (rng.standard_normal(hid) * 0.5).astype(np.float32)
    w_hd = (rng.standard_normal(hd) * 0.5).astype(np.float32)
    w_dv = (rng.standard_normal(dv) * 0.5).astype(np.float32)
    out = []

    # hidden rows [L, 1, hidden] -> bf16 bits (input/post-attention norms), and -> float32 (the final norm)
    xh, xd = inp.matrix(L, hid)
    for bits in (True, False):
        o = cuda.device_array((L, 1, hid), np.uint16 if bits else np.float32)
        x3 = xd.reshape(L, 1, hid)
        w = cuda.to_device(w_h)
        ref = norms.rms_norm_reference(xh.reshape(L, 1, hid), w_h, EPS, 1.0)
        out.append(Bench(f"rms_norm hidden -> {'bf16' if bits else 'f32'}", L * hid * (4 + (2 if bits else 4)) + hid * 4,
                    lambda x3=x3, w=w, o=o: norms.rms_norm(x3, w, o, EPS, 1.0),
                    lambda x3=x3, w=w, o=o: old_rms_norm(x3, w, o, EPS, 1.0), o, ref, norms.rms_norm_bound(ref, hid, bits)))

    # q and k heads of the attention's stacked product [L, 2 H hd | KV hd | KV hd]: q strided by 2 hd per head
    wide = 2 * H * hd + 2 * KV * hd
    ph, pd = inp.matrix(L, wide, 3.0)
    for name, start, heads, hstride in (("q", 0, H, 2 * hd), ("k", 2 * H * hd, KV, hd)):
        xv_h, xv = inp.view(ph, pd, start, (L, heads, hd), (wide, hstride, 1))
        o = cuda.device_array((L, heads, hd), np.float32)
        w = cuda.to_device(w_hd)
        ref = norms.rms_norm_reference(xv_h, w_hd, EPS, 1.0)
        out.append(Bench(f"rms_norm {name} heads", L * heads * hd * 8 + hd * 4,
                    lambda xv=xv, w=w, o=o: norms.rms_norm(xv, w, o, EPS, 1.0),
                    lambda xv=xv, w=w, o=o: old_rms_norm(xv, w, o, EPS, 1.0), o, ref, norms.rms_norm_bound(ref, hd)))

    # sigmoid gate: attention output [L, H, hd] times sigmoid of the gate half of each q_proj head -> bf16
    ah, ad = inp.matrix(L, H * hd)
    a3h, a3 = ah.reshape(L, H, hd), ad.reshape(L, H, hd)
    gh, gd = inp.view(ph, pd, hd, (L, H, hd), (wide, 2 * hd, 1))
    o = cuda.device_array((L, H, hd), np.uint16)
    ref = elementwise.sigmoid_gate_reference(a3h, gh)
    out.append(Bench("sigmoid_gate -> bf16", L * H * hd * 10, lambda o=o: elementwise.sigmoid_gate(a3, gd, o),
                lambda o=o: old_sigmoid_gate(a3, gd, o), o, ref, elementwise.sigmoid_gate_bound(ref)))

    # GDN q after the conv: a column block of the dense [L, 2 gk dk + gv dv] conv output, scaled L2 norm
    conv = 2 * gk * dk + gv * dv
    ch, cd = inp.matrix(L, conv)
    qh, qd = inp.view(ch, cd, 0, (L, gk, dk), (conv, dk, 1))
    o = cuda.device_array((L, gk, dk), np.float32)
    ref = norms.l2_norm_reference(qh, EPS, dk ** -0.5)
    out.append(Bench("l2_norm q heads", L * gk * dk * 8, lambda o=o: norms.l2_norm(qd, o, EPS, dk ** -0.5),
                lambda o=o: old_l2_norm(qd, o, EPS, dk ** -0.5), o, ref, norms.l2_norm_bound(ref, dk)))

    # gated RMSNorm: delta-rule output [L, gv, dv] dense, z a column block of [L, gv dv (qkv) | gv dv | gv | gv]
    proj = 2 * gk * dk + gv * dv + gv * dv + 2 * gv
    zh_full, zd_full = inp.matrix(L, proj, 3.0)
    zh, zd = inp.view(zh_full, zd_full, 2 * gk * dk + gv * dv, (L, gv, dv), (proj, dv, 1))
    oh, od = inp.matrix(L, gv * dv)
    o3h, o3 = oh.reshape(L, gv, dv), od.reshape(L, gv, dv)
    w = cuda.to_device(w_dv)
    o = cuda.device_array((L, gv, dv), np.uint16)
    ref = norms.gated_rms_norm_reference(o3h, zh, w_dv, EPS)
    out.append(Bench("gated_rms_norm -> bf16", L * gv * dv * 10 + dv * 4,
                lambda o=o, w=w: norms.gated_rms_norm(o3, zd, w, o, EPS),
                lambda o=o, w=w: old_gated_rms_norm(o3, zd, w, o, EPS), o, ref, norms.gated_rms_norm_bound(ref, dv, True)))

    # SwiGLU: gate and up, the two column blocks of the [L, 2 inter] product -> bf16 operand of down_proj
    uh, ud = inp.matrix(L, 2 * inter, 2.0)
    o = cuda.device_array((L, inter), np.uint16)
    g2, u2 = ud[:, :inter], ud[:, inter:]
    ref = elementwise.swiglu_reference(uh[:, :inter], uh[:, inter:])
    out.append(Bench("swiglu -> bf16", L * inter * 10, lambda o=o: elementwise.swiglu(g2, u2, o),
                lambda o=o: old_swiglu(g2, u2, o), o, ref, elementwise.swiglu_bound(ref)))

    # causal softmax in place over the attention scores [H, L, L]: reads keys up to the diagonal, writes rows
    sh_ = (rng.standard_normal((H, L, L)) * 8).astype(np.float32)
    sd = cuda.to_device(sh_)
    scale = hd ** -0.5
    ref = rope_attention.softmax_reference(sh_, scale, True)
    out.append(Bench("softmax causal (in place)", H * (L * (L + 1) // 2) * 4 + H * L * L * 4,
                     lambda: rope_attention.softmax(sd, scale, True), lambda: old_softmax(sd, scale, True), sd, ref,
                     rope_attention.softmax_bound(sh_, scale, ref), lambda: sd.copy_to_device(sh_)))
    return out


# --- timing ----------------------------------------------------------------------------------
@jit
def _spin(out, n):
    acc = float32(1.0)
    for i in range(n):
        acc = acc * float32(0.999999) + float32(1e-7)
    if acc < float32(0.0):
        out[0] = acc


@jit
def _copy(src, dst):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, src.size, stride):
        dst[i] = src[i]


class Timer:
    """Median device time of a launch, the launches queued behind a spinning kernel."""

    def __init__(self, reps):
        self.reps = reps
        self.scratch = cuda.device_array(1, np.float32)
        self.ev = [(cuda.event(), cuda.event()) for _ in range(reps)]
        self.spin_per_ms = self._calibrate()

    def _ms(self, fn):
        a, b = cuda.event(), cuda.event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    def _calibrate(self):
        if SIMULATED:
            return 0
        n = 1 << 20     # a few ms: the launch's host time is small beside it
        self._ms(lambda: _spin[1, 1](self.scratch, n))
        return int(n / max(self._ms(lambda: _spin[1, 1](self.scratch, n)), 1e-3))

    def median_us(self, fn, warm=5):
        for _ in range(warm):
            fn()
        cuda.synchronize()
        with cuda.defer_cleanup():
            # enough spinning to cover queueing every launch (about 0.2 ms of host time each, generously)
            if self.spin_per_ms:
                _spin[1, 1](self.scratch, int(self.spin_per_ms * (5 + 0.2 * self.reps)))
            for a, b in self.ev:
                a.record()
                fn()
                b.record()
            self.ev[-1][1].synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in self.ev) * 1e3

    def copy_gbps(self, nbytes):
        """Device-to-device copy bandwidth (bytes read + written per second) for nbytes: cuMemcpy, copy kernel."""
        n = nbytes // 4
        src, dst = cuda.device_array(n, np.float32), cuda.device_array(n, np.float32)
        blocks = 2 if SIMULATED else 16 * cuda.get_current_device().MULTIPROCESSOR_COUNT
        _copy[blocks, BLOCK](src, dst)
        src.copy_to_device(dst)
        cuda.synchronize()
        rates = {}
        for name, fn in (("memcpy", lambda: dst.copy_to_device(src)), ("kernel", lambda: _copy[blocks, BLOCK](src, dst))):
            ms = statistics.median(self._ms(fn) for _ in range(10))
            rates[name] = 2 * n * 4 / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")
        return rates


def _poison(o):
    """Fill an output with NaN (bf16 NaN bits for uint16) so that an element a kernel does not write fails."""
    fill = np.uint16(0x7FC0) if o.dtype == np.uint16 else np.float32("nan")
    o.copy_to_device(np.full(o.shape, fill, o.dtype))


def _host(o):
    h = o.copy_to_host()
    return from_bf16_bits(h) if o.dtype == np.uint16 else h.astype(np.float64)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, few launches (the simulator's dry run)")
    parser.add_argument("--reps", type=int, default=100)
    args = parser.parse_args(argv)
    dims = TINY if args.tiny else FULL
    reps = 3 if args.tiny else max(50, args.reps)
    rng = np.random.default_rng(0)
    timer = Timer(reps)
    copy = timer.copy_gbps(1 << 10 if args.tiny else 1 << 30)
    peak = max(copy.values())
    device = "simulator" if SIMULATED else cuda.get_current_device().name
    device = device.decode() if isinstance(device, bytes) else str(device)
    print(f"device {device}; copy bandwidth (read + write): memcpy {copy['memcpy']:.0f} GB/s, "
          f"kernel {copy['kernel']:.0f} GB/s")
    print("| kernel | L | old us | new us | speedup | bytes | new GB/s | of copy | gate new | gate old | new vs old |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows, ok = [], True
    for L in dims["lengths"]:
        for name, nbytes, new, old, out, ref, bound, reset in cases(dims, L, rng):
            start = time.perf_counter()
            reset = reset or (lambda: _poison(out))
            reset()
            old()
            got_old = _host(out)
            reset()
            new()
            got_new = _host(out)
            pass_new, worst_new = gate(got_new, ref, bound)
            pass_old, worst_old = gate(got_old, ref, bound)
            agree, worst_pair = gate(got_new, got_old.reshape(got_new.shape), 2 * bound)
            t_old, t_new = timer.median_us(old), timer.median_us(new)
            gbps = nbytes / (t_new * 1e-6) / 1e9 if t_new > 0 else float("nan")
            row = {"kernel": name, "L": L, "old_us": t_old, "new_us": t_new, "bytes": nbytes, "new_GBps": gbps,
                   "fraction_of_copy": gbps / peak, "gate_new": pass_new, "worst_new": worst_new,
                   "gate_old": pass_old, "worst_old": worst_old, "agree": agree, "worst_new_vs_old": worst_pair,
                   "wall_s": time.perf_counter() - start}
            rows.append(row)
            ok &= pass_new and agree
            print(f"| {name} | {L} | {t_old:.1f} | {t_new:.1f} | {t_old / t_new if t_new > 0 else float('nan'):.2f} | "
                  f"{nbytes / 1e6:.2f} MB | {gbps:.0f} | {gbps / peak:.2f} | "
                  f"{'pass' if pass_new else 'FAIL'} ({worst_new:.2g}) | {'pass' if pass_old else 'FAIL'} "
                  f"({worst_old:.2g}) | {'agree' if agree else 'DIFFER'} ({worst_pair:.2g}) |")
            sys.stdout.flush()
    def finite(v):     # strict JSON: no NaN (the simulator times nothing)
        return v if not isinstance(v, float) or math.isfinite(v) else None
    result = {"device": device, "reps": reps, "copy_GBps": {k: finite(v) for k, v in copy.items()},
              "rows": [{k: finite(v) for k, v in r.items()} for r in rows], "ok": bool(ok)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, allow_nan=False)
    print("all gates pass" if ok else "SOME GATE FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
