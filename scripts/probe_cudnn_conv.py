"""Probe: a 3x3 conv of the taps' split image through cuDNN's conv_fprop (fp16 in, float32 accumulation and
output), against our tap products and torch, at the decoder's 1024 shapes. Prints one JSON line a shape."""

import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numba import cuda  # noqa: E402

from cuda_kernels import conv, sdpa  # noqa: E402
from cuda_kernels.gemm import pointer  # noqa: E402

SHAPES = [(96, 96, 1024), (192, 96, 1024), (192, 192, 1024), (192, 192, 512), (384, 192, 512),
          (384, 384, 512), (384, 384, 256), (384, 384, 128), (32, 384, 128), (96, 8, 1024)]


def events_ms(fn, reps=10):
    fn()
    cuda.synchronize()
    a, b = cuda.event(), cuda.event()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return cuda.event_elapsed_time(a, b) / reps


def graph_for(c3, o, h, w, layout, every=False):
    import cudnn
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=sdpa._state["handle"])
    hp, wp = h + 2, w + 2
    x = g.tensor(name="x", dim=[1, c3, hp, wp], stride=[hp * wp * c3, 1, wp * c3, c3], data_type=cudnn.data_type.HALF)
    wt = g.tensor(name="w", dim=[o, c3, 3, 3], stride=[9 * c3, 1, 3 * c3, c3], data_type=cudnn.data_type.HALF)
    y = g.conv_fprop(image=x, weight=wt, padding=[0, 0], stride=[1, 1], dilation=[1, 1],
                     compute_data_type=cudnn.data_type.FLOAT, name="conv")
    st = [h * w * o, 1, w * o, o] if layout == "nhwc" else [o * h * w, h * w, w, 1]
    y.set_output(True).set_dim([1, o, h, w]).set_stride(st).set_data_type(cudnn.data_type.FLOAT)
    ws = sdpa.build(g, every)
    return g, x, wt, y, ws


def main():
    import torch
    import torch.nn.functional as F
    print(sdpa.available(), flush=True)
    rng = np.random.default_rng(0)
    for c, o, h in SHAPES:
        w_ = h
        row = {"C": c, "O": o, "H": h}
        x = rng.standard_normal((c, h, w_), dtype=np.float32)
        wgt = (rng.standard_normal((o, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
        dx = cuda.to_device(x)
        peak = cuda.device_array(1, np.float32)
        conv.absmax(dx, peak)
        tw, pw = conv.tap_weights(wgt)
        c3, o8 = tw.shape[2], tw.shape[1]
        image = cuda.device_array(((h + 2) * (w_ + 2) + 2, c3), np.uint16)
        image[-2:] = np.zeros((2, c3), np.uint16)
        conv.split_image(dx, peak, image[:(h + 2) * (w_ + 2)], -1, triple=True)
        wk = cuda.to_device(np.ascontiguousarray(tw.transpose(1, 0, 2)))    # [O', 9, 3P] = KRSC
        dw = cuda.to_device(tw)
        cuda.synchronize()
        # reference: float64 of the same fp16 values (torch on the GPU)
        img64 = torch.from_numpy(conv.half_value(image.copy_to_host()[:(h + 2) * (w_ + 2)])).cuda().double()
        img64 = img64.reshape(h + 2, w_ + 2, c3).permute(2, 0, 1)[None]
        wk64 = torch.from_numpy(conv.half_value(wk.copy_to_host())).cuda().double().reshape(o8, 3, 3, c3)\
            .permute(0, 3, 1, 2)
        ref = F.conv2d(img64, wk64)[0].permute(1, 2, 0).reshape(h * w_, o8)       # [HW, O']
        scale = float(ref.abs().max())
        # our tap product over the whole frame
        span = w_ + 2
        d = cuda.device_array((h * span - 2, o8), np.float32)
        row["taps_ms"] = events_ms(lambda: conv.tap_product(image, dw, d, span))
        got = torch.as_tensor(d, device="cuda").reshape(-1, o8)
        got = torch.cat([got, torch.zeros(2, o8, device="cuda")]).reshape(h, span, o8)[:, :w_].reshape(h * w_, o8)
        row["taps_err"] = float((got.double() - ref).abs().max()) / scale
        for layout in ("nhwc", "nchw"):
            try:
                t0 = time.time()
                g, xt, wt, yt, ws = graph_for(c3, o8, h, w_, layout, every=True)
                row[f"{layout}_build_s"] = round(time.time() - t0, 2)
                y = cuda.device_array(h * w_ * o8, np.float32)
                space = cuda.device_array(max(ws, 1 << 20), np.uint8)
                pack = {xt: pointer(image), wt: pointer(wk), yt: pointer(y)}
                plans = []
                for i in range(min(g.get_execution_plan_count(), 8)):
                    try:
                        need = g.get_workspace_size_plan_at_index(i)
                        sp = space if need <= space.size else cuda.device_array(need, np.uint8)
                        ms = events_ms(lambda: g.execute_plan_at_index(pack, pointer(sp), index=i,
                                                                         handle=sdpa._state["handle"]))
                        yy = torch.as_tensor(y, device="cuda").double()
                        yy = yy.reshape(h * w_, o8) if layout == "nhwc" else yy.reshape(o8, h * w_).T
                        plans.append([g.get_plan_name_at_index(i)[:60], round(ms, 4),
                                      float((yy - ref).abs().max()) / scale])
                    except Exception as e:
                        plans.append([f"plan {i}", f"{type(e).__name__}: {e}"[:200]])
                row[layout] = plans
            except Exception as e:
                row[layout] = f"{type(e).__name__}: {e}"[:300]
        # torch at the conv's own precision choices, NCHW fp32 and channels-last fp16 (C channels, not 3P)
        xt32 = torch.from_numpy(x).cuda()[None]
        wt32 = torch.from_numpy(wgt).cuda()
        for name, tf32 in (("torch_fp32", False), ("torch_tf32", True)):
            torch.backends.cudnn.allow_tf32 = tf32
            row[name] = events_ms(lambda: F.conv2d(xt32, wt32, padding=1))
        xh = xt32.half().to(memory_format=torch.channels_last)
        wh = wt32.half().to(memory_format=torch.channels_last)
        row["torch_fp16_cl"] = events_ms(lambda: F.conv2d(xh, wh, padding=1))
        row["tflop_split"] = 2 * h * w_ * o8 * 9 * c3 / 1e12
        print(json.dumps(row), flush=True)
        del image, d, dw, wk, img64, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
