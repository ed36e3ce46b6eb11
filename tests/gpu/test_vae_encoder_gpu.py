"""On a GPU: the VAE encoder (CudaImageEncoder: split fp16 products, the downsamplers as tap products over their
input's phases, one CUDA graph per image size) against the numpy float32 and float64 encoders and against
diffusers' AutoencoderKLFlux2 in float32 on the GPU (TF32 off), on the tiny checkpoint; at the real encoder's
widths with random weights against float64; moss-encode-image --device cuda against --device cpu.

Gates: latents relative L2 error (each test prints its measurement), 2x the worst measured on an H100 at 24c023c
(results/h100/tests_gpu-24c023c.txt): GATE, on the tiny checkpoint against the numpy float32 and float64 encoders
(worst 2.94e-6, against float32 at 128x128, whose own error is part of it; 1.18e-6 against float64) and
diffusers' float32, and the CLI on the GPU against the CPU (1.6e-6); REAL_GATE, at the real widths against
float64 (3.8e-6; the numpy float32 encoder 6.1e-6 there). The planted control, every GroupNorm's epsilon x10,
measured 7.3e-5 there: it fails GATE by 12x. diffusers is
not on the GPU image: its test skips unless the vae_encoder step of scripts/gpu_run.sh put it on the path.
"""

import numpy as np
import pytest

import cuda_kernels

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")

GATE = 6e-6
REAL_GATE = 8e-6


def rel_l2(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def a_picture(h, w):
    """A smooth image in [-1, 1] (a photo's spectrum more than noise's), 3 x h x w."""
    yy, xx = np.mgrid[0:h, 0:w]
    return np.stack([np.sin(xx / 9 + c) * np.cos(yy / 7 - c) for c in range(3)]).astype(np.float32)


@pytest.fixture(scope="module")
def component():
    from moss_cli.checkpoint import open_checkpoint
    return open_checkpoint().component("vae")


@pytest.fixture(scope="module")
def encoder(component):
    from moss_cli.gpu.image_encoder import CudaImageEncoder
    return CudaImageEncoder(component.tensors, component.config)


def _numpy(component, image, dtype):
    from moss_cli import vae
    from moss_cli.ops import numpy_ops
    return vae.Encoder(numpy_ops(dtype), component.tensors, component.config)(image.astype(dtype))


@pytest.mark.parametrize("h,w", [(64, 96), (128, 128)])
def test_gpu_latents_match_the_numpy_encoder(component, encoder, h, w):
    for image in (a_picture(h, w), np.random.default_rng(h + w).uniform(-1, 1, (3, h, w)).astype(np.float32)):
        gpu = encoder(image)
        assert gpu.shape == (1, 128, h // 16, w // 16) and gpu.dtype == np.float32
        errors = {np.dtype(d).name: rel_l2(gpu, _numpy(component, image, d)) for d in (np.float32, np.float64)}
        print(f"{h}x{w}: relative L2 " + ", ".join(f"vs numpy {k} {v:.3g}" for k, v in errors.items()))
        assert max(errors.values()) <= GATE


def test_graph_replays_are_byte_identical_and_equal_the_eager_ops(component, encoder):
    from moss_cli.gpu.image_encoder import CudaImageEncoder
    image = a_picture(48, 80)
    first, second = encoder(image), encoder(image)
    assert first.tobytes() == second.tobytes()
    other = np.random.default_rng(3).uniform(-1, 1, image.shape).astype(np.float32)
    assert encoder(other).tobytes() != first.tobytes()          # each replay reads its own image
    assert encoder(image).tobytes() == first.tobytes()
    eager = CudaImageEncoder(component.tensors, component.config, graphs=False)(image)
    assert eager.tobytes() == first.tobytes()


def test_a_groupnorm_epsilon_ten_times_too_large_fails_the_gate(component, monkeypatch):
    from moss_cli import vae
    from moss_cli.gpu.image_encoder import CudaImageEncoder
    image = a_picture(64, 96)
    ref = _numpy(component, image, np.float64)
    monkeypatch.setattr(vae, "NORM_EPS", 10 * vae.NORM_EPS)
    err = rel_l2(CudaImageEncoder(component.tensors, component.config, graphs=False)(image), ref)
    print(f"GroupNorm epsilon x10: relative L2 {err:.3g}")
    assert err > GATE


def test_gpu_latents_match_diffusers_float32_on_the_gpu(component, encoder):
    """AutoencoderKLFlux2.encode's posterior mode, the FLUX.2 pipelines' _patchify_latents and BN normalisation,
    float32 with TF32 off (convolutions and products in IEEE float32)."""
    pytest.importorskip("diffusers", reason="diffusers is not installed (gpu_run.sh's vae_encoder step brings it)")
    import torch
    from diffusers import AutoencoderKLFlux2
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
    from moss_cli.checkpoint import EMBEDDED
    model = AutoencoderKLFlux2.from_pretrained(EMBEDDED / "vae", torch_dtype=torch.float32).cuda().eval()
    cudnn, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for h, w in ((64, 96), (256, 256)):
            image = a_picture(h, w)
            with torch.no_grad():
                z = model.encode(torch.from_numpy(image).cuda()[None]).latent_dist.mode()
                z = Flux2Pipeline._patchify_latents(z)
                std = torch.sqrt(model.bn.running_var.view(1, -1, 1, 1) + model.config.batch_norm_eps)
                ref = ((z - model.bn.running_mean.view(1, -1, 1, 1)) / std).cpu().numpy()
            err = rel_l2(encoder(image), ref)
            print(f"{h}x{w}: relative L2 vs diffusers float32 (GPU, TF32 off) {err:.3g}")
            assert err <= GATE
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = cudnn, matmul


def test_real_widths_with_random_weights_match_float64():
    """The real encoder's widths (128, 256, 512, 512; GroupNorm 32), random weights of realistic scale
    (scripts/gpu_vae_encoder.py's), at 256x256: the mid block's attention over 1024 pixels of 512 channels."""
    from gpu_vae_encoder import REAL, random_tensors
    from moss_cli import vae
    from moss_cli.ops import numpy_ops
    from moss_cli.gpu.image_encoder import CudaImageEncoder
    tensors = random_tensors(REAL, 0)
    image = a_picture(256, 256)
    ours = CudaImageEncoder(tensors, REAL)(image)
    ref = vae.Encoder(numpy_ops(np.float64), tensors, REAL)(image.astype(np.float64))
    err = rel_l2(ours, ref)
    numpy32 = rel_l2(vae.Encoder(numpy_ops(np.float32), tensors, REAL)(image), ref)
    print(f"real widths 256x256: relative L2 vs float64 {err:.3g} (numpy float32 {numpy32:.3g})")
    assert err <= REAL_GATE


def test_moss_encode_image_on_the_gpu_matches_the_cpu(tmp_path):
    import subprocess
    import sys
    from PIL import Image
    from moss_cli.safetensors_io import load
    pixels = ((a_picture(70, 100) * 0.5 + 0.5) * 255).round().astype(np.uint8).transpose(1, 2, 0)
    Image.fromarray(pixels).save(tmp_path / "in.png")
    out = {}
    for device in ("cuda", "cpu", "auto"):
        r = subprocess.run([sys.executable, "-c", "from moss_cli.cli import encode_image_command as c; c()",
                            str(tmp_path / "in.png"), "--device", device, "--out", str(tmp_path / f"{device}.lat")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        out[device] = load(tmp_path / f"{device}.lat")
    assert out["cuda"][1]["moss.device"] == "cuda" and out["cpu"][1]["moss.device"] == "cpu"
    assert (tmp_path / "auto.lat").read_bytes() == (tmp_path / "cuda.lat").read_bytes()   # auto: the GPU
    gpu, cpu = out["cuda"][0]["latents"], out["cpu"][0]["latents"]
    assert gpu.shape == cpu.shape == (1, 128, 4, 6)
    err = rel_l2(gpu, cpu)
    print(f"moss-encode-image --device cuda vs cpu: relative L2 {err:.3g}")
    assert err <= GATE
