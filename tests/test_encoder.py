"""The Qwen3.5 prompt encoder and its GDN ops against transformers' Qwen3_5 model on tiny random weights.

The oracle is transformers' model in float64 (`.double()` with its internal float32 casts made float64,
scripts/reference/transformers64.py). Measured on the two configs at L = 5, 64, 65, 150 (max relative error):
our float64 path 3.6e-9, our float32 path 7.9e-7. Gates: FLOAT64_GATE = 1e-8 and FLOAT32_GATE = 2e-6.
Planted control (test_planted_final_norm_eps_fails_the_float64_gate): the final norm's epsilon x10 moves the
rows by 3.4-4.9e-6, which passed the former 5e-6 gate against float32 transformers; it must fail FLOAT64_GATE.
"""

import copy
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf  # noqa: E402

from moss_cli.encoder import Qwen35Encoder, expected_tensors, text_config  # noqa: E402
from moss_cli.errors import CheckpointError  # noqa: E402
from moss_cli.ops import numpy_ops  # noqa: E402
from moss_cli.ops.numpy.gdn import DELTA_CHUNK  # noqa: E402
from planted import final_norm_eps_x10  # noqa: E402
from reference import transformers64  # noqa: E402

LENGTHS = (5, 64, 65, 150)
VOCAB = 640
FLOAT64_GATE = 1e-8     # measured 3.6e-9 (float64 transformers' rotary frequencies are float32-built)
FLOAT32_GATE = 2e-6     # measured 7.9e-7

# Both: GQA, two value heads per key head, full attention at i % 4 == 3.
CONFIGS = {
    "four_layers": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_section=[2, 1, 1], mrope_interleaved=True)),
    "eight_layers": dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=8,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=3,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5,
                             mrope_section=[2, 1, 1], mrope_interleaved=True)),
}


def randomise(model, seed=0):
    """Every parameter random: HF's zero norm offsets and unit dt_bias would hide (1+w)/w mix-ups (encoder.md 6).

    Matrices get half the 1/sqrt(fan_in) scale so the tiny model stays well conditioned in float32.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.log(0.01 + 15.99 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(noise)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.5 * noise)           # plain weight
            elif p.ndim == 1:
                p.copy_(0.5 * noise)               # zero-centred offsets (and biases of the vision tower)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(0.5 * noise / math.sqrt(p[0].numel()))
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request):
    """(float64 transformers model, its float32 tensors, config): the model holds the same float32 values."""
    cfg = transformers.Qwen3_5TextConfig(**CONFIGS[request.param])
    model = randomise(transformers.Qwen3_5TextModel(cfg))
    tensors = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    return model.double(), tensors, cfg.to_dict()


def prompt_ids(length):
    return np.random.default_rng(length).integers(0, VOCAB, length)


def reference(model, ids, **kw):
    """transformers' output for one prompt: float64 end to end for a `.double()` model."""
    with torch.no_grad(), transformers64.float64():
        return model(torch.tensor(ids)[None], **kw)


def rel(ours, ref):
    return np.abs(np.asarray(ours, np.float64) - ref).max() / np.abs(ref).max()


@pytest.mark.parametrize("length", LENGTHS)
def test_rows_match_transformers_float64(tiny, length):
    model, tensors, config = tiny
    ids = prompt_ids(length)
    ref = reference(model, ids).last_hidden_state[0].numpy()
    assert ref.dtype == np.float64
    rows32 = Qwen35Encoder(numpy_ops(np.float32), tensors, config)(ids)
    rows64 = Qwen35Encoder(numpy_ops(np.float64), tensors, config)(ids)
    assert rows32.dtype == np.float32 and rows64.dtype == np.float64
    assert rows32.shape == (length, config["hidden_size"])
    assert rel(rows32, ref) <= FLOAT32_GATE
    assert rel(rows64, ref) <= FLOAT64_GATE


@pytest.mark.parametrize("length", (5, 150))
def test_planted_final_norm_eps_fails_the_float64_gate(tiny, length):
    """Control: eps x10 on the final norm only moves the rows by ~4e-6; the float64 gate must see it."""
    model, tensors, config = tiny
    ids = prompt_ids(length)
    ref = reference(model, ids).last_hidden_state[0].numpy()
    planted = Qwen35Encoder(final_norm_eps_x10(numpy_ops(np.float64), tensors), tensors, config)(ids)
    assert rel(planted, ref) > 100 * FLOAT64_GATE
    assert rel(Qwen35Encoder(numpy_ops(np.float64), tensors, config)(ids), ref) <= FLOAT64_GATE


def test_layer_callback_sees_each_layer_output(tiny):
    model, tensors, config = tiny
    ids = prompt_ids(65)
    states = reference(model, ids, output_hidden_states=True).hidden_states
    seen = {}
    Qwen35Encoder(numpy_ops(np.float64), tensors, config)(ids, on_layer=lambda i, x: seen.setdefault(i, x.copy()))
    assert sorted(seen) == list(range(config["num_hidden_layers"]))
    # HF's last entry is the normed output, so layers 0 .. n-2 are the ones it exposes un-normed
    for i in range(config["num_hidden_layers"] - 1):
        assert rel(seen[i], states[i + 1][0].numpy()) <= FLOAT64_GATE


def test_recurrent_form_gives_the_same_rows(tiny):
    _, tensors, config = tiny
    ids = prompt_ids(150)
    chunk = Qwen35Encoder(numpy_ops(np.float64), tensors, config, form="chunk")(ids)
    loop = Qwen35Encoder(numpy_ops(np.float64), tensors, config, form="recurrent")(ids)
    assert np.abs(chunk - loop).max() <= 1e-12


def test_official_checkpoint_names_line_up(tmp_path):
    """A Qwen3_5ForConditionalGeneration save: strip `model.language_model.`, read with safetensors.numpy."""
    text = transformers.Qwen3_5TextConfig(**CONFIGS["four_layers"])
    vision = transformers.Qwen3_5VisionConfig(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                              out_hidden_size=64, num_position_embeddings=16)
    model = randomise(transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision.to_dict())), seed=1)
    model.save_pretrained(tmp_path)
    prefix = "model.language_model."
    stored = {}
    for shard in sorted(tmp_path.glob("*.safetensors")):
        stored.update({k[len(prefix):]: v for k, v in load_file(shard).items() if k.startswith(prefix)})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5"
    expected = expected_tensors(config)
    assert {k: v.shape for k, v in stored.items()} == expected

    ids = prompt_ids(70)
    ref = reference(copy.deepcopy(model.model).double(), ids).last_hidden_state[0].numpy()
    assert rel(Qwen35Encoder(numpy_ops(np.float64), stored, config)(ids), ref) <= FLOAT64_GATE


def test_bfloat16_tensors_and_vocabulary_check():
    """Stored bf16 (ml_dtypes) weights read like HF's model holding the same bf16-rounded values."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    cfg = transformers.Qwen3_5TextConfig(**CONFIGS["four_layers"])
    model = randomise(transformers.Qwen3_5TextModel(cfg), seed=2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    tensors = {k: v.float().numpy().astype(ml_dtypes.bfloat16) for k, v in model.state_dict().items()}
    ids = prompt_ids(65)
    ref = reference(model.double(), ids).last_hidden_state[0].numpy()
    encoder = Qwen35Encoder(numpy_ops(np.float32), tensors, cfg.to_dict())
    assert rel(encoder(ids), ref) <= FLOAT32_GATE
    with pytest.raises(CheckpointError, match="vocabulary"):
        encoder(np.array([1, VOCAB]))


def test_expected_tensors_of_the_9b_config_match_transformers():
    config = transformers.Qwen3_5TextConfig()
    with torch.device("meta"):
        model = transformers.Qwen3_5TextModel(config)
    assert expected_tensors({}) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    layers = text_config({})["layer_types"]
    assert [i for i, t in enumerate(layers) if t == "full_attention"] == list(range(3, 32, 4))


def test_text_config_resolves_like_transformers():
    # no rope parameters at all: transformers' default theta (1e4), not the 9B's 1e7
    plain = {"model_type": "qwen3_5_text", "num_hidden_layers": 6, "full_attention_interval": 3}
    hf_plain = transformers.Qwen3_5TextConfig(**plain)
    ours = text_config(plain)
    assert ours["rope_parameters"]["rope_theta"] == hf_plain.rope_parameters["rope_theta"] == 10000
    assert ours["rope_parameters"]["partial_rotary_factor"] == hf_plain.rope_parameters["partial_rotary_factor"]
    assert ours["layer_types"] == hf_plain.layer_types
    # legacy top-level keys
    legacy = {"rope_theta": 5e6, "partial_rotary_factor": 0.5}
    hf_legacy = transformers.Qwen3_5TextConfig(**legacy)
    assert text_config(legacy)["rope_parameters"]["rope_theta"] == hf_legacy.rope_parameters["rope_theta"]
    assert (text_config(legacy)["rope_parameters"]["partial_rotary_factor"]
            == hf_legacy.rope_parameters["partial_rotary_factor"])
    # composite config: the text part is read
    composite = transformers.Qwen3_5Config(text_config=CONFIGS["eight_layers"]).to_dict()
    assert text_config(composite)["hidden_size"] == 48
    assert text_config(composite)["rope_parameters"]["rope_theta"] == 1e6


# --- GDN ops ------------------------------------------------------------------------------------------


def gdn_inputs(length, hk=2, hv=4, dk=16, dv=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((length, hk, dk))
    k = rng.standard_normal((length, hk, dk))
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * math.sqrt(dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((length, hv, dv))
    g = -rng.uniform(0.0, 0.2, (length, hv))           # mild decay: the state carries across chunks
    beta = rng.uniform(0.0, 1.0, (length, hv))
    return q, k, v, g, beta


def spec_loop(q, k, v, g, beta, decay_first=True):
    """encoder.md 2.5 step 6 written plainly, one value head and one token at a time (float64)."""
    length, hv, dv = v.shape
    group = hv // k.shape[1]
    out = np.zeros_like(v)
    for j in range(hv):
        state = np.zeros((k.shape[2], dv))
        for t in range(length):
            kt, qt = k[t, j // group], q[t, j // group]
            if decay_first:
                state = math.exp(g[t, j]) * state
            read = state.T @ kt
            if not decay_first:        # planted control: the decay lands after the read
                state = math.exp(g[t, j]) * state
            state = state + np.outer(kt, beta[t, j] * (v[t, j] - read))
            out[t, j] = state.T @ qt
    return out


@pytest.mark.parametrize("length", (1, 63, 64, 65, 150))
def test_delta_rule_forms_agree_in_float64(length):
    ops = numpy_ops(np.float64)
    args = gdn_inputs(length)
    chunk = ops.gated_delta_rule(*args, form="chunk")
    loop = ops.gated_delta_rule(*args, form="recurrent")
    plain = spec_loop(*args)
    assert DELTA_CHUNK == 64
    assert np.abs(chunk - loop).max() <= 1e-12
    assert np.abs(chunk - plain).max() <= 1e-12


def test_delta_rule_catches_decay_after_read():
    ops = numpy_ops(np.float64)
    args = gdn_inputs(150)
    planted = spec_loop(*args, decay_first=False)
    for form in ("chunk", "recurrent"):
        assert rel(ops.gated_delta_rule(*args, form=form), planted) > 1e-2


def test_delta_rule_matches_transformers_chunk_function():
    # transformers' chunk function run in float64 (its float32 casts made float64): a float32 torch statement
    # on the CPU would carry that machine's float32 kernels' error into the reference
    q, k, v, g, beta = gdn_inputs(150, hk=3, hv=6, dk=8, dv=12, seed=3)
    # HF scales the queries by dk^-1/2 itself; ours takes them pre-scaled
    t = [torch.tensor(x)[None] for x in (q * math.sqrt(q.shape[-1]), k, v, g, beta)]
    with transformers64.float64():
        ref, _ = hf.torch_chunk_gated_delta_rule(*t, chunk_size=64)
    assert ref.dtype == torch.float64
    ref = ref[0].numpy()
    for dtype, gate in ((np.float64, 1e-14), (np.float32, 2e-6)):
        ops = numpy_ops(dtype)
        ours = ops.gated_delta_rule(*(ops.array(x) for x in (q, k, v, g, beta)), form="chunk")
        assert rel(ours, ref) <= gate


def test_causal_conv1d_matches_transformers():
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((37, 10)), rng.standard_normal((10, 4))
    ref = hf.causal_conv1d_fn(torch.tensor(x.T)[None], torch.tensor(w))[0].numpy().T
    assert np.abs(numpy_ops(np.float64).causal_conv1d(x, w) - ref).max() <= 1e-12


def test_l2_norm_matches_transformers():
    x = np.random.default_rng(5).standard_normal((7, 3, 16)) * 1e-3     # small rows: eps matters
    ref = hf.l2norm(torch.tensor(x), dim=-1, eps=1e-6).numpy()
    assert np.abs(numpy_ops(np.float64).l2_norm(x, 1e-6) - ref).max() <= 1e-12


def test_gated_rms_norm_matches_transformers():
    rng = np.random.default_rng(6)
    x, z, w = rng.standard_normal((9, 4, 8)), rng.standard_normal((9, 4, 8)), 1 + 0.5 * rng.standard_normal(8)
    norm = hf.Qwen3_5RMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(w, dtype=torch.float32))
        ref = norm(torch.tensor(x, dtype=torch.float32), torch.tensor(z, dtype=torch.float32)).double().numpy()
    ops = numpy_ops(np.float32)
    ours = ops.gated_rms_norm(ops.array(x), ops.array(z), ops.array(w), 1e-6)
    assert rel(ours, ref) <= 1e-6


# --- the tiny GPU encoder test's gate (tests/gpu/test_cuda_encoder_tiny.py), checked on the CPU --------------


@pytest.mark.parametrize("length", (5, 70))
def test_bf16_gate_catches_rope_removal_on_the_cpu(length, monkeypatch):
    """The GPU test's gate is 2x the error of a CPU statement of the GPU's bf16 roundings
    (tests/encoder_bf16.py): it must sit above that statement's error and below what RoPE removal does,
    at every length the GPU test uses, L = 5 included (the former 0.118 gate passed RoPE removal there)."""
    import encoder_bf16
    from moss_cli import encoder
    from moss_cli.checkpoint import open_checkpoint
    component = open_checkpoint().component("text_encoder")
    ids = np.random.default_rng(length).integers(0, 500, length)
    ref = encoder_bf16.float64_rows(component, ids)
    gate, stated = encoder_bf16.gate(component, ids, ref)
    # the statement's error as recorded when the gate was set (0.0248 at L = 5, 0.0471 at 70): a change to
    # Bf16Roundings that moves the gate shows here
    assert stated == pytest.approx({5: 0.0248, 70: 0.0471}[length], rel=0.05)
    monkeypatch.setattr(encoder, "rope_tables", encoder_bf16.without_rope)
    assert encoder_bf16.relative(encoder_bf16.float64_rows(component, ids), ref) > gate
    emulated = Qwen35Encoder(encoder_bf16.Bf16Roundings(), component.tensors, component.config)(ids)
    assert encoder_bf16.relative(emulated, ref) > gate
