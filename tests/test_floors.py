"""scripts/floors.py's decode_flops (the decoder floor's FLOPs in BENCHMARKS.md) against torch's own count
of the torch statement's decode (torch.utils.flop_counter) at a small size of the real small config."""

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from floors import block_pass_flops, decode_flops, denoise_flops, step_flops
from gpu_decoder import SMALL, random_tensors
from reference import vae_decoder


def _counted(size):
    t = vae_decoder.weights(random_tensors(SMALL), torch.float32, "cpu")
    latents = torch.zeros(1, 128, size // 16, size // 16)
    # the math backend: its products are matmuls the counter sees (it has no formula for the CPU's fused kernel)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        vae_decoder.decode(t, SMALL, latents)
    return counter.get_total_flops()


def test_decode_flops_equal_torch_count():
    counted = _counted(64)
    assert decode_flops(SMALL, 64) == counted
    # planted: the attention's two products left out, as a count of the convolutions and projections alone
    # would be, is caught
    tokens, width = (64 // 8) ** 2, SMALL["decoder_block_out_channels"][-1]
    assert decode_flops(SMALL, 64) - 4 * tokens * tokens * width != counted
    # and the count scales as the work does: 4x the pixels, 4x the convolutions, 16x the attention's products
    assert decode_flops(SMALL, 128) == _counted(128)
    assert np.isclose(decode_flops(SMALL, 128) / decode_flops(SMALL, 64), 4, rtol=0.05)


def _velocity_flops(st, latents, text, skip):
    mod, head = st.conditioning(500.0)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        st.velocity(latents, mod, head, text, skip)
    return counter.get_total_flops()


def test_a_dit_block_pass_equals_torch_count():
    """One block's products, as torch counts the float64 statement of the DiT on the tiny checkpoint: a velocity
    call with a block skipped does block_pass_flops fewer; the rest of the call is the two embedding products."""
    from moss_cli.checkpoint import open_checkpoint
    from reference.dit import Statement
    comp = open_checkpoint().component("transformer")
    cfg = comp.config
    st = Statement(comp.tensors, cfg)
    c, (h, w), n_text = cfg["latent_channels"], (3, 4), 5
    latents = torch.from_numpy(np.random.default_rng(0).standard_normal((1, c, h, w)))
    text = torch.from_numpy(np.random.default_rng(1).standard_normal((n_text, cfg["dim"])))
    whole, skipped = _velocity_flops(st, latents, text, ()), _velocity_flops(st, latents, text, (1,))
    block = block_pass_flops(cfg, h * w + n_text)
    assert whole - skipped == block
    assert whole == cfg["num_layers"] * block + 2 * (2 * h * w * c * cfg["dim"])
    # planted: the attention counted over the image tokens alone (the text left out of its n x n) is caught
    assert whole - skipped != 2 * (h * w + n_text) * (4 * cfg["dim"] ** 2 + 3 * cfg["dim"] * cfg["ffn_dim"]) \
        + 4 * (h * w) ** 2 * cfg["dim"]


def test_denoise_flops_counts_each_pass_of_each_step():
    cfg = {"dim": 8, "ffn_dim": 16, "num_layers": 4}
    steps, tokens, cond, uncond = 50, 64, 7, 2
    got = denoise_flops(cfg, tokens, cond, uncond, steps, skip=1, skip_start=0.01, skip_stop=1.0)
    # step 0 (i / N = 0 < 0.01) runs the negative pass whole, steps 1..49 skip one block of it
    want = steps * 4 * block_pass_flops(cfg, tokens + cond) + (steps * 4 - 49) * block_pass_flops(cfg, tokens + uncond)
    assert got == want
    assert denoise_flops(cfg, tokens, cond, None, steps) == steps * step_flops(cfg, tokens, cond, 4)
