"""The work a stage cannot do without, as FLOPs: the floors of BENCHMARKS.md (a stage's FLOPs at the product
rate torch.matmul reaches in the same run). Counts of multiply-adds x 2 of the products alone; the elementwise
work, the text refiner and the DiT's embedders are left out, so a floor is a lower bound."""

import re


def block_pass_flops(cfg, n):
    """One DiT joint block over n tokens (image + text): q/k/v/o (4 d^2), the SiTU-GLU MLP (3 d f) and the
    attention's two products over n x n."""
    d, f = cfg["dim"], cfg["ffn_dim"]
    return 2 * n * (4 * d * d + 3 * d * f) + 4 * n * n * d


def step_flops(cfg, tokens, text, layers_run):
    """`layers_run` block passes over tokens + text tokens (a CFG step: both passes' blocks)."""
    return block_pass_flops(cfg, tokens + text) * layers_run


def denoise_flops(cfg, tokens, cond, uncond, steps, skip=0, skip_start=0.0, skip_stop=1.0):
    """A whole CFG trajectory: each step a conditional pass over tokens + cond text tokens (every block) and an
    unconditional one over tokens + uncond, `skip` blocks fewer at steps i with skip_start <= i / steps <
    skip_stop (denoiser.md 5.3); uncond None: no CFG."""
    layers, total = cfg["num_layers"], 0
    for i in range(steps):
        total += block_pass_flops(cfg, tokens + cond) * layers
        if uncond is not None:
            skipped = skip if skip_start <= i / steps < skip_stop else 0
            total += block_pass_flops(cfg, tokens + uncond) * (layers - skipped)
    return total


def decode_flops(config, size):
    """One decode of a size x size picture: every convolution at the resolution it runs at (the latents' is
    size / 8; up block i's resnets at 2^i times that, its upsampler's conv at twice theirs) and the mid-block
    attention (its four projections and its two products over (size / 8)^2 tokens)."""
    from moss_cli import vae
    base = size // 8
    flops = 0
    for name, shape in vae.expected_tensors(config).items():
        if len(shape) < 2:            # norms and biases
            continue
        side = base
        up = re.match(r"decoder\.up_blocks\.(\d+)\.", name)
        if up:
            side = base << (int(up.group(1)) + ("upsamplers" in name))
        elif name.startswith("decoder.conv_out"):
            side = size
        taps = shape[2] * shape[3] if len(shape) == 4 else 1
        flops += 2 * shape[0] * shape[1] * taps * side * side
    tokens, width = base * base, config["decoder_block_out_channels"][-1]
    return flops + 2 * 2 * tokens * tokens * width
