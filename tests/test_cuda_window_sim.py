"""The device window of streamed layers (moss_cli/memory/window.py) in the numba CUDA simulator: products read
through it equal the resident products byte for byte, in the eager pass that records the layers' order and in
the pass that prefetches each next layer on the side stream; a window that puts a neighbouring layer's matrices
in the slot (the planted control) changes the outputs; a pass that stops before its planned layers is refused
(a copy never waited for would leave a graph's side branch open)."""

from sim_util import simulated_lines

SCRIPT = r'''
import ml_dtypes
import numpy as np
from moss_cli.ops.cuda.table import CudaOps
from moss_cli.gpu.capture import make_window
from moss_cli.memory import window as cuda_window
from cuda_kernels.core import from_bf16_bits

rng = np.random.default_rng(0)
tensors = {"embed.weight": rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)}
names = ["embed.weight"]
for i in range(4):
    p = f"layers.{i}."
    tensors[p + "norm.weight"] = rng.standard_normal(16).astype(np.float32)
    for n, rows in (("a", 16), ("b", 8), ("c", 8)):
        tensors[p + n + ".weight"] = rng.standard_normal((rows, 16)).astype(ml_dtypes.bfloat16)
    names += [p + "norm.weight", p + "a.weight", (p + "b.weight", p + "c.weight")]
x0 = rng.standard_normal((5, 16)).astype(np.float32)


def linear(x, w):
    # the simulator has no cuBLAS: the product on the host, from the bits the device array holds now
    return x @ from_bf16_bits(w.copy_to_host()).T


def forward(ops, layers=range(4)):
    x = linear(x0, ops.param(tensors, "embed.weight"))
    for i in layers:
        p = f"layers.{i}."
        x = linear(x, ops.param(tensors, p + "a.weight"))
        stack = ops.params(tensors, [p + "b.weight", p + "c.weight"])
        y = linear(x, stack.weight)
        x = np.concatenate([y[:, :stack.sizes[0]] * ops.param(tensors, p + "norm.weight").copy_to_host()[:8],
                            y[:, stack.sizes[0]:]], axis=1)
    return x


resident = forward(CudaOps())
ops = CudaOps()
ops.window = make_window(tensors, names, (1, 2, 3))
print("host arenas", sorted(ops.window.host), "slots", len(ops.window.slots))
ops.window.begin(ops)
eager = forward(ops)
order = ops.window.finish()
print("order", order, "eager equal", eager.tobytes() == resident.tobytes())
ops.window.begin(ops, order)
prefetched = forward(ops)
ops.window.finish()
print("prefetched equal", prefetched.tobytes() == resident.tobytes())
print("unbracketed equal", forward(ops).tobytes() == resident.tobytes())

ops.window.begin(ops, order)
try:
    forward(ops, layers=range(2))
    ops.window.finish()
except RuntimeError as e:
    print("short pass refused:", "never waited" in str(e))

real = cuda_window.Window._copy
cuda_window.Window._copy = lambda self, layer, t, stream: real(self, {1: 2, 2: 3, 3: 1}[layer], t, stream)
bad = CudaOps()
bad.window = make_window(tensors, names, (1, 2, 3))
bad.window.begin(bad)
print("planted neighbour equal", forward(bad).tobytes() == resident.tobytes())
'''


def test_streamed_layers_give_the_resident_products_and_a_wrong_layer_is_caught():
    lines = simulated_lines(SCRIPT, timeout=300)
    assert lines == ["host arenas [1, 2, 3] slots 2", "order [1, 2, 3] eager equal True", "prefetched equal True",
                     "unbracketed equal True", "short pass refused: True", "planted neighbour equal False"]
