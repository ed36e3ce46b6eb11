"""RefinedTexts: the text refiner's outputs kept per exact rows (the GPU denoiser keeps the last few prompts').

A reused Text must be what the refiner gives for those rows, so the key is the rows' dtype, shape and bytes:
rows one ulp apart, or -0.0 for 0.0, or the same values in another dtype are other prompts. The refiner here
is the float64 numpy DiT's on the tiny checkpoint; `own` counts its copies.
"""

import numpy as np
import pytest

from moss_cli.checkpoint import open_checkpoint
from moss_cli.ops import numpy_ops
from moss_cli.transformer import MossTransformer, RefinedTexts


@pytest.fixture(scope="module")
def model():
    component = open_checkpoint().component("transformer")
    return MossTransformer(numpy_ops(np.float64), component.tensors, component.config)


def rows(seed, n=6):
    return np.random.default_rng(seed).standard_normal((n, 32)).astype(np.float32)


def cache(model, keep=8):
    owned = []
    texts = RefinedTexts(model.prepare_text, own=lambda t: owned.append(t) or t, keep=keep)
    return texts, owned


def test_the_same_rows_reuse_the_refined_text_and_it_is_the_refiners(model):
    texts, owned = cache(model)
    a = rows(1)
    first = texts(a)
    again = texts(a.copy())
    assert again is first and (texts.hits, texts.misses) == (1, 1) and len(owned) == 1
    fresh = model.prepare_text(a)
    assert np.array_equal(np.asarray(first.tokens), np.asarray(fresh.tokens)) and first.length == fresh.length == 6


@pytest.mark.parametrize("change", ["one ulp", "negative zero", "float64", "one row less"])
def test_rows_that_differ_in_any_bit_are_refined_again(model, change):
    texts, owned = cache(model)
    a = rows(2)
    a[3, 5] = 0.0
    first = texts(a)
    b = a.copy()
    if change == "one ulp":
        b[5, 31] = np.nextafter(b[5, 31], np.float32(np.inf))
    elif change == "negative zero":
        b[3, 5] = -0.0
    elif change == "float64":
        b = a.astype(np.float64)
    else:
        b = a[:-1]
    second = texts(b)
    assert second is not first and texts.misses == 2 and len(owned) == 2
    want = model.prepare_text(b)
    assert np.array_equal(np.asarray(second.tokens), np.asarray(want.tokens))


def test_only_the_last_keep_prompts_are_kept(model):
    texts, _ = cache(model, keep=2)
    a, b, c = rows(3), rows(4), rows(5)
    ta = texts(a)
    texts(b)
    assert texts(a) is ta                   # a used again: b is now the oldest
    texts(c)                                # b goes
    assert texts(a) is ta and texts.misses == 3
    texts(b)
    assert texts.misses == 4
