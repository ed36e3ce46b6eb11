"""On a GPU: moss-server --device cuda on the tiny checkpoint serves moss-image --device cuda's PNGs, byte for
byte, for the openai client (n = 2: seeds 7 and 8) and the native endpoint, before and after a prompt of
another length (the denoiser's graphs and refined texts kept between requests change no byte)."""

import base64
import signal
import subprocess
import sys

import httpx
import openai
import pytest

import cuda_kernels
from server_util import WAIT_S, ready_process

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")


def test_the_gpu_server_serves_moss_images_bytes(tmp_path):
    r = subprocess.run([sys.executable, "-c", "from moss_cli.cli import image_command as c; c()", "--prompt",
                        "a red fox", "--seed", "7-8", "--steps", "3", "--device", "cuda", "--picture",
                        str(tmp_path / "fox-{seed}.png"), "--quiet"], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    fox = {seed: (tmp_path / f"fox-{seed}.png").read_bytes() for seed in (7, 8)}
    with ready_process("--device", "cuda", "--quiet") as (url, server):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)
        for prompt in ("a red fox", "a lighthouse on a cliff at dusk, oil on canvas", "a red fox"):
            result = client.images.generate(model="tiny", prompt=prompt, n=2,
                                            extra_body={"seed": 7, "num_inference_steps": 3})
            if prompt == "a red fox":
                assert [base64.b64decode(image.b64_json) for image in result.data] == [fox[7], fox[8]]
        native = httpx.post(f"{url}/v1/moss/image", json={"prompt": "a red fox", "seed": 8, "steps": 3},
                            timeout=WAIT_S)
        assert native.content == fox[8]
        # a picture to start from: moss-image --init-image --strength 0.5 on the GPU, byte for byte
        r = subprocess.run([sys.executable, "-c", "from moss_cli.cli import image_command as c; c()", "--prompt",
                            "a fox in the snow", "--seed", "3", "--steps", "4", "--device", "cuda", "--init-image",
                            str(tmp_path / "fox-7.png"), "--strength", "0.5", "--picture", str(tmp_path / "snow.png"),
                            "--quiet"], capture_output=True)
        assert r.returncode == 0, r.stderr.decode()
        snowy = httpx.post(f"{url}/v1/moss/image", json={"prompt": "a fox in the snow", "seed": 3, "steps": 4,
                                                          "strength": 0.5,
                                                          "init_image": base64.b64encode(fox[7]).decode()},
                           timeout=WAIT_S)
        assert snowy.content == (tmp_path / "snow.png").read_bytes()
        assert httpx.get(f"{url}/health", timeout=WAIT_S).json()["devices"] == \
            {"encode": "cuda", "denoise": "cuda", "decode": "cuda"}
        server.send_signal(signal.SIGTERM)
        assert server.wait(WAIT_S) == 0
