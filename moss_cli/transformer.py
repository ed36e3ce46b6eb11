"""The MOSS-Image DiT (MOSSImageTransformer): packed latents + refined text + timestep -> velocity.

One graph over the op table (`moss_cli.ops`): a 2-block text refiner, `num_layers` single-stream joint
blocks over [image ; text] sharing one adaLN modulation, and a modulated head on the image tokens.
Host-side tables (time sinusoid, RoPE cos/sin) are built in numpy and handed to the ops.
"""

import math
from dataclasses import dataclass

import numpy as np

from .errors import CheckpointError, UsageError

DEFAULTS = {
    "dim": 3072,
    "ffn_dim": 8192,
    "num_heads": 24,
    "num_layers": 42,
    "text_dim": 4096,
    "freq_dim": 256,
    "latent_channels": 128,
    "rope_base": 10000.0,
}
TEXT_BLOCKS = 2          # text_embedder.blocks.{0,1}
ROPE_AXES = 4            # (r, t, h, w) position axes
EPS = 1e-6               # every RMSNorm: blocks, q/k, final
TIME_PERIOD = 10000.0    # time sinusoid base: freq_k = 10000^(-k/half)


def model_config(config):
    """The eight shape keys of transformer/config.json, defaults filled in, checked for consistency."""
    c = {k: type(v)(config.get(k, v)) for k, v in DEFAULTS.items()}
    if c["dim"] % c["num_heads"]:
        raise CheckpointError(f"transformer config: dim {c['dim']} is not a multiple of num_heads {c['num_heads']}")
    if (c["dim"] // c["num_heads"]) % (2 * ROPE_AXES):
        raise CheckpointError(f"transformer config: head_dim {c['dim'] // c['num_heads']} is not a multiple of 8")
    if c["freq_dim"] % 2:
        raise CheckpointError(f"transformer config: freq_dim {c['freq_dim']} is odd")
    return c


def _text_block(d, hd, f):
    """A text-refiner block's tensors, name -> shape, in the order a forward reads them."""
    return {"norm1.weight": (d,), "qkv.weight": (3 * d, d), "qkv.bias": (3 * d,), "q_norm.weight": (hd,),
            "k_norm.weight": (hd,), "proj.weight": (d, d), "proj.bias": (d,), "norm2.weight": (d,),
            "ffn_up.weight": (f, d), "ffn_up.bias": (f,), "ffn_gate.weight": (f, d), "ffn_gate.bias": (f,),
            "ffn_down.weight": (d, f), "ffn_down.bias": (d,)}


def _joint_block(d, hd, f):
    """A joint block's tensors, name -> shape, in the order a step reads them (q, k and v as one stack)."""
    return {"norm1.weight": (d,), "proj.q.weight": (d, d), "proj.k.weight": (d, d), "proj.v.weight": (d, d),
            "q_norm.weight": (hd,), "k_norm.weight": (hd,), "proj.o.weight": (d, d), "norm2.weight": (d,),
            "proj.ffn_up_gate.weight": (2 * f, d), "proj.ffn_down.weight": (d, f)}


# the tensors outside the blocks, in the order a first picture reads them
_OUTER = ("text_embedder.proj", "time_embedding.0", "time_embedding.2", "shared_block_modulation",
          "video_head_modulation", "video_embedder")


def expected_tensors(config):
    """Every tensor the graph reads, name -> shape, names as in the official checkpoint (rope.bands unused)."""
    c = model_config(config)
    d, f, hd = c["dim"], c["ffn_dim"], c["dim"] // c["num_heads"]
    outer = {"video_embedder": (d, c["latent_channels"]), "text_embedder.proj": (d, c["text_dim"]),
             "time_embedding.0": (d, c["freq_dim"]), "time_embedding.2": (d, d),
             "shared_block_modulation": (6 * d, d), "video_head_modulation": (2 * d, d)}
    out = {}
    for name, shape in outer.items():
        out.update({name + ".weight": shape, name + ".bias": shape[:1]})
    out.update({"final_norm_video.weight": (d,), "final_linear_video.weight": (c["latent_channels"], d)})
    for b in range(TEXT_BLOCKS):
        out.update({f"text_embedder.blocks.{b}.{n}": s for n, s in _text_block(d, hd, f).items()})
    for i in range(c["num_layers"]):
        out.update({f"layers.{i}.{n}": s for n, s in _joint_block(d, hd, f).items()})
    return out


def check_layers(layers, num_layers):
    """The skip-layer set as a frozenset, each index a joint block 0..num_layers-1."""
    layers = frozenset(int(i) for i in layers)
    bad = sorted(i for i in layers if not 0 <= i < num_layers)
    if bad:
        raise UsageError(f"skip layer {bad[0]} does not exist: the transformer has blocks 0..{num_layers - 1}")
    return layers


def time_sinusoid(timestep, freq_dim):
    """[1, freq_dim] = [cos(t f_k) | sin(t f_k)], f_k = 10000^(-k/half), t promoted fp32 -> float64."""
    half = freq_dim // 2
    t = np.float64(np.float32(timestep))
    freqs = np.exp(-math.log(TIME_PERIOD) * np.arange(half, dtype=np.float64) / half)
    phase = t * freqs
    return np.concatenate([np.cos(phase), np.sin(phase)])[None, :]


def positions(h, w, length):
    """RoPE positions [h*w + length, 4] over axes (r, t, h, w): image tokens first, then text.

    Image token (y, x) sits at (0, L, y - (h-1)/2, x - (w-1)/2) (row-major); text token i at (0, i, 0, 0).
    """
    ys, xs = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    image = np.zeros((h * w, ROPE_AXES))
    image[:, 1] = length
    image[:, 2] = ys.reshape(-1) - (h - 1) / 2
    image[:, 3] = xs.reshape(-1) - (w - 1) / 2
    text = np.zeros((length, ROPE_AXES))
    text[:, 1] = np.arange(length)
    return np.concatenate([image, text]).astype(np.float32)


def rope_tables(pos, head_dim, base, dtype):
    """cos, sin [N, head_dim/2] in `dtype`: dim j rotates with axis j // bands at band j % bands.

    The bands 1/base^(j/bands) are built in fp32 (the checkpoint's rope.bands is ignored: bf16 cannot
    hold them); the phase and sin/cos are computed in `dtype` (float32 on the CPU path).
    """
    n = head_dim // (2 * ROPE_AXES)
    f32 = np.float32
    bands = f32(1) / np.power(f32(base), np.arange(n, dtype=f32) / f32(n))
    phase = (pos.astype(dtype)[:, :, None] * bands.astype(dtype)[None, None, :]).reshape(len(pos), -1)
    return np.cos(phase), np.sin(phase)


@dataclass(frozen=True)
class Text:
    """A prompt after the text refiner: tokens [L, dim] as op-table arrays."""

    tokens: object
    length: int


class RefinedTexts:
    """refine(rows) -> Text, kept for the last `keep` distinct rows: a later picture of the same prompt, and
    every picture's negative prompt, reuse the refined tokens. Rows match only bit for bit (same dtype, shape
    and bytes), so a reused Text is the one refine would give. `own(text)` makes the kept copy (the GPU's
    refined tokens live in pool blocks that later graphs are planned to reuse, so it copies them out)."""

    def __init__(self, refine, own=lambda text: text, keep=8):
        self._refine, self._own, self._keep = refine, own, keep
        self._kept = []           # (rows, Text), the most recently used last
        self.hits = self.misses = 0

    def __call__(self, rows):
        rows = np.ascontiguousarray(rows)
        for i, (seen, text) in enumerate(self._kept):
            if seen.dtype == rows.dtype and seen.shape == rows.shape and \
                    np.array_equal(seen.reshape(-1).view(np.uint8), rows.reshape(-1).view(np.uint8)):
                self._kept.append(self._kept.pop(i))
                self.hits += 1
                return text
        text = self._own(self._refine(rows))
        self.misses += 1
        self._kept.append((rows.copy(), text))
        del self._kept[:-self._keep]
        return text


class MossTransformer:
    """MOSSImageTransformer over an op table and a tensors mapping with the checkpoint's names."""

    def __init__(self, ops, tensors, config):
        self.ops = ops
        self.tensors = tensors
        self.config = model_config(config)
        self.num_layers = self.config["num_layers"]
        self.heads = self.config["num_heads"]
        self.head_dim = self.config["dim"] // self.heads
        self._tables = {}
        self._cond = (None, None)

    def _p(self, name):
        return self.ops.param(self.tensors, name)

    def weight_names(self):
        """Every weight the text refiner and a step read through the op table, in the order a first
        picture asks for each (the refiner, then the step): a name, or a tuple of names read as one stack.
        An op table can upload them all up front (CudaOps.preload)."""
        block, joint = list(_text_block(1, 1, 1)), list(_joint_block(1, 1, 1))
        out = ["text_embedder.proj.weight", "text_embedder.proj.bias"]
        for b in range(TEXT_BLOCKS):
            out += [f"text_embedder.blocks.{b}.{n}" for n in block]
        for n in _OUTER[1:]:
            out += [n + ".weight", n + ".bias"]
        out += [f"layers.{i}.norm1.weight" for i in range(self.num_layers)] + ["final_norm_video.weight"]
        stacked = ("proj.q.weight", "proj.k.weight", "proj.v.weight")
        for i in range(self.num_layers):
            p = f"layers.{i}."
            out += [tuple(p + n for n in stacked)]
            out += [p + n for n in joint if n not in stacked and n != "norm1.weight"]
        return out + ["final_linear_video.weight"]

    # --- host tables, cached -----------------------------------------------------------------
    def rope(self, h, w, length):
        """The RoPE tables (cos, sin) of an h x w image and a text of `length` tokens, made once, on the op table."""
        key = (h, w, length)
        if key not in self._tables:
            cos, sin = rope_tables(positions(h, w, length), self.head_dim, self.config["rope_base"],
                                   self.ops.dtype)
            self._tables[key] = (self.ops.array(cos), self.ops.array(sin))
        return self._tables[key]

    def conditioning(self, e):
        """The six block vectors and the head's (shift, scale), each [1, dim], from the time sinusoid e
        [1, freq_dim] (an op-table array): once per step, shared by both CFG passes."""
        ops, d = self.ops, self.config["dim"]
        h = ops.silu(ops.linear(e, self._p("time_embedding.0.weight"), self._p("time_embedding.0.bias")))
        time = ops.linear(h, self._p("time_embedding.2.weight"), self._p("time_embedding.2.bias"))
        mod = ops.linear(time, self._p("shared_block_modulation.weight"), self._p("shared_block_modulation.bias"))
        head = ops.linear(time, self._p("video_head_modulation.weight"), self._p("video_head_modulation.bias"))
        return ([ops.slice(mod, 1, k * d, (k + 1) * d) for k in range(6)],
                [ops.slice(head, 1, k * d, (k + 1) * d) for k in range(2)])

    def _conditioning(self, timestep):
        key = float(np.float32(timestep))
        if self._cond[0] != key:
            self._cond = (key, self.conditioning(self.ops.array(time_sinusoid(key, self.config["freq_dim"]))))
        return self._cond[1]

    # --- pieces ------------------------------------------------------------------------------
    def _heads(self, x):
        return self.ops.reshape(x, (x.shape[0], self.heads, self.head_dim))

    def _attention(self, q, k, v, q_norm, k_norm, cos, sin):
        """Per-head RMSNorm + RoPE on q and k, bidirectional attention, heads merged: [L, dim]."""
        ops = self.ops
        q, k = ops.qk_norm_rope(self._heads(q), self._heads(k), q_norm, k_norm, cos, sin, EPS)
        o = ops.attention(q, k, self._heads(v), 1.0 / math.sqrt(self.head_dim))
        return ops.reshape(o, (o.shape[0], self.heads * self.head_dim))

    def _text_block(self, b, x, cos, sin):
        ops, d = self.ops, self.config["dim"]
        p = f"text_embedder.blocks.{b}."
        y = ops.rms_norm(x, self._p(p + "norm1.weight"), EPS, operand=True)
        q, k, v = ops.split(ops.linear(y, self._p(p + "qkv.weight"), self._p(p + "qkv.bias"), narrow=True), (d, d, d))
        a = self._attention(q, k, v, self._p(p + "q_norm.weight"), self._p(p + "k_norm.weight"), cos, sin)
        x = ops.linear(a, self._p(p + "proj.weight"), self._p(p + "proj.bias"), residual=x)
        y = ops.rms_norm(x, self._p(p + "norm2.weight"), EPS, operand=True)
        a = ops.situ(ops.linear(y, self._p(p + "ffn_up.weight"), self._p(p + "ffn_up.bias"), narrow=True),
                     ops.linear(y, self._p(p + "ffn_gate.weight"), self._p(p + "ffn_gate.bias"), narrow=True))
        return ops.linear(a, self._p(p + "ffn_down.weight"), self._p(p + "ffn_down.bias"), residual=x)

    def _joint_block(self, i, x, y, mod, cos, sin, after):
        """Block i on the stream x and its modulated norm y; returns the new stream and `after` = (norm
        weight, shift, scale) applied to it: the next block's norm1, or the head's final norm."""
        ops, f = self.ops, self.config["ffn_dim"]
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = mod
        p = f"layers.{i}."
        q, k, v = ops.linears(y, ops.params(self.tensors, [p + "proj.q.weight", p + "proj.k.weight",
                                                          p + "proj.v.weight"]), narrow=True)
        a = self._attention(q, k, v, self._p(p + "q_norm.weight"), self._p(p + "k_norm.weight"), cos, sin)
        o = ops.linear(a, self._p(p + "proj.o.weight"), narrow=True)
        x, y = ops.residual_norm_modulate(x, o, gate_a, self._p(p + "norm2.weight"), EPS, shift_f, scale_f)
        up, gate = ops.split(ops.linear(y, self._p(p + "proj.ffn_up_gate.weight"), narrow=True), (f, f))
        down = ops.linear(ops.situ(up, gate), self._p(p + "proj.ffn_down.weight"), narrow=True)
        return ops.residual_norm_modulate(x, down, gate_f, after[0], EPS, after[1], after[2])

    def tokens_velocity(self, image, n, mod, head, cos, sin, text, skip=frozenset()):
        """Velocity tokens [n, C] for the embedded-ready image tokens [n, C] (op array) and a refined text."""
        ops = self.ops
        x = ops.linear(image, self._p("video_embedder.weight"), self._p("video_embedder.bias"))
        x = ops.concat([x, text.tokens], axis=0)
        run = [i for i in range(self.num_layers) if i not in skip]
        shift_a, scale_a = mod[0], mod[1]
        norms = [(self._p(f"layers.{i}.norm1.weight"), shift_a, scale_a) for i in run]
        norms.append((self._p("final_norm_video.weight"), head[0], head[1]))
        y = ops.norm_modulate(x, norms[0][0], EPS, norms[0][1], norms[0][2])
        for i, after in zip(run, norms[1:]):
            x, y = self._joint_block(i, x, y, mod, cos, sin, after)
        return ops.linear(ops.slice(y, 0, 0, n), self._p("final_linear_video.weight"))

    # --- public ------------------------------------------------------------------------------
    def prepare_text(self, rows):
        """Run the text refiner on one prompt's encoder rows [L, text_dim]; reuse the result for every step."""
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[0] < 1 or rows.shape[1] != self.config["text_dim"]:
            raise UsageError(f"text rows must be [L >= 1, {self.config['text_dim']}], got {list(rows.shape)}")
        ops, n = self.ops, rows.shape[0]
        cos, sin = rope_tables(positions(0, 0, n), self.head_dim, self.config["rope_base"], ops.dtype)
        cos, sin = ops.array(cos), ops.array(sin)
        x = ops.linear(ops.array(rows), self._p("text_embedder.proj.weight"), self._p("text_embedder.proj.bias"))
        for b in range(TEXT_BLOCKS):
            x = self._text_block(b, x, cos, sin)
        return Text(x, n)

    def velocity(self, latents, timestep, text, skip_layers=frozenset()):
        """Velocity [1, C, h, w] for packed latents [1, C, h, w] at timestep t (= sigma * 1000).

        Blocks in `skip_layers` are not run (the stream passes through). Returns float32, or float64 on the
        float64 reference table.
        """
        ops, ch = self.ops, self.config["latent_channels"]
        if latents.ndim != 4 or latents.shape[:2] != (1, ch):
            raise UsageError(f"latents must be [1, {ch}, h, w], got {list(latents.shape)}")
        skip = check_layers(skip_layers, self.num_layers)
        h, w = latents.shape[2:]
        n = h * w
        mod, head = self._conditioning(timestep)
        cos, sin = self.rope(h, w, text.length)
        x = ops.transpose(ops.reshape(ops.array(latents), (ch, n)), (1, 0))   # token y*w + x
        v = self.tokens_velocity(x, n, mod, head, cos, sin, text, skip)
        out = ops.host(ops.reshape(ops.transpose(v, (1, 0)), (1, ch, h, w)))
        return out.astype(np.promote_types(out.dtype, np.float32))
