"""Probe (GPU): can cuDNN run the decoder's split convolutions, fp16 operands with float32 output, and how
fast, at the decoder's shapes? It decides whether the decoder's columns (im2col through memory) can give way
to cuDNN's implicit-GEMM convolutions.

    python scripts/probe_cudnn_conv.py [--out FILE]

For each (C, O, H): the split image X = [x_hi | x_lo | x_hi] (fp16 NHWC, 3C channels) and weight W =
[w_hi | w_hi | w_lo] (fp16 KRSC) of random float32 x, w; three forms, each timed (CUDA events, median of 10)
and held against the float64 conv of the same fp16 values (relative L2 and max relative error):
  * one:     one cuDNN conv over all 3C channels, float32 Y (K = 9 * 3C in one accumulation);
  * sliced:  channel slices of at most SLICE channels (K <= 9 * SLICE), each its own packed NHWC image, Y of
             each slice added to the last through a fused pointwise add (Y = conv + Z), ping-pong buffers;
  * strided: the same slices read as channel windows of the one 3C image (non-packed NHWC), if cuDNN takes them;
and beside them torch's own conv of the same shape in fp16 (fp16 out) and TF32 as the rates to expect. A
form cuDNN refuses is reported with its error. Writes JSON (default probe_cudnn_conv.json).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from cuda_kernels.sdpa import build  # noqa: E402
from torch_timing import median_ms  # noqa: E402

SHAPES = ((96, 96, 1024), (192, 192, 512), (384, 384, 256), (384, 384, 128), (192, 96, 1024))
SLICE = 224            # channels a slice: K = 9 * 224 = 2016 <= 2048, the split product's slice


class Conv:
    """One cuDNN graph: Y [1, O, H, W] float32 NHWC = conv3x3(X, W) (+ Z), X and W fp16 with given strides."""

    def __init__(self, handle, c, o, h, x_stride, add):
        import cudnn
        f16, f32 = cudnn.data_type.HALF, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=f16, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        self.x = g.tensor(name="X", dim=[1, c, h, h], stride=x_stride, data_type=f16)
        self.w = g.tensor(name="W", dim=[o, c, 3, 3], stride=[9 * c, 1, 3 * c, c], data_type=f16)
        y = g.conv_fprop(image=self.x, weight=self.w, padding=[1, 1], stride=[1, 1], dilation=[1, 1],
                         compute_data_type=f32, name="conv")
        self.z = None
        if add:
            self.z = g.tensor(name="Z", dim=[1, o, h, h], stride=[h * h * o, 1, h * o, o], data_type=f32)
            y = g.add(a=y, b=self.z, compute_data_type=f32, name="sum")
        y.set_output(True).set_dim([1, o, h, h]).set_stride([h * h * o, 1, h * o, o]).set_data_type(f32)
        self.y = y
        self.graph, self.handle = g, handle
        self.workspace = torch.empty(build(g), dtype=torch.uint8, device="cuda")

    def __call__(self, x_ptr, w_ptr, y_ptr, z_ptr=None):
        pack = {self.x: x_ptr, self.w: w_ptr, self.y: y_ptr}
        if self.z is not None:
            pack[self.z] = z_ptr
        self.graph.execute(pack, self.workspace.data_ptr(), handle=self.handle)


def _split(t):
    """(hi, lo) fp16 of float32 t scaled into fp16's range (the decoder's split)."""
    s = 2.0 ** (14 - int(np.floor(np.log2(float(t.abs().max())))))
    v = t * s
    hi = v.half()
    return hi, (v - hi.float()).half()


def probe(handle, c, o, h):
    torch.manual_seed(c * 7 + h)
    x = torch.randn(1, c, h, h, device="cuda") * 3
    w = torch.randn(o, c, 3, 3, device="cuda") / (9 * c) ** 0.5
    (xh, xl), (wh, wl) = _split(x), _split(w)
    X = torch.cat([xh, xl, xh], 1).contiguous(memory_format=torch.channels_last)   # [1, 3C, H, W] NHWC
    W = torch.cat([wh, wh, wl], 1).contiguous(memory_format=torch.channels_last)   # [O, 3C, 3, 3] KRSC
    ref = torch.nn.functional.conv2d(X.double(), W.double(), padding=1)
    flop = 2 * h * h * 9 * 3 * c * o
    row = {"C": c, "O": o, "H": h, "split_tflop": flop / 1e12}

    def score(y, ms):
        d = (y.double() - ref)
        return {"ms": ms, "tflops": flop / ms / 1e9, "rel_l2": float(d.norm() / ref.norm()),
                "max_rel": float((d.abs() / ref.abs().clamp_min(1e-3 * float(ref.abs().max()))).max())}

    c3 = 3 * c
    y = torch.empty(1, o, h, h, device="cuda").contiguous(memory_format=torch.channels_last)
    try:
        one = Conv(handle, c3, o, h, [h * h * c3, 1, h * c3, c3], add=False)
        ms = median_ms(lambda: one(X.data_ptr(), W.data_ptr(), y.data_ptr()), 10)
        row["one"] = score(y, ms)
    except Exception as e:
        row["one"] = {"error": f"{type(e).__name__}: {e}"[:400]}

    bounds = [(c0, min(c0 + SLICE, c3)) for c0 in range(0, c3, SLICE)]
    xs = [X[:, a:b].contiguous(memory_format=torch.channels_last) for a, b in bounds]
    ws = [W[:, a:b].contiguous(memory_format=torch.channels_last) for a, b in bounds]
    ys = [torch.empty_like(y), torch.empty_like(y)]
    zero = torch.zeros_like(y)
    for form in ("sliced", "strided"):
        try:
            convs = {}
            for a, b in bounds:
                stride = [h * h * (b - a), 1, h * (b - a), b - a] if form == "sliced" else [h * h * c3, 1, h * c3, c3]
                convs[(a, b)] = Conv(handle, b - a, o, h, stride, add=True)

            def run():
                z = zero
                for i, (a, b) in enumerate(bounds):
                    xp = xs[i].data_ptr() if form == "sliced" else X.data_ptr() + 2 * a
                    convs[(a, b)](xp, ws[i].data_ptr(), ys[i % 2].data_ptr(), z.data_ptr())
                    z = ys[i % 2]
            ms = median_ms(run, 10)
            row[form] = {**score(ys[(len(bounds) - 1) % 2], ms), "slices": len(bounds)}
        except Exception as e:
            row[form] = {"error": f"{type(e).__name__}: {e}"[:400]}

    xf, wf = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    torch.backends.cudnn.allow_tf32 = True
    row["torch_tf32_ms"] = median_ms(lambda: torch.nn.functional.conv2d(xf, wf, padding=1), 10)
    torch.backends.cudnn.allow_tf32 = False
    row["torch_fp32_ms"] = median_ms(lambda: torch.nn.functional.conv2d(xf, wf, padding=1), 10)
    row["torch_fp16_3c_ms"] = median_ms(lambda: torch.nn.functional.conv2d(X, W, padding=1), 10)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="probe_cudnn_conv.json")
    args = parser.parse_args()
    import cudnn
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    rows = []
    for c, o, h in SHAPES:
        row = probe(handle, c, o, h)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"cudnn": cudnn.backend_version(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
