"""The MOSS-Image DiT (denoiser.md §3) stated in torch float64, apart from moss_cli's numpy graph."""

import json
import math

import numpy as np
import torch
import torch.nn.functional as F


def load_weights(folder):
    """Every tensor of a transformer/ folder (single or sharded safetensors) as float64 torch tensors."""
    from safetensors.torch import load_file
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["diffusion_pytorch_model.safetensors"]
    out = {}
    for name in files:
        for key, value in load_file(str(folder / name)).items():
            out[key] = value.double()
    return out


def _params(sd):
    return {k: v if isinstance(v, torch.Tensor) else torch.tensor(np.asarray(v, dtype=np.float64))
            for k, v in sd.items()}


class _Math:
    def __init__(self, sd, cfg):
        self.P = _params(sd)
        self.D, self.heads = cfg["dim"], cfg["num_heads"]
        self.hd = self.D // self.heads
        self.nb = self.hd // 8
        self.base = float(cfg.get("rope_base", 10000.0))

    def lin(self, x, n, bias=True):
        return x @ self.P[n + ".weight"].T + (self.P[n + ".bias"] if bias else 0)

    def rms(self, x, n):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.P[n]

    @staticmethod
    def situ(h, g):
        return (4 * torch.tanh(g / 4) * torch.sigmoid(g)) * (25 * torch.tanh(h / 25))

    def rope(self, x, pos):                                       # x [N, heads, hd], pos [N, 4]
        bands = (1 / self.base ** (torch.arange(self.nb, dtype=torch.float32) / self.nb)).double()
        ang = (pos[:, :, None] * bands).flatten(1)[:, None, :]
        a, b = x.chunk(2, -1)
        return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)

    def attn(self, q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return o.transpose(0, 1).reshape(-1, self.D)

    def split(self, x):
        return x.reshape(x.shape[0], self.heads, self.hd)


def text_positions(n):
    pos = torch.zeros(n, 4, dtype=torch.float64)
    pos[:, 1] = torch.arange(n)
    return pos


def text_refiner(sd, cfg, rows):
    """The two unmodulated text blocks at positions (0, i, 0, 0); rows [L, text_dim]."""
    m = _Math(sd, cfg)
    tpos = text_positions(rows.shape[0])
    x = m.lin(torch.as_tensor(rows, dtype=torch.float64), "text_embedder.proj")
    for b in range(2):
        p = f"text_embedder.blocks.{b}."
        q, k, v = m.lin(m.rms(x, p + "norm1.weight"), p + "qkv").chunk(3, -1)
        q = m.rope(m.rms(m.split(q), p + "q_norm.weight"), tpos)
        k = m.rope(m.rms(m.split(k), p + "k_norm.weight"), tpos)
        x = x + m.lin(m.attn(q, k, m.split(v)), p + "proj")
        y = m.rms(x, p + "norm2.weight")
        x = x + m.lin(m.situ(m.lin(y, p + "ffn_up"), m.lin(y, p + "ffn_gate")), p + "ffn_down")
    return x


def velocity(sd, cfg, latents, t, text, skip=()):
    """Velocity [1, C, h, w] for float latents, timestep t (= sigma*1000) and refined text [L, dim]."""
    m = _Math(sd, cfg)
    D = m.D
    half = cfg.get("freq_dim", 256) // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half)
    e = torch.cat([torch.cos(t * freqs), torch.sin(t * freqs)])[None]
    time = m.lin(F.silu(m.lin(e, "time_embedding.0")), "time_embedding.2")
    mod = m.lin(time, "shared_block_modulation").reshape(6, D)
    head = m.lin(time, "video_head_modulation").reshape(2, D)

    latents = torch.as_tensor(latents, dtype=torch.float64)
    _, C, h, w = latents.shape
    n_txt = text.shape[0]
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ipos = torch.zeros(h * w, 4, dtype=torch.float64)
    ipos[:, 1] = n_txt
    ipos[:, 2] = ys.flatten() - (h - 1) / 2
    ipos[:, 3] = xs.flatten() - (w - 1) / 2
    pos = torch.cat([ipos, text_positions(n_txt)])
    img = latents.flatten(2)[0].T
    x = torch.cat([m.lin(img, "video_embedder"), text])
    for i in range(cfg["num_layers"]):
        if i in skip:
            continue
        p = f"layers.{i}."
        y = m.rms(x, p + "norm1.weight") * (1 + mod[1]) + mod[0]
        q = m.rope(m.rms(m.split(m.lin(y, p + "proj.q", False)), p + "q_norm.weight"), pos)
        k = m.rope(m.rms(m.split(m.lin(y, p + "proj.k", False)), p + "k_norm.weight"), pos)
        v = m.split(m.lin(y, p + "proj.v", False))
        x = x + m.lin(m.attn(q, k, v), p + "proj.o", False) * mod[2]
        y = m.rms(x, p + "norm2.weight") * (1 + mod[4]) + mod[3]
        up, gate = m.lin(y, p + "proj.ffn_up_gate", False).chunk(2, -1)
        x = x + m.lin(m.situ(up, gate), p + "proj.ffn_down", False) * mod[5]
    z = m.rms(x[: h * w], "final_norm_video.weight") * (1 + head[1]) + head[0]
    v = m.lin(z, "final_linear_video", False)
    return v.T.reshape(1, C, h, w)


def spec_velocity(sd, cfg, latents, t, rows, skip=()):
    """Text refiner + one velocity, as numpy float64: the whole forward of one call."""
    return velocity(sd, cfg, latents, t, text_refiner(sd, cfg, rows), skip).numpy()
