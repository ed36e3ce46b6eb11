"""FLUX.2 VAE: the (small) decoder, packed 128-channel latents -> RGB image in [-1, 1], and diffusers' uint8
rounding; the encoder, RGB image -> packed latents, its exact inverse path (posterior mode, patchify, BN).

Tensor names are diffusers' AutoencoderKLFlux2 state dict names; both graphs share the blocks (resnets,
mid-block attention) and the op table.
"""

import math

import numpy as np

from .errors import ArtifactError

BATCH_NORM_EPS = 1e-4   # config batch_norm_eps default; the pipeline adds it to bn.running_var
NORM_EPS = 1e-6         # every GroupNorm of both graphs (hard-coded in diffusers' Encoder and Decoder)
ATTENTION_ROWS = 4096   # query rows per attention call, so the score matrix stays small on the CPU


def _config(config):
    """The decode-relevant settings with diffusers' defaults."""
    encoder_widths = list(config.get("block_out_channels", (128, 256, 512, 512)))
    return {
        "widths": list(config.get("decoder_block_out_channels") or encoder_widths),
        "encoder_widths": encoder_widths,
        "in": int(config.get("in_channels", 3)),
        "quant_conv": bool(config.get("use_quant_conv", True)),
        "layers": int(config.get("layers_per_block", 2)),
        "latent": int(config.get("latent_channels", 32)),
        "groups": int(config.get("norm_num_groups", 32)),
        "out": int(config.get("out_channels", 3)),
        "patch": tuple(config.get("patch_size", (2, 2))),
        "post_quant_conv": bool(config.get("use_post_quant_conv", True)),
        "attention": bool(config.get("mid_block_add_attention", True)),
        "bn_eps": float(config.get("batch_norm_eps", BATCH_NORM_EPS)),
    }


def _up_blocks(widths):
    """(input width, output width, has upsampler) of each diffusers up_blocks[i], deepest first."""
    rev = list(reversed(widths))
    return [(rev[max(i - 1, 0)], rev[i], i < len(rev) - 1) for i in range(len(rev))]


def _resnet_tensors(prefix, cin, cout):
    t = {
        prefix + "norm1.weight": (cin,), prefix + "norm1.bias": (cin,),
        prefix + "conv1.weight": (cout, cin, 3, 3), prefix + "conv1.bias": (cout,),
        prefix + "norm2.weight": (cout,), prefix + "norm2.bias": (cout,),
        prefix + "conv2.weight": (cout, cout, 3, 3), prefix + "conv2.bias": (cout,),
    }
    if cin != cout:
        t[prefix + "conv_shortcut.weight"] = (cout, cin, 1, 1)
        t[prefix + "conv_shortcut.bias"] = (cout,)
    return t


def expected_tensors(config):
    """Every tensor the decode path reads, name -> shape."""
    c = _config(config)
    lat, top, packed = c["latent"], c["widths"][-1], c["latent"] * math.prod(c["patch"])
    t = {"bn.running_mean": (packed,), "bn.running_var": (packed,)}
    if c["post_quant_conv"]:
        t["post_quant_conv.weight"] = (lat, lat, 1, 1)
        t["post_quant_conv.bias"] = (lat,)
    t["decoder.conv_in.weight"] = (top, lat, 3, 3)
    t["decoder.conv_in.bias"] = (top,)
    for j in range(2):
        t.update(_resnet_tensors(f"decoder.mid_block.resnets.{j}.", top, top))
    if c["attention"]:
        t.update(_attention_tensors("decoder.mid_block.attentions.0.", top))
    for i, (cin, cout, up) in enumerate(_up_blocks(c["widths"])):
        for j in range(c["layers"] + 1):
            t.update(_resnet_tensors(f"decoder.up_blocks.{i}.resnets.{j}.", cin if j == 0 else cout, cout))
        if up:
            t[f"decoder.up_blocks.{i}.upsamplers.0.conv.weight"] = (cout, cout, 3, 3)
            t[f"decoder.up_blocks.{i}.upsamplers.0.conv.bias"] = (cout,)
    bottom = c["widths"][0]
    t["decoder.conv_norm_out.weight"] = (bottom,)
    t["decoder.conv_norm_out.bias"] = (bottom,)
    t["decoder.conv_out.weight"] = (c["out"], bottom, 3, 3)
    t["decoder.conv_out.bias"] = (c["out"],)
    return t


def _attention_tensors(prefix, width):
    """The mid block's attention: its group norm and the four projections of `width` channels."""
    t = {prefix + "group_norm.weight": (width,), prefix + "group_norm.bias": (width,)}
    for proj in ("to_q", "to_k", "to_v", "to_out.0"):
        t[prefix + proj + ".weight"] = (width, width)
        t[prefix + proj + ".bias"] = (width,)
    return t


def expected_encoder_tensors(config):
    """Every tensor the encode path reads, name -> shape (bn.* are the decoder's too)."""
    c = _config(config)
    widths, lat, packed = c["encoder_widths"], c["latent"], c["latent"] * math.prod(c["patch"])
    top = widths[-1]
    t = {"bn.running_mean": (packed,), "bn.running_var": (packed,),
         "encoder.conv_in.weight": (widths[0], c["in"], 3, 3), "encoder.conv_in.bias": (widths[0],)}
    for i, (cin, cout, down) in enumerate(_down_blocks(widths)):
        for j in range(c["layers"]):
            t.update(_resnet_tensors(f"encoder.down_blocks.{i}.resnets.{j}.", cin if j == 0 else cout, cout))
        if down:
            t[f"encoder.down_blocks.{i}.downsamplers.0.conv.weight"] = (cout, cout, 3, 3)
            t[f"encoder.down_blocks.{i}.downsamplers.0.conv.bias"] = (cout,)
    for j in range(2):
        t.update(_resnet_tensors(f"encoder.mid_block.resnets.{j}.", top, top))
    if c["attention"]:
        t.update(_attention_tensors("encoder.mid_block.attentions.0.", top))
    t["encoder.conv_norm_out.weight"] = (top,)
    t["encoder.conv_norm_out.bias"] = (top,)
    t["encoder.conv_out.weight"] = (2 * lat, top, 3, 3)
    t["encoder.conv_out.bias"] = (2 * lat,)
    if c["quant_conv"]:
        t["quant_conv.weight"] = (2 * lat, 2 * lat, 1, 1)
        t["quant_conv.bias"] = (2 * lat,)
    return t


def _down_blocks(widths):
    """(input width, output width, has downsampler) of each diffusers down_blocks[i]."""
    return [(widths[max(i - 1, 0)], widths[i], i < len(widths) - 1) for i in range(len(widths))]


def _bn_std_mean(ops, tensors, eps):
    """sqrt(bn.running_var + eps) and bn.running_mean as [128, 1, 1] op-table arrays, in the compute dtype, as the
    pipelines build them before the multiply-add (decode) or the subtract-divide (encode)."""
    var = np.asarray(tensors["bn.running_var"]).astype(ops.dtype)
    mean = np.asarray(tensors["bn.running_mean"]).astype(ops.dtype)
    return ops.array(np.sqrt(var + ops.dtype.type(eps))[:, None, None]), ops.array(mean[:, None, None])


class _Blocks:
    """The blocks both graphs are made of, over an op table: convs, GroupNorms, ResnetBlock2D, mid-block attention."""

    def _p(self, name):
        return self.ops.param(self.tensors, name)

    def _conv(self, x, prefix, padding, residual=None):
        return self.ops.conv2d(x, self._p(prefix + "weight"), self._p(prefix + "bias"), padding, residual=residual)

    def _norm(self, x, prefix):
        return self.ops.group_norm(x, self.c["groups"], self._p(prefix + "weight"), self._p(prefix + "bias"), NORM_EPS)

    def _norm_silu(self, x, prefix):
        return self.ops.group_norm_silu(x, self.c["groups"], self._p(prefix + "weight"), self._p(prefix + "bias"),
                                        NORM_EPS)

    def _resnet(self, x, prefix):
        """ResnetBlock2D: x + conv2(silu(norm2(conv1(silu(norm1(x)))))), x through a 1x1 conv_shortcut when widths
        differ. The sum is the last conv's residual (x + h and h + x are the same float): conv2's, or the
        shortcut's after conv2; each intermediate is let go as soon as the next op has read it."""
        h = self._conv(self._norm_silu(x, prefix + "norm1."), prefix + "conv1.", 1)
        h = self._norm_silu(h, prefix + "norm2.")
        if x.shape[0] == h.shape[0]:
            return self._conv(h, prefix + "conv2.", 1, residual=x)
        h = self._conv(h, prefix + "conv2.", 1)
        return self._conv(x, prefix + "conv_shortcut.", 0, residual=h)

    def _attention(self, x, prefix):
        """Single-head self-attention over the H*W pixels (head dim = C, scale 1/sqrt(C)), plus the residual."""
        ops = self.ops
        ch, h, w = x.shape
        n = h * w
        t = ops.transpose(ops.reshape(self._norm(x, prefix + "group_norm."), (ch, n)), (1, 0))   # [N, C]
        q, k, v = (ops.reshape(ops.linear(t, self._p(prefix + p + ".weight"), self._p(prefix + p + ".bias")), (n, 1, ch))
                   for p in ("to_q", "to_k", "to_v"))
        scale = 1.0 / math.sqrt(ch)
        o = ops.concat([ops.attention(ops.slice(q, 0, r, min(n, r + ATTENTION_ROWS)), k, v, scale)
                        for r in range(0, n, ATTENTION_ROWS)], axis=0)
        o = ops.linear(ops.reshape(o, (n, ch)), self._p(prefix + "to_out.0.weight"), self._p(prefix + "to_out.0.bias"))
        return ops.add(x, ops.reshape(ops.transpose(o, (1, 0)), (ch, h, w)))


class Encoder(_Blocks):
    """image [3, H, W] in [-1, 1] (H, W multiples of 16) -> packed, BN-normalised latents [1, 128, H/16, W/16]: the
    FLUX.2 pipelines' _encode_vae_image (posterior mode, _patchify_latents, (z - mean) / std)."""

    def __init__(self, ops, tensors, config):
        self.ops = ops
        self.tensors = tensors
        self.c = _config(config)
        self.bn_std, self.bn_mean = _bn_std_mean(ops, tensors, self.c["bn_eps"])
        lat = self.c["latent"]
        # quant_conv is 1x1: its first `lat` output channels, the mean, read all 2*lat inputs and nothing else
        self.quant_mean = {name: tensors[name][:lat] for name in ("quant_conv.weight", "quant_conv.bias")
                           if self.c["quant_conv"]}

    def check(self, image):
        """The image as an array, or ArtifactError where its shape is not [3, H, W] of multiples of 16."""
        c = self.c
        image = np.asarray(image)
        step = 2 ** (len(c["encoder_widths"]) - 1) * c["patch"][0]
        if image.ndim != 3 or image.shape[0] != c["in"] or image.shape[1] % step or image.shape[2] % step:
            raise ArtifactError(f"image has shape {list(image.shape)}, the VAE encoder expects [{c['in']}, H, W] "
                                f"with H and W multiples of {step}")
        return image

    def __call__(self, image):
        """The latents on the host, in the op table's dtype."""
        ops, c = self.ops, self.c
        pi, pj = c["patch"]
        z = self.mode(ops.array(self.check(image)))
        lat, h, w = z.shape[0], z.shape[1] // pi, z.shape[2] // pj
        # patchify: channel c, pixel (2y + i, 2x + j) -> packed channel 4c + 2i + j
        z = ops.reshape(ops.transpose(ops.reshape(z, (lat, h, pi, w, pj)), (0, 2, 4, 1, 3)), (lat * pi * pj, h, w))
        z = ops.div(ops.sub(z, self.bn_mean), self.bn_std)
        return ops.host(ops.reshape(z, (1, lat * pi * pj, h, w)))

    def mode(self, x):
        """The posterior's mode (the mean half of quant_conv's output) of image x [3, H, W] -> [latent, H/8, W/8]."""
        ops, c = self.ops, self.c
        x = self._conv(x, "encoder.conv_in.", 1)
        for i, (_, _, down) in enumerate(_down_blocks(c["encoder_widths"])):
            for j in range(c["layers"]):
                x = self._resnet(x, f"encoder.down_blocks.{i}.resnets.{j}.")
            if down:
                prefix = f"encoder.down_blocks.{i}.downsamplers.0.conv."
                x = ops.downsample_conv(x, self._p(prefix + "weight"), self._p(prefix + "bias"))
        x = self._resnet(x, "encoder.mid_block.resnets.0.")
        if c["attention"]:
            x = self._attention(x, "encoder.mid_block.attentions.0.")
        x = self._resnet(x, "encoder.mid_block.resnets.1.")
        x = self._conv(self._norm_silu(x, "encoder.conv_norm_out."), "encoder.conv_out.", 1)
        if not c["quant_conv"]:
            return ops.slice(x, 0, 0, c["latent"])
        return ops.conv2d(x, ops.param(self.quant_mean, "quant_conv.weight"),
                          ops.param(self.quant_mean, "quant_conv.bias"), 0)


class Decoder(_Blocks):
    """latents [1, 128, h, w] (the transformer's packed, BN-normalised space) -> image [3, 16h, 16w] in [-1, 1]."""

    def __init__(self, ops, tensors, config):
        self.ops = ops
        self.tensors = tensors
        self.c = _config(config)
        self.bn_std, self.bn_mean = _bn_std_mean(ops, tensors, self.c["bn_eps"])

    def __call__(self, latents):
        """The clamped image on the host, in the op table's dtype."""
        return self.ops.host(self.ops.clamp(self.raw(latents), -1.0, 1.0))

    def raw(self, latents):
        """The decoder output before the clamp, as an op-table array [3, H, W]."""
        ops, c = self.ops, self.c
        pi, pj = c["patch"]
        packed = c["latent"] * pi * pj
        latents = np.asarray(latents)
        if latents.ndim != 4 or latents.shape[0] != 1 or latents.shape[1] != packed:
            raise ArtifactError(f"latents have shape {list(latents.shape)}, the VAE expects [1, {packed}, h, w]")
        _, _, h, w = latents.shape
        z = ops.array(latents[0])
        z = ops.add(ops.mul(z, self.bn_std), self.bn_mean)
        # unpatchify: packed channel 4c + 2i + j -> channel c, pixel (2y + i, 2x + j)
        z = ops.reshape(z, (c["latent"], pi, pj, h, w))
        z = ops.reshape(ops.transpose(z, (0, 3, 1, 4, 2)), (c["latent"], h * pi, w * pj))
        return self.decode_image(z)

    def decode_image(self, z):
        """The unpatchified latent image z [latent, H/8, W/8] (an op-table array) -> the decoder output [3, H, W]."""
        ops, c = self.ops, self.c
        if c["post_quant_conv"]:
            z = self._conv(z, "post_quant_conv.", 0)
        x = self._conv(z, "decoder.conv_in.", 1)
        x = self._resnet(x, "decoder.mid_block.resnets.0.")
        if c["attention"]:
            x = self._attention(x, "decoder.mid_block.attentions.0.")
        x = self._resnet(x, "decoder.mid_block.resnets.1.")
        for i, (_, _, up) in enumerate(_up_blocks(c["widths"])):
            for j in range(c["layers"] + 1):
                x = self._resnet(x, f"decoder.up_blocks.{i}.resnets.{j}.")
            if up:
                x = self._conv(ops.upsample_nearest2x(x), f"decoder.up_blocks.{i}.upsamplers.0.conv.", 1)
        return self._conv(self._norm_silu(x, "decoder.conv_norm_out."), "decoder.conv_out.", 1)


def to_pixels(image):
    """diffusers' postprocess of a [3, H, W] image: float32 x*0.5+0.5, clamp to [0, 1], *255, round half to even."""
    x = np.asarray(image, dtype=np.float32)
    p = np.clip(x * np.float32(0.5) + np.float32(0.5), np.float32(0), np.float32(1))
    return np.round(np.transpose(p, (1, 2, 0)) * np.float32(255)).astype(np.uint8)
