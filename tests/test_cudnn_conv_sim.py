"""The decoder's experimental cuDNN convolutions (cuda_kernels.cudnn_conv, conv2d with convs="cudnn") in the
numba CUDA simulator, with a stand-in for cuDNN's Python graph API that carries out each graph on the host
as its tensors are declared (dims, element strides, pre/post padding, the fused add) from the raw pointers
it is given: the split images, the windows, their weights, the chunks' halo rows and the accumulation are
held against the float64 convolution, within the split product's bound. Planted controls: a stand-in that
drops the fused add (no accumulation), and windows that leave out hi.w_lo, fail the same gate. plan_convs' windows
are checked on their own: they cover each split part's channels once, within the K limit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

SCRIPT = r'''
import ctypes, sys, types
import numpy as np
from numba import cuda
from cuda_kernels import conv, cudnn_conv, sdpa
from cuda_kernels.core import gate
from moss_cli.ops import cuda_conv
from moss_cli.ops.cuda_decoder import DecoderOps

PLANT = sys.argv[1]
cudnn_conv.FIRST = sys.argv[2]


def address(a):
    return a.__array_interface__["data"][0]


class T:
    def __init__(self, dim=None, stride=None, kind=None, inputs=()):
        self.dim, self.stride, self.kind, self.inputs = dim, stride, kind, inputs

    def set_output(self, flag):
        return self

    def set_dim(self, dim):
        self.dim = dim
        return self

    def set_stride(self, stride):
        self.stride = stride
        return self

    def set_data_type(self, dtype):
        self.dtype = dtype
        return self


def view(ptr, dtype, dim, stride):
    """A numpy view of memory at ptr with these dims and element strides."""
    item = np.dtype(dtype).itemsize
    span = 1 + sum((d - 1) * s for d, s in zip(dim, stride))
    flat = np.ctypeslib.as_array(((ctypes.c_uint16 if item == 2 else ctypes.c_float) * span).from_address(ptr))
    flat = flat.view(dtype) if item == 2 else flat
    return np.lib.stride_tricks.as_strided(flat, dim, [s * item for s in stride])


class Graph:
    def __init__(self, **kwargs):
        pass

    def tensor(self, name, dim, stride, data_type):
        return T(dim, stride, "input")

    def conv_fprop(self, image, weight, pre_padding, post_padding, stride, dilation, compute_data_type, name):
        self.conv = (image, weight, pre_padding, post_padding)
        return T(kind="conv")

    def mul(self, a, b, compute_data_type, name):
        self.one = b
        return T(kind="mul", inputs=(a, b))

    def add(self, a, b, compute_data_type, name):
        self.z = b
        return T(kind="add", inputs=(a, b))

    def __getattr__(self, name):
        if name in ("validate", "build_operation_graph", "create_execution_plans", "check_support", "build_plans"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def get_workspace_size(self):
        return 64 if PLANT.startswith("stale") or PLANT == "workspace overrun" else 0

    def execute(self, pack, workspace, handle=None):
        image, weight, pre, post = self.conv
        x = view(pack[image], np.float16, image.dim, image.stride).astype(np.float64)[0]      # [C, H, W]
        if PLANT == "rows shifted":      # an engine that reads the image one row low
            x = np.concatenate([x[:, 1:], x[:, -1:]], axis=1)
        if PLANT == "reads before its image":   # the first pixel taken from the one before the image
            x[:, 0, 0] = view(pack[image] - 2 * image.stride[3], np.float16, [x.shape[0]], [1]).astype(np.float64)
        w = view(pack[weight], np.float16, weight.dim, weight.stride).astype(np.float64)      # [O, C, R, S]
        x = np.pad(x, ((0, 0), (pre[0], post[0]), (pre[1], post[1])))
        o, _, r, s = w.shape
        h, wd = x.shape[1] - r + 1, x.shape[2] - s + 1
        y = np.zeros((o, h, wd))
        for i in range(r):
            for j in range(s):
                y += np.einsum("oc,chw->ohw", w[:, :, i, j], x[:, i:i + h, j:j + wd])
        out = [t for t in pack if t.kind in ("conv", "add", "mul")][0]
        if getattr(self, "one", None) is not None:
            y *= view(pack[self.one], np.float32, [1], [1])[0]
        if out.kind == "add" and PLANT != "no add":
            y += view(pack[self.z], np.float32, self.z.dim, self.z.stride)[0]
        if PLANT.startswith("stale"):    # an engine with a flag in its workspace that must start at 0, left at 1
            flag = view(workspace, np.float32, [1], [1])
            y += 1000.0 * (flag[0] != 0)
            flag[0] = 1.0
        view(pack[out], np.float32, out.dim, out.stride)[0][...] = y.astype(np.float32)
        if PLANT == "workspace overrun":        # one byte past the size it asked for
            view(workspace + 64, np.float16, [1], [1])[0] = 1.0
        if PLANT == "output overrun":           # one value past the output
            view(pack[out] + 4 * o * h * wd, np.float32, [1], [1])[0] = 0.0


fake = types.ModuleType("cudnn")
fake.pygraph = Graph
fake.data_type = types.SimpleNamespace(HALF="half", FLOAT="float")
fake.heur_mode = types.SimpleNamespace(A="a", FALLBACK="fallback")
fake.create_handle = lambda: "handle"
fake.set_stream = lambda handle, stream: None
fake.backend_version = lambda: 0
fake.__version__ = "stand-in"
sys.modules["cudnn"] = fake
sdpa._state.clear()
cudnn_conv.pointer = address
if PLANT == "check":
    ok, _ = sdpa.available()
    plan = cudnn_conv._Plan(5, 4, 128, 8, 3, 136, True)
    right = cudnn_conv.check(plan, 5, 4, 128, 8, 3, 136)
    PLANT = "no add"
    print("check", right, cudnn_conv.check(plan, 5, 4, 128, 8, 3, 136))
    sys.exit(0)
if PLANT == "stale workspace, no memset":
    cudnn_conv._zero = lambda *args: None
if PLANT == "no hi.w_lo":
    whole = cudnn_conv.plan_convs
    cudnn_conv.plan_convs = lambda c, taps: [v for v in whole(c, taps) if v[2] == 0]
conv.COLUMN_BYTES = 3 * 4 * 2 * 128 * 2      # a few rows a chunk: halo rows between chunks

rng = np.random.default_rng(3)
ops = DecoderOps()
ops.convs = "cudnn"
worst = 0.0
for c, o, h, w, taps, kind in ((5, 3, 7, 4, 3, "plain"), (5, 3, 4, 3, 3, "up"), (8, 6, 5, 4, 3, "norm"),
                               (130, 9, 3, 4, 3, "plain"), (6, 3, 5, 4, 1, "plain")):
    x = (rng.standard_normal((c, h, w)) * 3).astype(np.float32)
    wt = (rng.standard_normal((o, c, taps, taps)) / np.sqrt(c * taps * taps)).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32)
    xd, wd, bd = cuda.to_device(x), cuda.to_device(wt), cuda.to_device(b)
    src, ref_in, up = xd, x, False
    if kind == "up":
        src, up = cuda_conv.Upsampled(xd), True
    elif kind == "norm":
        gw, gb = (1 + 0.3 * rng.standard_normal(c)).astype(np.float32), (0.3 * rng.standard_normal(c)).astype(np.float32)
        src = ops.group_norm_silu(xd, 4, cuda.to_device(gw), cuda.to_device(gb), 1e-6)
        ref_in = conv.group_norm_reference(x, gw, gb, 4, 1e-6, True)
    got = ops.host(ops.conv2d(src, wd, bd, padding=taps // 2))
    ref = conv.conv2d_reference(ref_in, wt, b, taps // 2, up)
    terms = conv.conv2d_reference(np.abs(ref_in), np.abs(wt), np.abs(b), taps // 2, up)
    bound = conv.product_bound(terms, c * taps * taps, float(np.abs(ref_in).max() * np.abs(wt).max()))
    if kind == "norm":
        bound = bound + conv.conv2d_reference(conv.group_norm_bound(x, gw, gb, 4, True), np.abs(wt), None, taps // 2)
    ok, ratio = gate(got, ref, bound)
    worst = max(worst, ratio)
    print(kind, c, o, h, w, taps, "pass" if ok else "FAIL", f"{ratio:.3g}")
print("worst", worst)
print("refused", len(ops.__dict__.get("cudnn_refused", {})))
print("zeroed", len(sdpa._state.get("zeroed", [])))
'''


def test_windows_cover_each_part_once_within_the_k_limit():
    from cuda_kernels import conv, cudnn_conv
    for c in (3, 32, 96, 130, 192, 384, 512):
        for taps in (1, 3):
            p = conv.part(c)
            plan = cudnn_conv.plan_convs(c, taps)
            # nonzero columns within SLICE_K; windows of PART channels at multiples of PART, or the whole pixel
            assert all(taps * taps * min(n, 2 * c) <= conv.SLICE_K for first, n, _ in plan), (c, taps, plan)
            assert all((n == conv.PART or (first, n) in ((0, 2 * p), (0, p))) and first % conv.PART == 0
                       for first, n, _ in plan), (c, taps, plan)
            hi_w = [j for first, n, which in plan if which == 0 for j in range(first, first + n) if j < c or p <= j < p + c]
            lo_w = [j for first, n, which in plan if which == 1 for j in range(first, first + n) if j < c]
            assert sorted(hi_w) == list(range(c)) + list(range(p, p + c)), (c, taps, plan)
            assert sorted(lo_w) == list(range(c)), (c, taps, plan)
            assert all(first + n <= 2 * p and (which == 0 or first + n <= p) for first, n, which in plan)
    assert len(cudnn_conv.plan_convs(96, 3)) == 2            # [hi | 0 | lo | 0] in one window, then hi . w_lo
    assert len(cudnn_conv.plan_convs(384, 1)) == 2
    assert len(cudnn_conv.plan_convs(384, 3)) == 9


def _run(plant, first="plain"):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCRIPT, plant, first], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("first", ["plain", "scale", "zero"])
def test_cudnn_convolutions_match_float64_through_a_stand_in(first):
    """cudnn_conv.FIRST: the first convolution of each sum alone, times a device 1, or plus a zero buffer."""
    out = _run("none", first)
    assert "FAIL" not in out and out.count("pass") == 5, out


def test_planted_plan_bug_fails_the_same_gate():
    """Windows that leave out hi.w_lo (about 2^-12 of the product): the 130-channel case's bound (float32 sums
    over 1170 terms, at their worst) is wider than that, so the plant fails the four narrow cases."""
    out = _run("no hi.w_lo")
    assert out.count("FAIL") == 4 and "refused 0" in out, out


@pytest.mark.parametrize("plant", ["no add", "rows shifted", "reads before its image", "workspace overrun",
                                   "output overrun"])
def test_a_faulty_engine_fails_its_check_and_the_columns_take_its_convs(plant):
    """cudnn_conv.check, run on each plan as it is built: an engine that drops the fused add, reads the image a
    row low or a pixel before its start, or writes past its workspace or its output, fails it; those
    geometries go to the columns and the pixels still meet the gate."""
    out = _run(plant)
    assert "FAIL" not in out and out.count("pass") == 5 and "refused 0" not in out, out


def test_the_check_passes_a_right_engine_and_fails_a_planted_one_by_far():
    """The check's own numbers through the stand-in: a right engine far inside the bound, a dropped add far
    outside it."""
    out = _run("check")
    right, dropped = (float(v) for v in out.split("check")[1].split())
    assert right < 1e-3 and dropped > 10, out


def test_an_engine_that_needs_a_zeroed_workspace_gets_a_memset_before_each_run():
    """A stand-in engine that keeps a flag in its workspace, wrong unless it starts at 0 and left at 1 (as an
    engine's split-K semaphores would be): its check fails with noise in the workspace and passes with zeros, so
    each run is preceded by a memset and every case meets the gate. Control: the same without the memset fails
    from each chunk's second convolution on."""
    out = _run("stale workspace")
    assert "FAIL" not in out and out.count("pass") == 5 and "refused 0" in out and "zeroed 0" not in out, out
    out = _run("stale workspace, no memset")
    assert "FAIL" in out, out
