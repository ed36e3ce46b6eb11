"""What FP8 products would do to the DiT's accuracy, on the CPU: one CFG step's guided velocity at the real
size (random N(0, 0.02) bf16 weights, as scripts/gpu_dit.py makes them), relative L2 error against the
float64 statement (scripts/reference/dit.py), for

  * the torch bf16 chain (the GPU benchmark's baseline statement);
  * a float32 statement whose products take bf16 inputs with float32 accumulation and whose attention takes
    bf16 q/k/v, as the GPU path rounds (not our kernels: the rounding points of their products);
  * the same with some of the blocks' products in FP8 e4m3 (each activation row and each weight row scaled to
    e4m3's 448, float32 accumulation, the scales multiplied back after the product): the MLP's two, the
    up/gate product alone (the largest: 45 % of the step's product time on an H100), the down product alone,
    the attention's four (q, k, v, o).

A few tokens keep it to minutes (the weights take ~10 GB of memory as bf16; one statement is made at a time):

    python scripts/dit_precision.py --side 8 --text 64 --out dit_precision.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from moss_cli.schedule import sigmas as schedule_sigmas, timesteps  # noqa: E402
from moss_cli.transformer import DEFAULTS, expected_tensors  # noqa: E402
from reference.dit import Statement, random_vector  # noqa: E402

E4M3_MAX = 448.0
MLP = ("proj.ffn_up_gate", "proj.ffn_down")
ATTENTION = ("proj.q", "proj.k", "proj.v", "proj.o")
FP8 = {"the MLP's products": MLP, "the up/gate product": MLP[:1], "the down product": MLP[1:],
       "the attention's q, k, v and o products": ATTENTION}


def e4m3_rows(x):
    """(x / s rounded to e4m3, as float32; s [rows, 1]) with s putting each row's max |x| at E4M3_MAX."""
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / E4M3_MAX
    return (x / s).to(torch.float8_e4m3fn).float(), s


class Rounded(Statement):
    """The float32 statement with bf16 product inputs (and attention inputs); the blocks' products named in
    `fp8` (suffixes of layers.N.) in scaled e4m3 instead."""

    def __init__(self, sd, cfg, fp8=()):
        super().__init__(sd, cfg, torch.float32)
        self.fp8 = fp8

    def lin(self, x, n, bias=True):
        w = self.P[n + ".weight"].float()
        if n.startswith("layers.") and n.split(".", 2)[2] in self.fp8:
            wq, sw = e4m3_rows(w)          # (made again at each use: kept, the MLP's would take 13 GB)
            xq, sx = e4m3_rows(x.float())
            y = (xq @ wq.T) * sx * sw.T
        else:
            y = x.to(torch.bfloat16).float() @ w.T
        return y + (self.p(n + ".bias") if bias else 0)

    def attn(self, q, k, v):
        return super().attn(*(t.to(torch.bfloat16).float() for t in (q, k, v)))


def random_weights(cfg, gen):
    """Matrices N(0, 0.02) and vectors of realistic scale (reference.dit.random_vector), as bf16."""
    sd = {}
    for name, shape in expected_tensors(cfg).items():
        if len(shape) == 2:
            v = torch.randn(shape, generator=gen) * 0.02
        else:
            v = random_vector(name, shape, lambda size: torch.randn(size, generator=gen))
        sd[name] = v.to(torch.bfloat16)
    return sd


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=int, default=8, help="latent tokens a side (1024x1024 is 64)")
    ap.add_argument("--text", type=int, default=64, help="text tokens of each prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    gen = torch.Generator().manual_seed(args.seed)
    sd = random_weights(cfg, gen)
    rows = [torch.randn(args.text, cfg["text_dim"], generator=gen) for _ in range(2)]
    noise = torch.randn(1, cfg["latent_channels"], args.side, args.side, generator=gen)
    sig = schedule_sigmas(50, shift=5.0)
    t, dt = float(timesteps(sig)[0]), float(np.float32(sig[1]) - np.float32(sig[0]))
    record = {"torch": torch.__version__, "image_tokens": args.side ** 2, "text_tokens": args.text,
              "step": "the first of 50, guidance 3", "rel_l2_vs_float64": {}}
    with torch.no_grad():
        ref = Statement(sd, cfg, torch.float64)
        _, v_ref = ref.step(noise.double(), t, dt, ref.text(rows[0].double()), ref.text(rows[1].double()), 3.0, ())
        del ref
        statements = {"torch bf16 chain": lambda: Statement(sd, cfg, torch.bfloat16),
                      "bf16 product inputs, float32 elsewhere": lambda: Rounded(sd, cfg)}
        for what, names in FP8.items():
            statements[f"the same, {what} in FP8 e4m3"] = lambda names=names: Rounded(sd, cfg, names)
        for name, make in statements.items():       # inputs as scripts/gpu_dit.py gives them: float32
            t0 = time.perf_counter()
            st = make()
            _, v = st.step(noise, t, dt, st.text(rows[0]), st.text(rows[1]), 3.0, ())
            err = float(torch.linalg.norm(v.double() - v_ref) / torch.linalg.norm(v_ref))
            record["rel_l2_vs_float64"][name] = err
            print(f"{name}: {err:.4g} ({time.perf_counter() - t0:.0f} s)", flush=True)
            del st, v
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
