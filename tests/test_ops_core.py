"""The core numpy ops against torch (float64) and by hand."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moss_cli.ops import numpy_ops

rng = np.random.default_rng(7)


@pytest.mark.parametrize("causal,L,S", [(False, 5, 5), (True, 5, 5), (False, 1100, 1100), (True, 1100, 1100),
                                         (False, 3, 9)])
def test_attention_matches_torch_sdpa_with_grouped_heads(causal, L, S):
    ops = numpy_ops(np.float64)
    q, k, v = rng.normal(size=(L, 4, 8)), rng.normal(size=(S, 2, 8)), rng.normal(size=(S, 2, 6))
    t = lambda a: torch.tensor(a).permute(1, 0, 2)
    ref = F.scaled_dot_product_attention(t(q), t(k).repeat_interleave(2, 0), t(v).repeat_interleave(2, 0),
                                         is_causal=causal, scale=0.3).permute(1, 0, 2).numpy()
    assert np.abs(ops.attention(q, k, v, 0.3, causal=causal) - ref).max() < 1e-12


def test_rms_norm_zero_centred_and_plain():
    ops = numpy_ops(np.float64)
    x, w = rng.normal(size=(3, 16)), rng.normal(size=16)
    ref = torch.tensor(x) * torch.rsqrt(torch.tensor(x).pow(2).mean(-1, keepdim=True) + 1e-6)
    assert np.abs(ops.rms_norm(x, w, 1e-6) - (ref * torch.tensor(w)).numpy()).max() < 1e-13
    assert np.abs(ops.rms_norm(x, w, 1e-6, offset=1.0) - (ref * (1 + torch.tensor(w))).numpy()).max() < 1e-13


def test_rope_rotates_pairs_j_and_j_plus_r_and_leaves_the_rest():
    ops = numpy_ops(np.float64)
    x = np.arange(1.0, 11.0).reshape(1, 1, 10)       # r = 2: pairs (0,2), (1,3); dims 4.. untouched
    theta = np.array([[np.pi / 2, np.pi]])
    out = ops.rope(x, np.cos(theta), np.sin(theta))[0, 0]
    # (x0, x2) = (1, 3) turned by 90 degrees -> (-3, 1); (x1, x3) = (2, 4) by 180 degrees -> (-2, -4)
    np.testing.assert_allclose(out[:4], [-3.0, -2.0, 1.0, -4.0], atol=1e-15)
    np.testing.assert_array_equal(out[4:], x[0, 0, 4:])


def test_softplus_follows_torch_threshold():
    ops = numpy_ops(np.float64)
    x = np.array([-30.0, -1.0, 0.0, 19.9, 20.0, 20.1, 50.0])
    np.testing.assert_allclose(ops.softplus(x), F.softplus(torch.tensor(x)).numpy(), rtol=1e-15, atol=0)


def test_param_converts_bf16_once():
    import ml_dtypes
    ops = numpy_ops(np.float32)
    stored = {"w": np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16)}
    a = ops.param(stored, "w")
    assert a.dtype == np.float32 and a.tolist() == [1.5, -2.25] and ops.param(stored, "w") is a


def test_param_cache_stops_at_its_budget(monkeypatch):
    from moss_cli.ops.numpy import core as numpy_core
    monkeypatch.setattr(numpy_core, "PARAM_CACHE_BYTES", 16)
    ops = numpy_ops(np.float32)
    stored = {"small": np.ones(4, np.float32), "big": np.arange(8, dtype=np.float32)}
    assert ops.param(stored, "small") is ops.param(stored, "small")
    big = ops.param(stored, "big")
    assert big.tolist() == list(range(8)) and ops.param(stored, "big") is not big
