"""The MOSS-Image DiT (denoiser.md §3) stated in torch, apart from moss_cli's numpy graph.

`Statement(sd, cfg, dtype)` runs in float64 (the reference: the functions below, the cases, the GPU
benchmark's accuracy reference) or in bf16 with the official chain's roundings (denoiser.md's rounding
contract: every op in bf16, RMSNorm normalised in float32 then rounded, the RoPE angles and the time
sinusoid in float32; the GPU benchmark's baseline), on whatever device its weights are.
"""

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


def random_vector(name, shape, normal):
    """A 1-D tensor of realistic scale for random-weight runs: norm weights 1 + 0.1 N, the rest 0.02 N;
    normal(shape) draws the N (numpy's or torch's generator)."""
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")) or "norm_video" in name:
        return 1 + 0.1 * normal(shape)
    return 0.02 * normal(shape)


def _params(sd):
    return {k: v if isinstance(v, torch.Tensor) else torch.tensor(np.asarray(v, dtype=np.float64))
            for k, v in sd.items()}


def positions(h, w, n, device="cpu"):
    """RoPE positions (r, t, h, w) [h w + n, 4], float64: image tokens (t = n, centred rows and columns) first,
    then the n text tokens at t = 0 .. n - 1."""
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    img = torch.zeros(h * w, 4, dtype=torch.float64, device=device)
    img[:, 1] = n
    img[:, 2] = ys.flatten() - (h - 1) / 2
    img[:, 3] = xs.flatten() - (w - 1) / 2
    txt = torch.zeros(n, 4, dtype=torch.float64, device=device)
    txt[:, 1] = torch.arange(n, device=device)
    return torch.cat([img, txt])


class Statement:
    def __init__(self, sd, cfg, dtype=torch.float64):
        self.P, self.cfg, self.dtype = _params(sd), cfg, dtype
        self.exact = dtype == torch.float64
        self.D, self.heads = cfg["dim"], cfg["num_heads"]
        self.hd = self.D // self.heads
        self.nb = self.hd // 8
        self.base = float(cfg.get("rope_base", 10000.0))

    def p(self, name):
        return self.P[name].to(self.dtype)

    def lin(self, x, n, bias=True):
        return x @ self.p(n + ".weight").T + (self.p(n + ".bias") if bias else 0)

    def rms(self, x, n):
        xf = x if self.exact else x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)).to(self.dtype) * self.p(n)

    @staticmethod
    def situ(h, g):
        return (4 * torch.tanh(g / 4) * torch.sigmoid(g)) * (25 * torch.tanh(h / 25))

    def rope_tables(self, pos):
        """(cos, sin) [N, 1, hd / 2] of positions [N, 4]: float32 bands, the angles in float64 for the
        reference, else in float32 and the tables rounded to the dtype."""
        bands = 1 / self.base ** (torch.arange(self.nb, dtype=torch.float32, device=pos.device) / self.nb)
        ang = (pos[:, :, None] * bands.double()).flatten(1) if self.exact else \
            (pos.float()[:, :, None] * bands).flatten(1)
        return ang.cos().to(self.dtype)[:, None, :], ang.sin().to(self.dtype)[:, None, :]

    @staticmethod
    def rope(x, tables):                                          # x [N, heads, hd]
        c, s = tables
        a, b = x.chunk(2, -1)
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    def attn(self, q, k, v):
        """Bidirectional SDPA over [N, heads, hd]; batched as [1, heads, N, hd] outside float64 (torch's fused
        backends take 4-D inputs only)."""
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        if not self.exact:
            return F.scaled_dot_product_attention(q[None], k[None], v[None])[0].transpose(0, 1).reshape(-1, self.D)
        return F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(-1, self.D)

    def split(self, x):
        return x.reshape(x.shape[0], self.heads, self.hd)

    def text(self, rows):
        """The two unmodulated text blocks at positions (0, i, 0, 0); rows [L, text_dim]."""
        rows = torch.as_tensor(rows)
        tables = self.rope_tables(positions(0, 0, rows.shape[0], rows.device))
        x = self.lin(rows.to(self.dtype), "text_embedder.proj")
        for b in range(2):
            p = f"text_embedder.blocks.{b}."
            q, k, v = self.lin(self.rms(x, p + "norm1.weight"), p + "qkv").chunk(3, -1)
            q = self.rope(self.rms(self.split(q), p + "q_norm.weight"), tables)
            k = self.rope(self.rms(self.split(k), p + "k_norm.weight"), tables)
            x = x + self.lin(self.attn(q, k, self.split(v)), p + "proj")
            y = self.rms(x, p + "norm2.weight")
            x = x + self.lin(self.situ(self.lin(y, p + "ffn_up"), self.lin(y, p + "ffn_gate")), p + "ffn_down")
        return x

    def conditioning(self, t, device="cpu"):
        """The six block vectors [6, D] and the head's two [2, D] at timestep t (= sigma * 1000); the sinusoid
        in float64, then float32 and the dtype outside the reference (as the official chain)."""
        half = self.cfg.get("freq_dim", 256) // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64, device=device) / half)
        e = torch.cat([torch.cos(t * freqs), torch.sin(t * freqs)])[None]
        e = e if self.exact else e.float().to(self.dtype)
        time = self.lin(F.silu(self.lin(e, "time_embedding.0")), "time_embedding.2")
        return (self.lin(time, "shared_block_modulation").reshape(6, self.D),
                self.lin(time, "video_head_modulation").reshape(2, self.D))

    def velocity(self, latents, mod, head, text, skip=()):
        """Velocity [1, C, h, w] (float64 for the reference, else float32) of latents [1, C, h, w]."""
        latents = torch.as_tensor(latents)
        _, C, h, w = latents.shape
        tables = self.rope_tables(positions(h, w, text.shape[0], latents.device))
        x = torch.cat([self.lin(latents.flatten(2)[0].T.to(self.dtype), "video_embedder"), text])
        for i in range(self.cfg["num_layers"]):
            if i in skip:
                continue
            p = f"layers.{i}."
            y = self.rms(x, p + "norm1.weight") * (1 + mod[1]) + mod[0]
            q = self.rope(self.rms(self.split(self.lin(y, p + "proj.q", False)), p + "q_norm.weight"), tables)
            k = self.rope(self.rms(self.split(self.lin(y, p + "proj.k", False)), p + "k_norm.weight"), tables)
            v = self.split(self.lin(y, p + "proj.v", False))
            x = x + self.lin(self.attn(q, k, v), p + "proj.o", False) * mod[2]
            y = self.rms(x, p + "norm2.weight") * (1 + mod[4]) + mod[3]
            up, gate = self.lin(y, p + "proj.ffn_up_gate", False).chunk(2, -1)
            x = x + self.lin(self.situ(up, gate), p + "proj.ffn_down", False) * mod[5]
        z = self.rms(x[: h * w], "final_norm_video.weight") * (1 + head[1]) + head[0]
        v = self.lin(z, "final_linear_video", False).T.reshape(1, C, h, w)
        return v if self.exact else v.float()

    def step(self, latents, t, dt, cond, uncond, guidance, skip):
        """One CFG step as the official pipeline: v = u + g (c - u) (float32 outside the reference), x + dt v."""
        mod, head = self.conditioning(t, latents.device)
        c = self.velocity(latents, mod, head, cond)
        u = self.velocity(latents, mod, head, uncond, skip)
        v = u + guidance * (c - u)
        return latents + dt * v, v


def text_refiner(sd, cfg, rows):
    """The refined text [L, dim] in float64 for rows [L, text_dim]."""
    return Statement(sd, cfg).text(torch.as_tensor(rows, dtype=torch.float64))


def velocity(sd, cfg, latents, t, text, skip=()):
    """Velocity [1, C, h, w] in float64 for latents, timestep t (= sigma * 1000) and refined text [L, dim]."""
    st = Statement(sd, cfg)
    mod, head = st.conditioning(t)
    return st.velocity(torch.as_tensor(latents, dtype=torch.float64), mod, head, text, skip)


def spec_velocity(sd, cfg, latents, t, rows, skip=()):
    """Text refiner + one velocity, as numpy float64: the whole forward of one call."""
    return velocity(sd, cfg, latents, t, text_refiner(sd, cfg, rows), skip).numpy()
