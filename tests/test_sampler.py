"""CFG + block-22 skip + Euler (spec denoiser.md §5.3, §5.4), driven through a fake model that records calls."""

import numpy as np
import pytest

from moss_cli import sampler
from moss_cli.errors import UsageError
from moss_cli.schedule import sigmas as schedule_sigmas

COND, UNCOND = "cond", "uncond"


class FakeModel:
    """velocity = a smooth function of (x, t, text, skip), different for each so mix-ups show."""

    num_layers = 42

    def __init__(self):
        self.calls = []

    def velocity(self, latents, timestep, text, skip_layers=frozenset()):
        self.calls.append((timestep, text, frozenset(skip_layers), latents.copy()))
        bias = {COND: 0.3, UNCOND: -0.2}[text] + 0.05 * len(skip_layers)
        return (np.sin(latents * (1 + timestep / 1000)) + bias).astype(np.float32)


def noise(seed=0):
    return np.random.default_rng(seed).standard_normal((1, 128, 2, 3)).astype(np.float32)


def run(guidance, steps=50, **kw):
    model, seen = FakeModel(), []
    sig = schedule_sigmas(steps)
    out = sampler.sample(model, noise(), sig, COND, UNCOND if guidance != 1.0 else None, guidance,
                         on_step=lambda i, s, x, v: seen.append((i, s, x.copy(), v.copy())), **kw)
    return model, seen, sig, out


def test_defaults_are_the_official_recipe():
    assert sampler.DEFAULT_GUIDANCE == 3.0
    assert sampler.DEFAULT_SKIP_LAYERS == (22,)
    assert sampler.DEFAULT_SKIP_START == 0.01   # [M] S1 and the SGLang cookbook; S2/S3 use 0.0
    assert sampler.DEFAULT_SKIP_STOP == 1.0


def test_guidance_one_makes_one_conditional_call_per_step():
    model, seen, sig, _ = run(1.0, steps=8)
    assert [c[1] for c in model.calls] == [COND] * 8
    assert all(c[2] == frozenset() for c in model.calls)
    np.testing.assert_array_equal([c[0] for c in model.calls], (sig[:-1] * np.float32(1000)).astype(np.float32))
    assert [s[0] for s in seen] == list(range(8))


@pytest.mark.parametrize("guidance", [3.0, 0.0, 0.5])
def test_guidance_other_than_one_makes_two_calls_with_block_22_skipped_from_step_1(guidance):
    model, _, _, _ = run(guidance)
    assert len(model.calls) == 100
    assert [c[1] for c in model.calls] == [COND, UNCOND] * 50
    assert all(c[2] == frozenset() for c in model.calls[0::2])           # positive pass: every block
    skips = [c[2] for c in model.calls[1::2]]
    assert skips[0] == frozenset()                                       # step 0: 0/50 < 0.01
    assert skips[1:] == [frozenset({22})] * 49
    for a, b in zip(model.calls[0::2], model.calls[1::2]):               # same x, same t for both passes
        assert a[0] == b[0]
        np.testing.assert_array_equal(a[3], b[3])


def test_skip_window_from_zero_skips_every_step_and_a_stop_ends_it():
    model, _, _, _ = run(3.0, steps=10, skip_start=0.0)
    assert [c[2] for c in model.calls[1::2]] == [frozenset({22})] * 10
    model, _, _, _ = run(3.0, steps=10, skip_start=0.0, skip_stop=0.5, uncond_skip_layers=(3, 7))
    assert [c[2] for c in model.calls[1::2]] == [frozenset({3, 7})] * 5 + [frozenset()] * 5


def test_velocity_is_u_plus_g_times_c_minus_u():
    model, seen, _, _ = run(3.0, steps=6)
    for (i, _, x, v), c, u in zip(seen, model.calls[0::2], model.calls[1::2]):
        fake = FakeModel()
        c = fake.velocity(x, c[0], COND).astype(np.float64)
        u = fake.velocity(x, u[0], UNCOND, u[2]).astype(np.float64)
        assert v.dtype == np.float32
        np.testing.assert_allclose(v, u + 3.0 * (c - u), rtol=0, atol=4e-6)


def test_euler_update_moves_by_sigma_difference_times_velocity():
    _, seen, sig, out = run(3.0, steps=6)
    states = [s[2] for s in seen] + [out]
    np.testing.assert_array_equal(states[0], noise())
    for i, s, x, v in seen:
        assert s == sig[i]
        want = x.astype(np.float64) + (float(sig[i + 1]) - float(sig[i])) * v.astype(np.float64)
        np.testing.assert_allclose(states[i + 1], want, rtol=0, atol=1e-6)
    assert out.dtype == np.float32


def test_skip_layer_outside_the_model_is_a_usage_error():
    with pytest.raises(UsageError, match="skip layer 42"):
        run(3.0, steps=2, uncond_skip_layers=(42,))


def test_cfg_without_negative_rows_is_a_usage_error():
    with pytest.raises(UsageError, match="guidance 3.0"):
        sampler.sample(FakeModel(), noise(), schedule_sigmas(2), COND, None, 3.0)
