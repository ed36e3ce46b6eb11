"""The GPU memory plan (moss_cli/memory/plan.py) on the CPU: the plans the real-size configs get for the
budgets of common cards, the refusal of a budget below the smallest plan before any work, --plan and
$MOSS_GPU_MEMORY on the commands, and an out-of-memory failure injected at each stage reported as one line with
exit 1 and no partial file.

The real-size weights come from scripts/make_real_checkpoint.py's configs (shapes only, nothing allocated):
13.84 GB of encoder matrices over 32 layers, 10.17 GB of DiT over 42 blocks, 0.25 GB of decoder.
"""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli_util import FAST, run, single_error
from moss_cli.errors import UsageError
from moss_cli.memory import plan as mp

ROOT = Path(__file__).resolve().parents[1]
ALL = ("encode", "denoise", "decode")
GB = 1e9


@pytest.fixture(scope="module")
def real():
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_real_checkpoint as mrc
    cfg = mrc.configs(1)
    shapes = {"transformer": mrc.tiny.transformer_shapes(cfg["transformer"]),
              "text_encoder": mrc.tiny.text_shapes(cfg["text_encoder"]["text_config"]),
              "vae": mrc.tiny.vae_shapes(cfg["vae"])}
    return {name: mp.component_weights(SimpleNamespace(name=name, tensors={
        k: SimpleNamespace(shape=tuple(s)) for k, s in sh.items()})) for name, sh in shapes.items()}


def test_real_sizes_are_counted_from_the_shapes(real):
    assert round(real["text_encoder"].total / GB, 2) == 13.84 and len(real["text_encoder"].layers) == 32
    assert round(real["transformer"].total / GB, 2) == 10.17 and len(real["transformer"].layers) == 42
    # a DiT block's four products: qkv 3 x 3072^2, o 3072^2, up/gate 16384 x 3072, down 3072 x 8192, bf16
    assert real["transformer"].slot == 2 * (4 * 3072 * 3072 + 16384 * 3072 + 3072 * 8192)


@pytest.mark.parametrize("budget,mode,encoder,dit", [
    (80, "resident", 0, 0),        # an H100: everything resident, as measured (27.8-28.6 GB in use)
    (24, "released", 0, 0),        # a 24 GB card: the encoder, then the DiT and the decoder
    (16, "released", 0, 0),
    (12, "streamed", 10, 15),
    (8, "streamed", 19, 32),
])
def test_plans_for_common_cards(real, budget, mode, encoder, dit):
    plan = mp.make(real, ALL, budget * GB, width=1024, height=1024)
    assert plan.mode == mode
    assert len(plan.layers("text_encoder")) == encoder and len(plan.layers("transformer")) == dit
    assert plan.peak <= budget * GB
    assert plan.phases and all(need <= budget * GB for need in plan.phases.values())


def test_streamed_blocks_are_spread_over_the_depth(real):
    plan = mp.make(real, ALL, 12 * GB)
    blocks = plan.layers("transformer")
    gaps = {b - a for a, b in zip(blocks, blocks[1:])}
    assert gaps <= {2, 3, 4}, blocks         # every second to fourth block: copies overlap resident blocks
    assert mp.spread(3, range(42)) == (7, 21, 35)


def test_a_budget_below_the_smallest_plan_is_refused_with_the_need(real):
    with pytest.raises(UsageError, match=r"below the smallest plan for 1024x1024, (\d+\.\d) GB"):
        mp.make(real, ALL, 3 * GB)
    need = mp.smallest(real, ALL, 1024, 1024)
    plan = mp.make(real, ALL, need + 0.01 * GB)
    assert len(plan.layers("transformer")) == 42


def test_each_stage_alone_plans_only_its_component(real):
    assert mp.make(real, ("decode",), 8 * GB).resident
    denoise = mp.make(real, ("denoise",), 8 * GB)
    assert denoise.layers("text_encoder") == () and 0 < len(denoise.layers("transformer")) < 42
    encode = mp.make(real, ("encode",), 8 * GB)
    assert encode.layers("transformer") == () and 0 < len(encode.layers("text_encoder")) < 32


@pytest.mark.parametrize("given,env,message", [
    ("abc", None, "give a number of GB"), ("-2", None, "positive"), (None, "nan", "positive"),
    (None, None, "no GPU to plan for")])
def test_budget_errors(given, env, message, monkeypatch):
    if env is None:
        monkeypatch.delenv(mp.ENV, raising=False)
    else:
        monkeypatch.setenv(mp.ENV, env)
    with pytest.raises(UsageError, match=message):
        mp.budget_bytes(given, None)


def test_the_budget_is_at_most_the_free_memory(monkeypatch):
    monkeypatch.setenv(mp.ENV, "24")
    assert mp.budget_bytes(None, 30 * GB) == (24 * GB, "$MOSS_GPU_MEMORY")
    assert mp.budget_bytes("40", 30 * GB) == (30 * GB, "--gpu-memory 40 GB, 30.0 GB free")
    monkeypatch.delenv(mp.ENV)
    assert mp.budget_bytes(None, 30 * GB) == (30 * GB, "free GPU memory")


def test_plan_prints_one_line_and_exits_without_loading(tmp_path):
    r = run("moss-image", "--prompt", "x", "--seed", "1", "--picture", tmp_path / "a.png", "--plan",
            "--gpu-memory", "0.0037", "--width", "64", "--height", "96",
            env=dict(os.environ, MOSS_PLAN_RESERVE_GB="0"))
    assert r.code == 0, r.stderr
    assert r.stdout.decode().strip() == ("memory plan: 3.70 MB (--gpu-memory), layers streamed from pinned host "
                                         "memory: encoder resident, DiT 16/24 layers streamed, peak 3.70 MB at 64x96")
    assert not (tmp_path / "a.png").exists()
    for command, args in (("moss-encode", ["--prompt", "x", "--out", tmp_path / "a.enc"]),
                          ("moss-denoise", ["a.enc", "--seed", "1", "--out", tmp_path / "a.lat"])):
        r = run(command, *args, "--plan", env=dict(os.environ, MOSS_GPU_MEMORY="16"))
        assert r.code == 0 and r.stdout.decode().startswith("memory plan: 16.0 GB ($MOSS_GPU_MEMORY), all resident")


def test_a_budget_too_small_is_refused_before_any_work(tmp_path):
    r = run("moss-image", "--prompt", "x", "--seed", "1", "--picture", tmp_path / "a.png", "--plan",
            "--gpu-memory", "0.001")
    line = single_error(r)
    assert r.code == 1 and "below the smallest plan for 256x256" in line
    assert "encoding" not in r.stderr and not (tmp_path / "a.png").exists()


INJECT = """
import sys
from moss_cli import stages
class CudaAPIError(Exception):
    pass
def failing(*args, **kwargs):
    raise CudaAPIError("[2] Call to cuMemAlloc results in CUDA_ERROR_OUT_OF_MEMORY")
setattr(stages, sys.argv.pop(1), failing)
from moss_cli.cli import image_command
sys.argv[0] = "moss-image"
image_command()
"""


@pytest.mark.parametrize("stage", ["encode", "denoise", "decode_pixels"])
def test_out_of_memory_at_each_stage_is_one_line_exit_1_and_no_file(tmp_path, stage):
    out = tmp_path / "a.png"
    p = subprocess.run([sys.executable, "-c", INJECT, stage, "--prompt", "x", "--seed", "1", "--picture", str(out),
                        *FAST], capture_output=True, text=True, timeout=300, cwd=ROOT)
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    assert p.returncode == 1 and len(errors) == 1, p.stderr
    assert errors[0].startswith("moss-image: error: out of GPU memory") and "--gpu-memory" in errors[0]
    assert "Traceback" not in p.stderr and not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("budget,encoder,dit", [(80, 0, 0), (24, 13, 0), (16, 32, 0), (12, 32, 19), (8, 32, 36)])
def test_a_server_holds_every_component_and_streams_the_encoder_first(real, budget, encoder, dit):
    plan = mp.make(real, ALL, budget * GB, held=True)
    assert len(plan.layers("text_encoder")) == encoder and len(plan.layers("transformer")) == dit
    assert plan.peak <= budget * GB and plan.mode == ("resident" if budget == 80 else "streamed")


def test_a_picture_to_start_from_plans_the_vae_encoder_beside_the_text_encoder(real):
    """moss-image --init-image encodes the picture (the VAE encoder, 0.25 GB of vae weights and a pool of its
    512-channel convolutions) while the text encoder's weights arrive: the encoder's phase holds both."""
    image = ("encode-image",) + ALL
    vae_pool = mp.pool_bytes("encode-image", real["vae"], 1024, 1024, 512)
    assert real["vae"].features == 512 and round(vae_pool / GB, 2) == 3.06
    for budget in (80, 24, 16, 12, 8):
        plain, with_image = mp.make(real, ALL, budget * GB), mp.make(real, image, budget * GB)
        assert with_image.peak <= budget * GB and all(v <= budget * GB for v in with_image.phases.values())
        if with_image.resident:
            assert with_image.peak == plain.peak + real["vae"].total
        else:          # the encoder's phase: its resident part, the larger pool, the VAE encoder's weights
            enc = with_image.phases["encode"]
            resident = real["text_encoder"].total - real["text_encoder"].streamed(with_image.layers("text_encoder"))
            slots = 2 * real["text_encoder"].slot if with_image.layers("text_encoder") else 0
            assert enc == resident + slots + vae_pool + real["vae"].total + mp.RESERVE
    # at 16 GB the text encoder then no longer fits beside it: some of its layers stream, the DiT's plan is the same
    at16, plain16 = mp.make(real, image, 16 * GB), mp.make(real, ALL, 16 * GB)
    assert plain16.layers("text_encoder") == () and len(at16.layers("text_encoder")) > 0
    assert at16.layers("transformer") == plain16.layers("transformer")
    # planted: the VAE encoder left out of the encoder's phase would overrun a budget that only the image fills
    tight = plain16.phases["encode"] + 0.5 * GB
    assert mp.make(real, ALL, tight).layers("text_encoder") == ()
    assert mp.make(real, image, tight).phases["encode"] <= tight
    # alone (moss-encode-image): its weights and its pool
    alone = mp.make(real, ("encode-image",), 8 * GB)
    assert alone.resident and alone.peak == real["vae"].total + vae_pool + mp.RESERVE
    with pytest.raises(UsageError, match="below the smallest plan"):
        mp.make(real, ("encode-image",), 2 * GB)


def test_encode_image_and_init_image_print_their_plans(tmp_path):
    from PIL import Image
    Image.new("RGB", (64, 48), (200, 40, 10)).save(tmp_path / "in.png")
    r = run("moss-encode-image", tmp_path / "in.png", "--out", tmp_path / "a.img", "--plan", "--gpu-memory", "16")
    assert r.code == 0, r.stderr
    assert r.stdout.decode().strip().startswith("memory plan: 16.0 GB (--gpu-memory), all resident") \
        and r.stdout.decode().strip().endswith("at 64x48")
    r = run("moss-image", "--prompt", "x", "--seed", "1", "--picture", tmp_path / "b.png", "--init-image",
            tmp_path / "in.png", "--plan", "--gpu-memory", "16")
    assert r.code == 0 and r.stdout.decode().strip().endswith("at 64x48"), r.stderr
    assert not (tmp_path / "a.img").exists() and not (tmp_path / "b.png").exists()


def test_a_stage_whose_weights_cannot_stream_is_refused_when_they_do_not_fit(real):
    """The decoder (or the VAE encoder) alone streams nothing: a budget below its weights, pool and reserve is
    refused with the need, never planned past the budget."""
    need = real["vae"].total + mp.pool_bytes("decode", real["vae"], 1024, 1024, 512) + mp.RESERVE
    assert mp.make(real, ("decode",), need).peak == need
    with pytest.raises(UsageError, match=r"below the smallest plan for 1024x1024, 4\.6 GB"):
        mp.make(real, ("decode",), need - 0.1 * GB)


@pytest.mark.parametrize("budget,fits_2048", [(80, True), (24, False)])
def test_a_plan_tells_the_need_of_another_picture_size_beside_its_weights(real, budget, fits_2048):
    """A server's plan (made for 1024x1024) keeps its weights where they are; another size changes only the pool:
    512 needs no more than 1024, 2048 four times the decoder's pool (12.2 GB), which fits beside the resident
    weights of an 80 GB card and not beside the 24 GB card's."""
    plan = mp.make(real, ALL, budget * GB, held=True)
    assert plan.need_at(1024, 1024) == plan.peak and plan.need_at(512, 512) == plan.peak
    pool_2048 = mp.pool_bytes("decode", real["vae"], 2048, 2048, 512)
    assert plan.need_at(2048, 2048) == plan.peak - plan.pool + pool_2048
    assert (plan.need_at(2048, 2048) <= plan.budget) == fits_2048
