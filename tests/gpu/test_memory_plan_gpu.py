"""On a GPU: layers streamed through the device window (cuda_window) give the resident model's bytes.

The tiny checkpoint's DiT trajectory (graphs captured per step, the copies prefetched inside them) and its
encoder's rows (a captured bucket, and the eager pass), with some layers streamed, against the same runs with
every layer resident: equal byte for byte, since only the weights' addresses differ. The planted control: a
window that copies a neighbouring layer's matrices into the slot must change the bytes (so the comparison
sees what the slots hold). The CLI: moss-image under a plan that streams, against the all-resident picture.
"""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cuda_kernels

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint():
    from moss_cli.checkpoint import open_checkpoint
    return open_checkpoint()


def _trajectory(component, streamed):
    from moss_cli.gpu.denoiser import CudaDenoiser
    from moss_cli.schedule import sigmas
    dit = CudaDenoiser(component.tensors, component.config, streamed=streamed)
    dit.upload()
    rng = np.random.default_rng(5)
    cond = dit.prepare_text(rng.standard_normal((7, 32)).astype(np.float32))
    uncond = dit.prepare_text(rng.standard_normal((5, 32)).astype(np.float32))
    noise = rng.standard_normal((1, 128, 4, 6)).astype(np.float32)
    return dit.sample(noise, sigmas(4, shift=3.0), cond, uncond, 3.0, (22,), 0.01, 1.0)


def test_streamed_dit_blocks_give_the_resident_trajectory_byte_for_byte(checkpoint):
    component = checkpoint.component("transformer")
    resident = _trajectory(component, ())
    for streamed in ((0, 5, 22, 23), tuple(range(1, 24, 2))):
        out = _trajectory(component, streamed)
        assert out.tobytes() == resident.tobytes(), streamed


def test_planted_wrong_layer_in_the_slot_changes_the_trajectory(checkpoint, monkeypatch):
    from moss_cli.memory import window as cuda_window
    component = checkpoint.component("transformer")
    resident = _trajectory(component, ())
    real = cuda_window.Window._copy

    def neighbour(self, layer, t, stream):
        layers = sorted(self.host)
        return real(self, layers[(layers.index(layer) + 1) % len(layers)], t, stream)
    monkeypatch.setattr(cuda_window.Window, "_copy", neighbour)
    out = _trajectory(component, (2, 3, 9))
    assert out.tobytes() != resident.tobytes()


def test_streamed_encoder_layers_give_the_resident_rows_byte_for_byte(checkpoint):
    from moss_cli.gpu.encoder import cuda_encoder
    component = checkpoint.component("text_encoder")
    ids = np.random.default_rng(3).integers(0, 200, size=37)
    resident = cuda_encoder(component)(ids)
    for graphs in (True, False):
        rows = cuda_encoder(component, graphs=graphs, streamed=(0, 2, 3))(ids)
        assert np.asarray(rows).tobytes() == np.asarray(resident).tobytes(), graphs


def _image(tmp_path, name, env=()):
    out = tmp_path / name
    cmd = [sys.executable, "-c", "from moss_cli.cli import image_command; image_command()", "--prompt",
           "a red fox", "--seed", "7", "--width", "64", "--height", "96", "--steps", "3", "--device", "cuda",
           "--picture", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **dict(env)), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return hashlib.sha256(out.read_bytes()).hexdigest(), done.stderr


def test_moss_image_under_a_streaming_plan_equals_the_resident_picture(tmp_path):
    """MOSS_PLAN_RESERVE_GB=0 lets the tiny checkpoint's few megabytes be planned as the real model's gigabytes
    are (the libraries' reserve would otherwise dwarf them): a budget of 3.7 MB then streams 16 of the DiT's 24
    blocks (the encoder is streamed in the test above)."""
    resident, said = _image(tmp_path, "resident.png")
    assert "all resident" in said
    streamed, said = _image(tmp_path, "streamed.png", {"MOSS_GPU_MEMORY": "0.0037", "MOSS_PLAN_RESERVE_GB": "0"})
    assert "layers streamed" in said, said
    assert streamed == resident
