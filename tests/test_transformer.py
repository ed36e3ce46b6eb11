"""The MOSS-Image DiT on tiny random models, held against two independent statements of it.

* kohakumoss==0.1.0 (PyPI, KohakuBlueleaf's trainer; its modules carry the official state-dict names) runs
  the same tensors on CPU torch in float64 (its eager kernels accumulate in the inputs' dtype; its own
  `.float()` casts of the time embedding and modulation are made float64 for the call). Its time sinusoid
  is computed in fp32, where the official code (spec denoiser.md §3.1, S1 and S2) uses float64; the test
  swaps in the float64 sinusoid and sets its time_scale to 1 so it receives the same t. Skipped when
  kohakumoss is not installed. Measured (max relative error, CONFIG and the four-head config): our float64
  path 2.4e-7 from it (kohakumoss builds its RoPE bands and positions in fp32 and rounds the rotation
  inputs; the spec statement sits at the same distance), our float32 path 4.7e-7. Gates: KOHAKU_GATE = 1e-6
  for both paths.
* `reference.dit.spec_velocity` (scripts/reference/dit.py): the spec (§3) written out in torch float64.
  Measured: our float64 path 8.4e-16 from it, our float32 path 4.2e-7. Gates: SPEC_GATE64 = 1e-14,
  SPEC_GATE32 = 1e-6.

Planted controls (test_planted_bugs_fail_the_kohakumoss_gate): every RMSNorm's epsilon x10
(moss_cli.transformer.EPS) moves the velocity by 7-8e-6, the time sinusoid computed in float32
(moss_cli.transformer.time_sinusoid) by 1.0-1.1e-5; both must fail KOHAKU_GATE on both paths and the
spec statement's gates on both paths.
"""

import math

import numpy as np
import pytest
import torch

from moss_cli.errors import UsageError
from planted import time_sinusoid_float32
from reference.dit import spec_velocity
from moss_cli.ops import numpy_ops
from moss_cli.transformer import (MossTransformer, expected_tensors, positions, rope_tables,
                                  time_sinusoid)

CONFIG = dict(dim=64, ffn_dim=96, num_heads=2, num_layers=3, text_dim=32, freq_dim=256,
              latent_channels=128, rope_base=10000.0)
H, W, L = 4, 6, 5
T = 996.0
KOHAKU_GATE = 1e-6      # measured 2.4e-7 (float64 path), 4.7e-7 (float32 path)
SPEC_GATE64 = 1e-14     # measured 8.4e-16
SPEC_GATE32 = 1e-6      # measured 4.2e-7


def random_tensors(config, seed=0):
    """Unit-scale random weights, biases and norm weights (1 + noise) so every term matters."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_tensors(config).items():
        if "norm" in name:
            out[name] = 1 + 0.2 * rng.standard_normal(shape)
        elif len(shape) == 2:
            out[name] = rng.standard_normal(shape) / math.sqrt(shape[1])
        else:
            out[name] = 0.1 * rng.standard_normal(shape)
    return {k: v.astype(np.float32) for k, v in out.items()}


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(1)
    latents = rng.standard_normal((1, 128, H, W)).astype(np.float32)
    rows = rng.standard_normal((L, CONFIG["text_dim"])).astype(np.float32)
    return random_tensors(CONFIG), latents, rows


def ours(tensors, latents, rows, dtype, skip=frozenset(), config=CONFIG, t=T):
    model = MossTransformer(numpy_ops(dtype), tensors, config)
    return model.velocity(latents, t, model.prepare_text(rows), skip)


def rel(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("skip", [frozenset(), frozenset({1})])
def test_float64_path_equals_the_spec_statement(case, skip):
    tensors, latents, rows = case
    ref = spec_velocity(tensors, CONFIG, latents, T, rows, skip)
    got = ours(tensors, latents, rows, np.float64, skip)
    assert got.dtype == np.float64
    assert rel(got, ref) <= SPEC_GATE64


def test_float32_path_is_within_float32_noise_of_the_spec(case):
    tensors, latents, rows = case
    ref = spec_velocity(tensors, CONFIG, latents, T, rows)
    got = ours(tensors, latents, rows, np.float32)
    assert got.dtype == np.float32
    assert rel(got, ref) <= SPEC_GATE32


# --- the peer port ---------------------------------------------------------------------------------

def kohaku_velocity(tensors, cfg, latents, t, rows, skip, monkeypatch):
    pytest.importorskip("kohakumoss")
    import kohakumoss.model.backbone as backbone
    from kohakumoss.model import build_backbone, resolve_config
    from kohakumoss.types.seqinfo import build_seqinfo

    def sinusoid(t, freq_dim):
        half = freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half)
        phase = t.double()[:, None] * freqs
        return torch.cat([phase.cos(), phase.sin()], -1).float()

    monkeypatch.setattr(backbone, "timestep_embedding", sinusoid)
    arch = resolve_config("base", dict(dim=cfg["dim"], depth=cfg["num_layers"], heads=cfg["num_heads"],
                                       ffn_dim=cfg["ffn_dim"], text_dim=cfg["text_dim"], time_scale=1.0))
    model = build_backbone(arch, dtype=torch.float64)
    result = model.load_state_dict({k: torch.from_numpy(v).double() for k, v in tensors.items()}, strict=False)
    assert result.missing_keys == ["rope.bands"] and not result.unexpected_keys
    _, C, h, w = latents.shape
    seq = build_seqinfo(torch.tensor([[h, w]]), torch.tensor([rows.shape[0]]))
    img = torch.from_numpy(latents.reshape(C, h * w).T.copy()).double()
    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(torch.Tensor, "float", torch.Tensor.double)    # its time/modulation casts, in float64
        v = model.bind_forward(skip_layers=skip)(img, torch.from_numpy(rows).double(), torch.tensor([t]), seq)
    assert v.dtype == torch.float64
    return v.numpy().T.reshape(1, C, h, w)


@pytest.mark.parametrize("skip", [frozenset(), frozenset({2})])
def test_both_paths_agree_with_kohakumoss_in_float64(case, skip, monkeypatch):
    tensors, latents, rows = case
    ref = kohaku_velocity(tensors, CONFIG, latents, T, rows, skip, monkeypatch)
    assert rel(ours(tensors, latents, rows, np.float64, skip), ref) <= KOHAKU_GATE
    assert rel(ours(tensors, latents, rows, np.float32, skip), ref) <= KOHAKU_GATE


def test_four_heads_agree_with_kohakumoss(monkeypatch):
    config = dict(CONFIG, num_heads=4, dim=128, num_layers=2)
    rng = np.random.default_rng(5)
    tensors = random_tensors(config, seed=5)
    latents = rng.standard_normal((1, 128, 3, 5)).astype(np.float32)
    rows = rng.standard_normal((7, 32)).astype(np.float32)
    ref = kohaku_velocity(tensors, config, latents, 24.0, rows, frozenset(), monkeypatch)
    for dtype in (np.float64, np.float32):
        assert rel(ours(tensors, latents, rows, dtype, config=config, t=24.0), ref) <= KOHAKU_GATE


PLANTED = {"norm_eps_x10": ("EPS", 1e-5), "time_sinusoid_float32": ("time_sinusoid", time_sinusoid_float32)}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_bugs_fail_the_kohakumoss_gate(case, bug, monkeypatch):
    """Controls: each bug moves the velocity by ~1e-5; kohakumoss (float64) and the spec must both see it."""
    from moss_cli import transformer
    tensors, latents, rows = case
    ref = kohaku_velocity(tensors, CONFIG, latents, T, rows, frozenset(), monkeypatch)
    spec = spec_velocity(tensors, CONFIG, latents, T, rows)
    monkeypatch.setattr(transformer, *PLANTED[bug])
    for dtype in (np.float64, np.float32):
        assert rel(ours(tensors, latents, rows, dtype), ref) > 3 * KOHAKU_GATE, dtype
    assert rel(ours(tensors, latents, rows, np.float64), spec) > 1e4 * SPEC_GATE64
    assert rel(ours(tensors, latents, rows, np.float32), spec) > 3 * SPEC_GATE32


# --- hand-checkable pieces -------------------------------------------------------------------------

def test_positions_put_image_tokens_first_then_text():
    pos = positions(2, 3, 4)
    image = [(0, 4, y - 0.5, x - 1.0) for y in range(2) for x in range(3)]
    text = [(0, i, 0, 0) for i in range(4)]
    np.testing.assert_array_equal(pos, np.array(image + text, dtype=np.float32))


def test_rope_rotates_a_known_vector_at_a_known_position():
    ops = numpy_ops(np.float64)
    hd = 32                                     # 4 bands per axis
    pos = positions(H, W, L)
    cos, sin = rope_tables(pos, hd, 10000.0, np.float64)
    token = 3 * W + 0                           # image (y=3, x=0): (0, 5, 1.5, -2.5)
    for j in range(hd // 2):
        x = np.zeros((len(pos), 1, hd))
        x[:, 0, j], x[:, 0, j + 16] = 1.0, 2.0
        out = ops.rope(x, ops.array(cos), ops.array(sin))[token, 0]
        theta = (0, 5, 1.5, -2.5)[j // 4] * 10000 ** (-(j % 4) / 4)
        assert out[j] == pytest.approx(math.cos(theta) - 2 * math.sin(theta), abs=1e-6)
        assert out[j + 16] == pytest.approx(2 * math.cos(theta) + math.sin(theta), abs=1e-6)
        # text token 2 sits at (0, 2, 0, 0): only the t axis rotates
        theta = (0, 2, 0, 0)[j // 4] * 10000 ** (-(j % 4) / 4)
        assert ops.rope(x, ops.array(cos), ops.array(sin))[H * W + 2, 0, j] == pytest.approx(
            math.cos(theta) - 2 * math.sin(theta), abs=1e-6)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-15), (np.float32, 1e-6)])
def test_situ_is_the_closed_form(dtype, tol):
    ops = numpy_ops(dtype)
    hs = [-60.0, -3.0, 0.0, 0.7, 40.0]
    gs = [-100.0, -2.5, 0.0, 1.3, 30.0]
    got = ops.situ(ops.array(hs), ops.array(gs))
    for h, g, y in zip(hs, gs, got):
        want = 4 * math.tanh(g / 4) / (1 + math.exp(-g)) * 25 * math.tanh(h / 25)
        assert float(y) == pytest.approx(want, rel=tol, abs=tol)


def test_modulate_and_gated_residual():
    ops = numpy_ops(np.float64)
    x = ops.array([[1.0, 2.0], [3.0, -1.0]])
    shift, scale, gate = ops.array([[0.5, -1.0]]), ops.array([[1.0, -0.5]]), ops.array([[2.0, 0.0]])
    np.testing.assert_array_equal(ops.modulate(x, shift, scale), [[2.5, 0.0], [6.5, -1.5]])
    np.testing.assert_array_equal(ops.gated_residual(x, ops.array([[1.0, 5.0], [-1.0, 5.0]]), gate),
                                  [[3.0, 2.0], [1.0, -1.0]])


def test_time_sinusoid_is_cos_then_sin_in_float64():
    e = time_sinusoid(np.float32(996.0), 256)
    assert e.shape == (1, 256) and e.dtype == np.float64
    for k in (0, 1, 64, 127):
        f = 10000 ** (-k / 128)
        assert e[0, k] == pytest.approx(math.cos(996.0 * f), abs=1e-12)
        assert e[0, 128 + k] == pytest.approx(math.sin(996.0 * f), abs=1e-12)


def test_a_skipped_block_is_the_identity(case):
    tensors, latents, rows = case
    silenced = dict(tensors)                   # block 1 writes nothing: both residual updates are zero
    for name in ("layers.1.proj.o.weight", "layers.1.proj.ffn_down.weight"):
        silenced[name] = np.zeros_like(tensors[name])
    skipped = ours(tensors, latents, rows, np.float64, frozenset({1}))
    np.testing.assert_array_equal(skipped, ours(silenced, latents, rows, np.float64))
    assert rel(skipped, ours(tensors, latents, rows, np.float64)) > 1e-3


def test_text_reaches_the_image_only_through_joint_attention(case):
    tensors, latents, rows = case
    other = rows + 1.0
    base = ours(tensors, latents, rows, np.float64)
    assert rel(ours(tensors, latents, other, np.float64), base) > 1e-3
    no_attention = dict(tensors)
    for i in range(CONFIG["num_layers"]):
        no_attention[f"layers.{i}.proj.o.weight"] = np.zeros_like(tensors[f"layers.{i}.proj.o.weight"])
    np.testing.assert_array_equal(ours(no_attention, latents, rows, np.float64),
                                  ours(no_attention, latents, other, np.float64))


def test_full_size_key_list_is_the_published_5_082b():
    shapes = expected_tensors({})
    assert len(shapes) == 462                  # §3.7, rope.bands not read
    assert sum(math.prod(s) for s in shapes.values()) == 5_082_308_608
    assert shapes["layers.41.proj.ffn_up_gate.weight"] == (16384, 3072)
    assert shapes["text_embedder.blocks.1.qkv.weight"] == (9216, 3072)
    assert "rope.bands" not in shapes and "layers.42.norm1.weight" not in shapes


def test_skip_layer_outside_the_model_is_a_usage_error(case):
    tensors, latents, rows = case
    with pytest.raises(UsageError, match="skip layer 3"):
        ours(tensors, latents, rows, np.float32, frozenset({3}))
