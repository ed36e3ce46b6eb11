"""On a GPU: LoRA merged on the device (moss_cli/gpu/lora_merge.py) on the tiny checkpoint, against the host merge
(lora.merge): cuBLAS sums each product's rank terms in its own order, so a counted few elements may round the other
way, never by more than one bf16 ulp; the planted control (the scale and alpha ignored) is far off. The GPU merge is
the same run to run, after switches of the adapter set, and for a streamed layer (pinned host arena) as for a
resident one. `moss-image --device cuda --lora FILE:0` is the base picture byte for byte; moss-server --device cuda
switching sets between requests gives moss-image --device cuda's PNG for each set."""

import base64
import signal
import subprocess
import sys

import httpx
import ml_dtypes
import numpy as np
import pytest

import cuda_kernels
import held_weights
from server_util import WAIT_S, ready_process

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")

BF16 = ml_dtypes.bfloat16
IMAGE = ["--prompt", "a red fox", "--seed", "7", "--steps", "3", "--width", "64", "--height", "48", "--device", "cuda",
         "--quiet"]


def ulps(a, b):
    """|a - b| in bf16 units in the last place (bf16 bits as uint16)."""
    ia, ib = (np.asarray(x).view(np.int16).astype(np.int32) for x in (a, b))
    ia, ib = (np.where(i < 0, -32768 - i, i) for i in (ia, ib))
    return np.abs(ia - ib)


def save(path, tensors):
    from moss_cli import safetensors_io
    safetensors_io.save(path, tensors)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """dit: kohya rank 8 on every DiT linear (bf16 factors); peft: rank 4 float32 factors on every block's q and
    down; lokr: LoKr on block 2's o; te: kohya rank 4 on the text encoder's block 3 q."""
    from moss_cli.checkpoint import open_checkpoint
    folder = tmp_path_factory.mktemp("adapters")
    shapes = open_checkpoint().shapes()
    rng = np.random.default_rng(0)
    out = {}
    for key, component, root, rank, dtype, pick in (
            ("dit", "transformer", "lora_unet_", 8, BF16, lambda n: True),
            ("peft", "transformer", None, 4, np.float32, lambda n: n.endswith(("proj.q.weight", "ffn_down.weight"))),
            ("te", "text_encoder", "lora_te_", 4, BF16, lambda n: n == "layers.3.self_attn.q_proj.weight")):
        tensors = {}
        for name, (rows, cols) in ((n, s) for n, s in shapes[component].items() if len(s) == 2 and pick(n)):
            if name == "embed_tokens.weight":
                continue
            path = name[:-len(".weight")]
            up = (rng.standard_normal((rows, rank)) * 0.3).astype(dtype)
            down = rng.standard_normal((rank, cols)).astype(dtype)
            if root is None:
                tensors.update({f"transformer.{path}.lora_A.weight": down, f"transformer.{path}.lora_B.weight": up})
            else:
                stem = root + path.replace(".", "_")
                tensors.update({stem + ".lora_up.weight": up, stem + ".lora_down.weight": down,
                                stem + ".alpha": np.array(rank / 2, np.float32)})
        out[key] = save(folder / f"{key}.safetensors", tensors)
    d = shapes["transformer"]["layers.2.proj.o.weight"][0]
    out["lokr"] = save(folder / "lokr.safetensors", {
        "lycoris_layers_2_proj_o.lokr_w1": rng.standard_normal((2, 2)).astype(np.float32),
        "lycoris_layers_2_proj_o.lokr_w2": (rng.standard_normal((d // 2, d // 2)) * 0.1).astype(np.float32)})
    return out


def device_bits(runner, tensors):
    """{name: bf16 bits} of every 2-D weight as the runner holds it (resident or in its streamed arenas)."""
    return held_weights.device_bits(runner.ops, tensors, runner.model.weight_names())


def count_off(got, want):
    """(elements compared, elements differing, largest difference in ulps) over the names of `want`."""
    from moss_cli.memory.host_weights import stored_form
    total = off = worst = 0
    for name, w in want.items():
        d = ulps(got[name], stored_form(w))
        total, off, worst = total + d.size, off + int(np.count_nonzero(d)), max(worst, int(d.max()))
    return total, off, worst


def test_the_gpu_merge_is_the_host_merge_within_one_ulp_in_a_counted_few_and_the_same_every_time(files):
    from cuda_kernels import lora as kernels
    from moss_cli import stages
    from moss_cli.checkpoint import open_checkpoint
    from moss_cli.gpu import lora_merge as cuda_lora
    from moss_cli.gpu.denoiser import CudaDenoiser
    specs = [(files["dit"], 0.8), (files["peft"], -0.6), (files["lokr"], 1.0), (files["te"], 1.5)]
    ckpt = open_checkpoint(lora=specs)
    model = stages.Model(ckpt, device="cuda")
    for component, runner in (("transformer", model.transformer), ("text_encoder", model.encoder)):
        base = ckpt.base_component(component).tensors
        host = ckpt.component(component).tensors
        touched = lora_names(ckpt, component)
        got = device_bits(runner, base)
        total, off, worst = count_off(got, {n: host[n] for n in touched})
        print(f"{component}: {len(touched)} weights, {total} elements, {off} differ from the host merge "
              f"({off / total:.2e}), at most {worst} ulp")
        assert worst <= 1 and off / total < 1e-3, (off, total, worst)
        untouched = [n for n in got if n not in touched]
        assert untouched == [] or count_off(got, {n: base[n] for n in untouched})[1] == 0
    first = device_bits(model.transformer, ckpt.base_component("transformer").tensors)

    # another set and back: the weights go back to the base and are merged again, bit for bit the first merge
    other = ckpt.with_adapters(ckpt.read_adapters([(files["peft"], 2.0)]))
    assert model.use(other) == ["text_encoder", "transformer"]
    assert model.use(ckpt) == ["text_encoder", "transformer"]
    base = ckpt.base_component("transformer").tensors
    again = device_bits(model.transformer, base)
    assert all(np.array_equal(again[n], first[n]) for n in first)

    # a plan that streams blocks 1 and 5 from pinned host memory merges them alike
    streamed = CudaDenoiser(base, ckpt.config("transformer"), streamed=(1, 5))
    streamed.upload()
    cuda_lora.apply(streamed.ops, base, streamed.model.weight_names(), "transformer", (), ckpt.adapters)
    assert any(isinstance(k, str) and k.startswith("layers.5.") for k in streamed.ops.window.layout)
    held = device_bits(streamed, base)
    assert all(np.array_equal(held[n], first[n]) for n in first)

    # planted control: the scale and alpha ignored
    product = kernels.product
    kernels.product = lambda up, down, out, alpha, stream=0: product(up, down, out, 1.0)
    try:
        wrong = CudaDenoiser(base, ckpt.config("transformer"))
        wrong.upload()
        cuda_lora.apply(wrong.ops, base, wrong.model.weight_names(), "transformer", (), ckpt.adapters)
    finally:
        kernels.product = product
    host = ckpt.component("transformer").tensors
    assert count_off(device_bits(wrong, base), {n: host[n] for n in lora_names(ckpt, "transformer")})[2] > 1


def lora_names(ckpt, component):
    from moss_cli import lora
    return sorted(lora.uses(ckpt.adapters, component))


def _image(picture, *lora):
    r = subprocess.run([sys.executable, "-c", "from moss_cli.cli import image_command as c; c()", *IMAGE,
                        "--picture", str(picture), *[a for spec in lora for a in ("--lora", str(spec))]],
                       capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    return picture.read_bytes()


def test_moss_image_on_the_gpu_with_an_adapter_at_scale_0_is_the_base_picture(files, tmp_path):
    base = _image(tmp_path / "base.png")
    assert _image(tmp_path / "zero.png", f"{files['dit']}:0") == base
    one = _image(tmp_path / "one.png", files["dit"])
    assert one != base and _image(tmp_path / "again.png", files["dit"]) == one


def test_the_gpu_server_switching_sets_serves_moss_images_pngs(files, tmp_path):
    sets = {"start": [f"{files['dit']}:0.5"], "base": [], "both": [f"{files['dit']}:1", f"{files['te']}:0.7"]}
    want = {key: _image(tmp_path / f"{key}.png", *specs) for key, specs in sets.items()}
    with ready_process("--device", "cuda", "--lora", f"style={files['dit']}:0.5", "--lora", f"te={files['te']}:0",
                       "--quiet") as (url, server):
        for lora, key in ((None, "start"), ([], "base"), ([{"name": "style", "scale": 1.0},
                                                          {"name": "te", "scale": 0.7}], "both"), (None, "start")):
            body = {"prompt": "a red fox", "seed": 7, "num_inference_steps": 3, "size": "64x48"}
            if lora is not None:
                body["lora"] = lora
            r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=WAIT_S)
            assert r.status_code == 200, r.text
            assert base64.b64decode(r.json()["data"][0]["b64_json"]) == want[key], key
        server.send_signal(signal.SIGTERM)
        assert server.wait(WAIT_S) == 0
