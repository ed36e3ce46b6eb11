"""The weights moss-image sends before the kernel library is imported (moss_cli/memory/preload.py), on the CPU
through the upload lanes with the fake driver (host memory as the device): for the tiny checkpoint's encoder and
transformer, what `start` hands over is, name for name, what their GPU graphs read (weight_names), and byte for
byte what torch stores them as: 2-D matrices rounded to bf16 by torch, a stack its parts' rows in order, the rest
float32. `take` gives each weight once, done; `handed_bytes` counts what is left; the room check counts the
handed bytes as already on the GPU. Controls: a bf16 conversion that truncates, and weights placed over one
another in the shared device allocation, are caught."""

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("numba", reason="numba is not installed")
torch = pytest.importorskip("torch")
from moss_cli import stages                              # noqa: E402
from moss_cli.checkpoint import open_checkpoint          # noqa: E402
from moss_cli.errors import DeviceError                  # noqa: E402
from moss_cli.memory import driver as cuda_driver, preload as cuda_preload, host_weights       # noqa: E402
from moss_cli.memory.lanes import LaneUploader         # noqa: E402
from fake_driver import FakeDriver                       # noqa: E402

PARTS = ("text_encoder", "transformer")


def torch_stored(tensors, name):
    """The bytes the GPU should hold for a weight, by torch: bf16 bits of 2-D matrices, float32 otherwise."""
    if isinstance(name, tuple):
        return np.concatenate([torch_stored(tensors, n) for n in name])
    a = np.asarray(tensors[name])
    a = a.astype(np.float32) if a.dtype.name == "bfloat16" else a
    if a.ndim == 2:
        return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16).view(torch.int16).numpy() \
            .view(np.uint16)
    return np.asarray(a, np.float32)


def lanes():
    return LaneUploader(lanes=2, slots=2, slot_bytes=1 << 14, driver=FakeDriver())


def component(part, wide):
    """The tiny checkpoint's component (bf16), fresh; `wide`: its tensors as float32 nudged off the bf16 grid
    (a float checkpoint: the matrices' bits are then rounded on the way)."""
    comp = open_checkpoint().component(part)
    if not wide:
        return comp
    rng = np.random.default_rng(0)
    tensors = {k: (np.asarray(v, np.float32) * (1 + 2.0 ** -10 * rng.standard_normal(v.shape))).astype(np.float32)
               for k, v in comp.tensors.items()}
    return SimpleNamespace(name=comp.name, config=comp.config, tensors=tensors)


def handed_and_wrong(part, wide=True):
    """Hand a fresh copy of the tiny checkpoint's component over; (names the graph reads, names whose weight is
    missing or differs from torch's bytes, bytes left after taking every one)."""
    comp = component(part, wide)
    up = lanes()
    handed = cuda_preload.start(comp, uploader=up)
    assert handed == cuda_preload.handed_bytes(comp.tensors) > 0
    up.finish()
    names = cuda_preload.weight_names(comp)
    wrong = []
    for name in names:
        got = cuda_preload.take(comp.tensors, name)
        if got is None:
            wrong.append(name)
            continue
        out, queued = got
        want = torch_stored(comp.tensors, name)
        if not (queued.done() and out.dtype == want.dtype and out.shape == want.shape
                and np.array_equal(out.view(np.uint8), want.view(np.uint8))):
            wrong.append(name)
        assert cuda_preload.take(comp.tensors, name) is None          # once
    left = cuda_preload.handed_bytes(comp.tensors)
    cuda_preload.discard(uploader=up)
    up.close()
    return names, wrong, left


@pytest.mark.parametrize("wide", [False, True], ids=["bf16", "float32"])
@pytest.mark.parametrize("part", PARTS)
def test_the_preload_hands_over_what_the_graph_reads_as_torch_stores_it(part, wide):
    names, wrong, left = handed_and_wrong(part, wide=wide)
    assert any(isinstance(n, tuple) for n in names) and any(not isinstance(n, tuple) for n in names)
    assert not wrong and left == 0


def test_control_a_truncating_bf16_conversion_is_caught(monkeypatch):
    def truncated(value):
        a = np.asarray(value)
        if a.ndim == 2:
            return (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return np.asarray(a, np.float32)
    monkeypatch.setattr(cuda_preload, "stored_form", truncated)
    monkeypatch.setattr(host_weights, "stored_form", truncated)      # the stacks' parts
    names, wrong, _ = handed_and_wrong("transformer")
    matrices = [n for n in names if isinstance(n, tuple) or np.ndim(component("transformer", True).tensors[n]) == 2]
    assert set(matrices) <= set(wrong)


def test_control_weights_over_one_another_in_the_allocation_are_caught(monkeypatch):
    view = cuda_preload._view
    monkeypatch.setattr(cuda_preload, "_view", lambda arena, offset, shape, dtype: view(arena, 0, shape, dtype))
    names, wrong, _ = handed_and_wrong("text_encoder")
    assert len(wrong) >= len(names) - 1
    monkeypatch.undo()
    assert not handed_and_wrong("text_encoder")[1]


def test_bf16_checkpoint_tensors_keep_their_bits_and_widen_exactly():
    rng = np.random.default_rng(1)
    matrix = rng.standard_normal((5, 7)).astype(ml_dtypes.bfloat16)
    vector = rng.standard_normal(9).astype(ml_dtypes.bfloat16)
    assert np.array_equal(cuda_preload.stored_form(matrix), matrix.view(np.uint16))
    widened = cuda_preload.stored_form(vector)
    assert widened.dtype == np.float32 and np.array_equal(widened, torch.from_numpy(
        vector.view(np.uint16).astype(np.int16)).view(torch.bfloat16).float().numpy())


def test_the_room_check_counts_the_handed_weights_as_on_the_gpu(monkeypatch):
    comp = open_checkpoint().component("transformer")
    monkeypatch.setattr(stages, "_gpu_memory", lambda: (0, 80e9))
    with pytest.raises(DeviceError, match="needs .* GB of GPU memory"):
        stages._require_gpu_room(comp, 2)
    up = lanes()
    cuda_preload.start(comp, uploader=up)
    unread = sum(int(a.size) * (2 if a.ndim == 2 else 4) for a in comp.tensors.values()) \
        - cuda_preload.handed_bytes(comp.tensors)
    assert unread < 64                   # the transformer's graph reads (almost) every tensor of it
    stages._require_gpu_room(comp, 2, memory=lambda: (unread, 80e9))     # room asked only for the rest
    if unread:
        with pytest.raises(DeviceError):
            stages._require_gpu_room(comp, 2, memory=lambda: (unread - 1, 80e9))
    cuda_preload.discard(uploader=up)
    assert cuda_preload.handed_bytes(comp.tensors) == 0
    up.close()


def test_without_a_gpu_the_preload_does_nothing():
    checkpoint = open_checkpoint()
    assert stages.preload_gpu_weights(checkpoint, "cpu") == (0, None)
    try:
        cuda_driver.Driver(open=True)
    except Exception:
        assert stages.preload_gpu_weights(checkpoint, "cuda") == (0, None)
        assert stages.preload_gpu_weights(checkpoint, "auto") == (0, None)
    else:
        pytest.skip("a GPU answers here")


def test_device_buffer_row_views_share_the_allocation():
    buf = cuda_driver.DeviceBuffer((6, 4), np.uint16, 1 << 20)
    view = buf[2:5]
    cai = view.__cuda_array_interface__
    assert cai["shape"] == (3, 4) and cai["typestr"] == "<u2" and cai["data"] == ((1 << 20) + 2 * 4 * 2, False)
    assert view.owner is buf and view[1:2].owner is buf and view.nbytes == 24 and buf[4:2].shape == (0, 4)
    with pytest.raises(TypeError):
        buf[::2]
