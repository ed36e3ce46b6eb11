"""Qwen3.5 text model as the prompt encoder: token ids -> last_hidden_state rows (encoder.md sections 1-4).

Layers are Gated DeltaNet (`linear_attn`) except every 4th, which is gated full attention (`self_attn`);
each layer is pre-norm with a SwiGLU MLP; the output is the final `norm` applied to all tokens. Tensor
names are the checkpoint's own with the text-model prefix stripped (`layers.3.self_attn.q_proj.weight`).
"""

import numpy as np

from .errors import CheckpointError

# Qwen3_5TextConfig defaults, used where config.json leaves a key out. rope_theta defaults to 1e4 there,
# not the 1e7 the 9B config carries, so a config without rope parameters means what transformers makes of it.
TEXT_DEFAULTS = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
}
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_PARTIAL_ROTARY = 0.25
# GDN q/k are L2-normalised with this eps inside the root (HF l2norm, FLA).
L2_EPS = 1e-6


def text_config(config: dict) -> dict:
    """The text model's config (from a composite Qwen3_5Config or a plain text config), defaults filled.

    `layer_types` is built from `full_attention_interval` when absent; `rope_parameters` is resolved with
    transformers' precedence (the dict, then legacy top-level keys, then the defaults).
    """
    inner = config.get("text_config", config)
    if not isinstance(inner, dict):
        raise CheckpointError("text_config in the text encoder's config.json is not an object")
    out = {**TEXT_DEFAULTS, **{k: v for k, v in inner.items() if v is not None}}
    if not out.get("layer_types"):
        every = out["full_attention_interval"]
        out["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                              for i in range(out["num_hidden_layers"])]
    if len(out["layer_types"]) != out["num_hidden_layers"]:
        raise CheckpointError(f"layer_types lists {len(out['layer_types'])} layers, "
                              f"num_hidden_layers is {out['num_hidden_layers']}")
    rope = dict(inner.get("rope_parameters") or inner.get("rope_scaling") or {})
    rope.setdefault("rope_theta", inner.get("rope_theta", DEFAULT_ROPE_THETA))
    rope.setdefault("partial_rotary_factor", inner.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY))
    rope.setdefault("rope_type", "default")
    if rope["rope_type"] != "default":
        raise CheckpointError(f"rope_type {rope['rope_type']!r} is not supported (only 'default')")
    out["rope_parameters"] = rope
    if out["hidden_act"] != "silu":
        raise CheckpointError(f"hidden_act {out['hidden_act']!r} is not supported (only 'silu')")
    return out


def expected_tensors(config) -> dict[str, tuple]:
    """Every tensor the graph reads, with its shape."""
    c = text_config(config)
    d, ff = c["hidden_size"], c["intermediate_size"]
    hd, nq, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    conv = 2 * hk * dk + hv * dv
    out = {"embed_tokens.weight": (c["vocab_size"], d), "norm.weight": (d,)}
    for i, kind in enumerate(c["layer_types"]):
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (d,)
        out[p + "mlp.gate_proj.weight"] = (ff, d)
        out[p + "mlp.up_proj.weight"] = (ff, d)
        out[p + "mlp.down_proj.weight"] = (d, ff)
        if kind == "full_attention":
            out[p + "self_attn.q_proj.weight"] = (2 * nq * hd, d)
            out[p + "self_attn.k_proj.weight"] = (nkv * hd, d)
            out[p + "self_attn.v_proj.weight"] = (nkv * hd, d)
            out[p + "self_attn.o_proj.weight"] = (d, nq * hd)
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        elif kind == "linear_attention":
            out[p + "linear_attn.in_proj_qkv.weight"] = (conv, d)
            out[p + "linear_attn.in_proj_z.weight"] = (hv * dv, d)
            out[p + "linear_attn.in_proj_b.weight"] = (hv, d)
            out[p + "linear_attn.in_proj_a.weight"] = (hv, d)
            out[p + "linear_attn.conv1d.weight"] = (conv, 1, c["linear_conv_kernel_dim"])
            out[p + "linear_attn.A_log"] = (hv,)
            out[p + "linear_attn.dt_bias"] = (hv,)
            out[p + "linear_attn.norm.weight"] = (dv,)
            out[p + "linear_attn.out_proj.weight"] = (d, hv * dv)
        else:
            raise CheckpointError(f"layer {i} has unknown layer type {kind!r}")
    return out


def rope_tables(length: int, config: dict):
    """cos, sin [length, rotary_dim / 2] for positions 0..length-1 (text only, so M-RoPE is plain 1-D RoPE)."""
    rope = config["rope_parameters"]
    rotary = int(config["head_dim"] * rope["partial_rotary_factor"])
    inv_freq = rope["rope_theta"] ** (-np.arange(0, rotary, 2, dtype=np.float64) / rotary)
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def check_ids(ids, vocab_size):
    """ids as a flat array, refused when empty or outside the vocabulary (a tokenizer of another model)."""
    ids = np.asarray(ids).reshape(-1)
    if ids.size == 0:
        raise ValueError("no tokens to encode")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise CheckpointError(f"token id {int(ids.max())} is outside the text encoder's vocabulary "
                              f"(vocab_size {vocab_size}): tokenizer and encoder do not match")
    return ids


class Qwen35Encoder:
    """ids -> last_hidden_state [L, hidden] in the ops dtype; `form` picks the GDN delta-rule form."""

    def __init__(self, ops, tensors, config, form="chunk"):
        self.ops = ops
        self.tensors = tensors
        self.config = text_config(config)
        self.form = form

    def w(self, name):
        return self.ops.param(self.tensors, name)

    def weight_names(self):
        """Every weight a forward reads through the op table, in the order it first asks for each: a name
        (`w`), or a tuple of names read as one stack (`ws`). An op table can upload them all up front
        (CudaOps.preload); the token embedding table is not among them (rows are gathered on the host)."""
        out = []
        for i, kind in enumerate(self.config["layer_types"]):
            p = f"layers.{i}."
            out.append(p + "input_layernorm.weight")
            if kind == "full_attention":
                a = p + "self_attn."
                out += [tuple(a + f"{n}_proj.weight" for n in "qkv"), a + "q_norm.weight", a + "k_norm.weight",
                        a + "o_proj.weight"]
            else:
                a = p + "linear_attn."
                out += [a + "conv1d.weight", tuple(a + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")),
                        a + "A_log", a + "dt_bias", a + "norm.weight", a + "out_proj.weight"]
            out += [p + "post_attention_layernorm.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    p + "mlp.down_proj.weight"]
        return out + ["norm.weight"]

    def ws(self, *names):
        return self.ops.params(self.tensors, names)

    def __call__(self, ids, on_layer=None):
        ops, c = self.ops, self.config
        ids = check_ids(ids, c["vocab_size"])
        cos, sin = rope_tables(len(ids), c)
        cos, sin = ops.array(cos), ops.array(sin)
        # gather rows from the stored table: converting the whole [vocab, hidden] table would cost gigabytes
        x = ops.embedding(self.tensors["embed_tokens.weight"], ids)
        eps = c["rms_norm_eps"]
        for i, kind in enumerate(c["layer_types"]):
            p = f"layers.{i}."
            # each sublayer adds its output to x (the residual) inside its last product
            h = ops.rms_norm(x, self.w(p + "input_layernorm.weight"), eps, offset=1.0, operand=True)
            if kind == "full_attention":
                x = self.attention(p + "self_attn.", h, cos, sin, x)
            else:
                x = self.delta_net(p + "linear_attn.", h, x)
            h = ops.rms_norm(x, self.w(p + "post_attention_layernorm.weight"), eps, offset=1.0, operand=True)
            x = self.mlp(p + "mlp.", h, x)
            if on_layer is not None:
                on_layer(i, x)
        x = ops.rms_norm(x, self.w("norm.weight"), eps, offset=1.0)
        return ops.host(x)

    def mlp(self, p, h, x):
        ops = self.ops
        gate, up = ops.linears(h, self.ws(p + "gate_proj.weight", p + "up_proj.weight"), narrow=True)
        return ops.linear(ops.swiglu(gate, up, operand=True), self.w(p + "down_proj.weight"), residual=x)

    def attention(self, p, h, cos, sin, x):
        """Gated full attention: per head, q_proj rows [query | gate]; q/k norms, partial RoPE, causal GQA."""
        ops, c = self.ops, self.config
        L, hd, nq, nkv = h.shape[0], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
        eps = c["rms_norm_eps"]
        both, k, v = ops.linears(h, self.ws(p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"))
        q, gate = ops.split(ops.reshape(both, (L, nq, 2 * hd)), (hd, hd))
        k = ops.reshape(k, (L, nkv, hd))
        v = ops.reshape(v, (L, nkv, hd))
        q = ops.rms_norm_rope(q, self.w(p + "q_norm.weight"), cos, sin, eps, offset=1.0)
        k = ops.rms_norm_rope(k, self.w(p + "k_norm.weight"), cos, sin, eps, offset=1.0)
        o = ops.sigmoid_gate(ops.attention(q, k, v, hd ** -0.5, causal=True), gate, operand=True)
        return ops.linear(ops.reshape(o, (L, nq * hd)), self.w(p + "o_proj.weight"), residual=x)

    def delta_net(self, p, h, x):
        """Gated DeltaNet: conv over [q | k | v] channels, L2-normed q/k, decay g and write strength beta."""
        ops, c = self.ops, self.config
        L = h.shape[0]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        conv_w = self.w(p + "conv1d.weight")
        mixed, z, b, a = ops.linears(h, self.ws(*(p + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a"))))
        q, k, v, g, beta = ops.gdn_inputs(mixed, ops.reshape(conv_w, (conv_w.shape[0], conv_w.shape[2])), a, b,
                                          self.w(p + "A_log"), self.w(p + "dt_bias"), (hk, dk, hv, dv), L2_EPS)
        o = ops.gated_delta_rule(q, k, v, g, beta, form=self.form)
        z = ops.reshape(z, (L, hv, dv))
        y = ops.gated_rms_norm(o, z, self.w(p + "norm.weight"), c["rms_norm_eps"], operand=True)
        return ops.linear(ops.reshape(y, (L, hv * dv)), self.w(p + "out_proj.weight"), residual=x)
