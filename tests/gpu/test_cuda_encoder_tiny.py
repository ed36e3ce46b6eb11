"""On a GPU: the tiny checkpoint's encoder rows from the CUDA op table match the CPU float32 rows.

Gate: the GPU rounds each linear's input to bf16 (relative error at most u = 2^-8 per rounding), the
MLP's gate and up projections' outputs where ops.narrow_products is set, and in flash attention (the
default attention_form) q, k, v and the probabilities; along the longest path of a forward there are at
most m = 7 roundings per layer + 1, which adds up (randomly signed) to sqrt(m) u; we allow 4x that for
the network's amplification of random weights.
"""

import math

import numpy as np
import pytest

import cuda_kernels

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")


@pytest.fixture(scope="module")
def component():
    from moss_cli.checkpoint import open_checkpoint
    return open_checkpoint().component("text_encoder")


def _cpu_rows(component, ids):
    from moss_cli.encoder import Qwen35Encoder
    from moss_cli.ops import numpy_ops
    return Qwen35Encoder(numpy_ops(np.float32), component.tensors, component.config)(ids)


@pytest.mark.parametrize("length", [5, 70])
def test_gpu_rows_match_cpu_float32_rows_within_the_bf16_gate(component, length):
    from moss_cli.ops.cuda_table import cuda_encoder
    ids = np.random.default_rng(length).integers(0, 500, length)
    cpu = _cpu_rows(component, ids)
    gpu = cuda_encoder(component)(ids)
    layers = len(component.config.get("text_config", component.config)["layer_types"])
    gate = 4 * math.sqrt(7 * layers + 1) * 2.0 ** -8
    err = np.linalg.norm(gpu - cpu) / np.linalg.norm(cpu)
    print(f"L={length}: relative error {err:.3g}, gate {gate:.3g}")
    assert gpu.shape == cpu.shape and gpu.dtype == np.float32
    assert err <= gate


def test_graph_replays_are_byte_identical_and_equal_the_eager_pass(component):
    from moss_cli.ops.cuda_table import CudaEncoder
    ids = np.random.default_rng(1).integers(0, 500, 40)
    enc = CudaEncoder(component.tensors, component.config)
    first, second = enc(ids), enc(ids)
    assert first.tobytes() == second.tobytes()
    kept = np.full_like(first, np.nan)
    assert enc(ids, out=kept) is kept and kept.tobytes() == first.tobytes()
    pinned = enc.host_rows(ids.size)
    pinned[:] = np.nan
    assert enc(ids, out=pinned) is pinned and pinned.tobytes() == first.tobytes()
    assert enc.timings["gpu_s"] > 0 and enc.timings["copy_s"] > 0
    with pytest.raises(ValueError):
        enc(ids, out=np.empty((ids.size + 1, first.shape[1]), np.float32))
    eager_enc = CudaEncoder(component.tensors, component.config, graphs=False)
    eager = eager_enc(ids)
    # the graph pads to its bucket: the same kernels on more rows, so equal to float32 rounding
    np.testing.assert_allclose(first, eager, rtol=0, atol=1e-4 * np.abs(eager).max())
    # other ids of the same bucket (40) through the same graph: its replay reads each call's ids and pads
    other = np.random.default_rng(2).integers(0, 500, 38)
    assert enc(other).shape == (38, first.shape[1]) and enc.timings["bucket"] == 40 and len(enc._captured) == 1
    np.testing.assert_allclose(enc(other), eager_enc(other), rtol=0, atol=1e-4 * np.abs(eager).max())
    assert enc(ids).tobytes() == first.tobytes()


def test_moss_encode_on_the_gpu_writes_the_same_bytes_in_two_processes(tmp_path):
    """Each process plans its products anew (the stored pick of cuda_kernels/GEMM_PICKS.json for this GPU and
    cuBLASLt where there is one, else cuBLASLt's heuristic; no timing unless MOSS_GEMM_TUNE=1), so two runs
    of the command must write identical files."""
    import os
    from cli_util import run
    env = {k: v for k, v in os.environ.items() if k != "MOSS_GEMM_TUNE"}
    outs = []
    for i in range(2):
        out = tmp_path / f"fox{i}.enc"
        done = run("moss-encode", "--prompt", "a red fox in the snow", "--device", "cuda", "--out", out, env=env)
        assert done.code == 0, done.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
