"""A GPU without room for a component's weights is refused with one clear line before any upload
(stages._require_gpu_room); the GPU's free memory is stated here, so this runs without one."""

import pytest

from moss_cli import stages
from moss_cli.checkpoint import open_checkpoint
from moss_cli.errors import DeviceError


def _weight_bytes(comp, matrix_bytes):
    """What the GPU holds of a component: its tensors but the encoder's embedding table (read on the host)."""
    host = "embed_tokens.weight" if comp.name == "text_encoder" else None
    return sum(int(a.size) * (matrix_bytes if a.ndim == 2 else 4) for k, a in comp.tensors.items() if k != host)


@pytest.mark.parametrize("part,name,matrix_bytes", [("encoder", "text_encoder", 2), ("transformer", "transformer", 2),
                                                    ("decoder", "vae", 4)])
def test_a_component_that_does_not_fit_is_refused_before_loading(monkeypatch, part, name, matrix_bytes):
    checkpoint = open_checkpoint()
    need = _weight_bytes(checkpoint.component(name), matrix_bytes)
    assert need > 0
    monkeypatch.setattr(stages, "_gpu_memory", lambda: (need - 1, 80e9))
    with pytest.raises(DeviceError, match=r"needs .* GB of GPU memory for its weights.*--device cpu"):
        getattr(stages.Model(checkpoint, device="cuda"), part)


def test_exactly_enough_room_passes_the_check(monkeypatch):
    comp = open_checkpoint().component("transformer")
    monkeypatch.setattr(stages, "_gpu_memory", lambda: (_weight_bytes(comp, 2), 80e9))
    stages._require_gpu_room(comp, 2)


def test_the_encoder_is_not_asked_room_for_its_embedding_table(monkeypatch):
    comp = open_checkpoint().component("text_encoder")
    table = comp.tensors["embed_tokens.weight"]
    assert table.size > 0
    monkeypatch.setattr(stages, "_gpu_memory", lambda: (_weight_bytes(comp, 2), 80e9))
    stages._require_gpu_room(comp, 2)             # room for all but the table: enough
