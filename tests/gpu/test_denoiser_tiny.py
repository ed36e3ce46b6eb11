"""On a GPU: the tiny checkpoint's DiT trajectory on the CUDA op table (one graph per step) against the CPU.

Gate: each step's guided velocity, relative L2 error against the CPU float32 velocity of the same latents
(the GPU trace's own latents_in, so the comparison is per step, not accumulated along the trajectory),
at most GATE = 8 u with u = 2^-8 the bf16 unit roundoff: the GPU rounds every product's operands and outputs
and the attention's inputs and probabilities to bf16 (float32 residual stream and accumulation), and those
roundings, randomly signed, stay within a few u of the result (measured: PRINTED below and in BENCHMARKS.md).
The planted control: RoPE removed (cos = 1, sin = 0) moves the velocity by 10-20% at these sizes, so the
same gate must fail for it at every size tested.
"""

import numpy as np
import pytest

import cuda_kernels
from moss_cli.sampler import skipped

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")

GATE = 8 * 2.0 ** -8
SIZES = [(4, 4), (6, 8)]          # latent tokens (h, w): 64x64 and 96x128 pictures


@pytest.fixture(scope="module")
def component():
    from moss_cli.checkpoint import open_checkpoint
    return open_checkpoint().component("transformer")


def _rows(length, seed):
    return np.random.default_rng(seed).standard_normal((length, 32)).astype(np.float32)


def _cpu_velocity(model, x, t, cond, uncond, skip, guidance=3.0):
    from moss_cli.sampler import guided
    c = model.velocity(x, t, cond)
    u = model.velocity(x, t, uncond, skip)
    return guided(np.asarray(c, np.float32), np.asarray(u, np.float32), guidance)


def _denoiser(component):
    from moss_cli.gpu.denoiser import CudaDenoiser
    dit = CudaDenoiser(component.tensors, component.config)
    dit.upload()
    return dit


def _gpu_trace(component, h, w, steps=4, dit=None, seeds=(1, 2)):
    from moss_cli.schedule import sigmas
    dit = dit or _denoiser(component)
    cond, uncond = dit.prepare_text(_rows(7, seeds[0])), dit.prepare_text(_rows(5, seeds[1]))
    noise = np.random.default_rng(h * w).standard_normal((1, 128, h, w)).astype(np.float32)
    sig = sigmas(steps, shift=3.0)
    trace = []
    out = dit.sample(noise, sig, cond, uncond, 3.0, (22,), 0.01, 1.0,
                     on_step=lambda i, s, x, v: trace.append((x.copy(), v.copy())), arrays=True)
    return sig, trace, out


def _errors(component, sig, trace):
    from moss_cli.ops import numpy_ops
    from moss_cli.schedule import timesteps
    from moss_cli.transformer import MossTransformer
    cpu = MossTransformer(numpy_ops(np.float32), component.tensors, component.config)
    cond, uncond = cpu.prepare_text(_rows(7, 1)), cpu.prepare_text(_rows(5, 2))
    ts = timesteps(sig)
    errs = []
    for i, (x, v) in enumerate(trace):
        skip = skipped(i, len(trace), (22,))
        ref = _cpu_velocity(cpu, x, float(ts[i]), cond, uncond, skip)
        errs.append(float(np.linalg.norm(v - ref) / np.linalg.norm(ref)))
    return errs


@pytest.mark.parametrize("h,w", SIZES)
def test_gpu_trace_matches_the_cpu_step_by_step_within_the_bf16_gate(component, h, w):
    sig, trace, out = _gpu_trace(component, h, w)
    errs = _errors(component, sig, trace)
    print(f"{h}x{w} tokens: per-step velocity relative error {['%.3g' % e for e in errs]}, gate {GATE:.3g}")
    assert len(trace) == 4 and out.shape == (1, 128, h, w) and np.all(np.isfinite(out))
    assert max(errs) <= GATE


@pytest.mark.parametrize("h,w", SIZES)
def test_planted_rope_removal_fails_the_same_gate(component, h, w, monkeypatch):
    from moss_cli import transformer
    monkeypatch.setattr(transformer, "rope_tables",
                        lambda pos, hd, base, dtype: (np.ones((len(pos), hd // 2), dtype),
                                                      np.zeros((len(pos), hd // 2), dtype)))
    sig, trace, _ = _gpu_trace(component, h, w, steps=1)
    monkeypatch.undo()
    errs = _errors(component, sig, trace)
    print(f"{h}x{w} tokens, RoPE removed: relative error {errs[0]:.3g}, gate {GATE:.3g}")
    assert errs[0] > GATE


def test_two_trajectories_are_byte_identical(component):
    _, _, a = _gpu_trace(component, 4, 4)
    _, _, b = _gpu_trace(component, 4, 4)
    assert a.tobytes() == b.tobytes()


def test_a_new_prompt_of_the_same_lengths_replays_the_captured_graphs(component):
    """The graphs read the texts from fixed buffers: the second prompt captures nothing new, and its latents
    equal those of a fresh denoiser's (so no state of the first prompt leaks into the second); its own
    latents differ from the first prompt's (so the new tokens did reach the graphs)."""
    dit = _denoiser(component)
    _, _, first = _gpu_trace(component, 4, 4, dit=dit)
    graphs = len(dit._graphs)
    _, _, second = _gpu_trace(component, 4, 4, dit=dit, seeds=(3, 4))
    assert len(dit._graphs) == graphs
    _, _, fresh = _gpu_trace(component, 4, 4, seeds=(3, 4))
    assert second.tobytes() == fresh.tobytes()
    assert first.tobytes() != second.tobytes()


def test_graphs_past_the_limit_go_and_a_size_captured_again_gives_the_same_bytes(component):
    """Two step graphs kept: the 6x8 trajectory's graphs push out the 4x4 ones and their size buffers; the 4x4
    trajectory then captures again and its latents equal the first 4x4 trajectory's and a fresh denoiser's."""
    dit = _denoiser(component)
    dit.KEEP_GRAPHS = 2
    _, _, first = _gpu_trace(component, 4, 4, dit=dit)
    _gpu_trace(component, 6, 8, dit=dit)
    assert len(dit._graphs) == 2 and set(dit._fixed) == {(128, 6, 8)}
    _, _, again = _gpu_trace(component, 4, 4, dit=dit)
    _, _, fresh = _gpu_trace(component, 4, 4)
    assert again.tobytes() == first.tobytes() == fresh.tobytes()


def test_a_prompt_seen_before_reuses_its_refined_text_and_gives_the_same_bytes(component):
    """A, B, then A again on one denoiser: the third trajectory's texts come from the kept copies (no
    refiner run), and its latents equal the first's byte for byte, so the kept tokens are the refiner's and
    B's trajectory wrote nothing into them."""
    dit = _denoiser(component)
    _, _, first = _gpu_trace(component, 4, 4, dit=dit)
    _gpu_trace(component, 4, 4, dit=dit, seeds=(3, 4))
    refined = dit.texts.misses
    _, _, again = _gpu_trace(component, 4, 4, dit=dit)
    assert dit.texts.misses == refined == 4 and dit.texts.hits == 2
    assert again.tobytes() == first.tobytes()


def test_a_first_step_run_eagerly_for_a_single_trajectory_gives_the_graphs_bytes(component):
    """sample(once=True) (moss-denoise, a moss-image of one picture): the first step, the only one with the full
    negative pass, runs eagerly on the latents and no graph is made for it; the latents are the graphs' bytes."""
    from moss_cli.schedule import sigmas
    noise = np.random.default_rng(11).standard_normal((1, 128, 4, 6)).astype(np.float32)
    out = {}
    for once in (False, True):
        dit = _denoiser(component)
        cond, uncond = dit.prepare_text(_rows(7, 1)), dit.prepare_text(_rows(5, 2))
        out[once] = (dit.sample(noise, sigmas(6, shift=3.0), cond, uncond, 3.0, (22,), 0.01, 1.0, once=once),
                     len(dit._graphs))
    assert out[True][0].tobytes() == out[False][0].tobytes()
    assert (out[False][1], out[True][1]) == (2, 1)
