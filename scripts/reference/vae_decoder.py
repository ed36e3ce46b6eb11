"""A torch statement of the FLUX.2 (small) VAE decode, written from diffusers' AutoencoderKLFlux2 and the FLUX.2
pipeline (BN de-normalisation, 2x2 unpatchify, post_quant_conv, Decoder): conv2d, group_norm, silu,
nearest interpolation, SDPA. It runs in whatever dtype and device its weights have (float64 for a reference,
float32 with or without TF32 convolutions as a baseline); tests hold it against diffusers and moss_cli.vae.
"""

import numpy as np
import torch
import torch.nn.functional as F


def weights(tensors, dtype, device):
    """The state dict's tensors as torch tensors of one dtype on one device (read-only arrays, such as a
    checkpoint's memory map, are copied first: torch does not take them)."""
    return {k: torch.as_tensor(v if not isinstance(v, np.ndarray) or v.flags.writeable else np.array(v))
            .to(device=device, dtype=dtype) for k, v in tensors.items()
            if not k.endswith("num_batches_tracked")}


def decode(t, config, latents):
    """Packed latents [1, 128, h, w] -> image [1, 3, 16h, 16w] (before the clamp)."""
    enc = config.get("block_out_channels", (128, 256, 512, 512))
    widths = list(config.get("decoder_block_out_channels") or enc)
    groups, layers = config.get("norm_num_groups", 32), config.get("layers_per_block", 2)
    eps = config.get("batch_norm_eps", 1e-4)

    def conv(x, name, padding):
        return F.conv2d(x, t[name + ".weight"], t[name + ".bias"], padding=padding)

    def norm(x, name):
        return F.group_norm(x, groups, t[name + ".weight"], t[name + ".bias"], 1e-6)

    def resnet(x, p):
        h = conv(F.silu(norm(x, p + "norm1")), p + "conv1", 1)
        h = conv(F.silu(norm(h, p + "norm2")), p + "conv2", 1)
        return (conv(x, p + "conv_shortcut", 0) if p + "conv_shortcut.weight" in t else x) + h

    def attention(x, p):
        b, c, h, w = x.shape
        n = norm(x, p + "group_norm").view(b, c, h * w).transpose(1, 2)
        q, k, v = (F.linear(n, t[p + s + ".weight"], t[p + s + ".bias"])[:, None] for s in ("to_q", "to_k", "to_v"))
        o = F.scaled_dot_product_attention(q, k, v)[:, 0]
        o = F.linear(o, t[p + "to_out.0.weight"], t[p + "to_out.0.bias"])
        return x + o.transpose(1, 2).reshape(b, c, h, w)

    z = latents.to(t["bn.running_mean"]) * torch.sqrt(t["bn.running_var"] + eps).view(1, -1, 1, 1) \
        + t["bn.running_mean"].view(1, -1, 1, 1)
    # unpatchify: (B, 128, h, w) -> (B, 32, 2, 2, h, w) -> (B, 32, h, 2, w, 2)
    b, c4, h, w = z.shape
    z = z.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, 2 * h, 2 * w)
    if "post_quant_conv.weight" in t:
        z = conv(z, "post_quant_conv", 0)
    x = conv(z, "decoder.conv_in", 1)
    x = resnet(x, "decoder.mid_block.resnets.0.")
    if "decoder.mid_block.attentions.0.to_q.weight" in t:
        x = attention(x, "decoder.mid_block.attentions.0.")
    x = resnet(x, "decoder.mid_block.resnets.1.")
    for i in range(len(widths)):
        for j in range(layers + 1):
            x = resnet(x, f"decoder.up_blocks.{i}.resnets.{j}.")
        if f"decoder.up_blocks.{i}.upsamplers.0.conv.weight" in t:
            x = conv(F.interpolate(x, scale_factor=2.0, mode="nearest"), f"decoder.up_blocks.{i}.upsamplers.0.conv", 1)
    return conv(F.silu(norm(x, "decoder.conv_norm_out")), "decoder.conv_out", 1)


def to_pixels(image):
    """diffusers' postprocess of [1, 3, H, W] (after the clamp to [-1, 1]): uint8 [H, W, 3] on the host."""
    p = (image.clamp(-1, 1).float() * 0.5 + 0.5).clamp(0, 1)
    return (p[0].permute(1, 2, 0).cpu().numpy() * 255).round().astype("uint8")
