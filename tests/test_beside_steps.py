"""The decoder's graph made beside the DiT's steps: which runs get it (stages.decoder_beside, batch.made) and the
host thread that runs it (gpu.denoiser._Beside). That the graph's making writes nothing on the GPU and changes
no byte is checked on a GPU (tests/gpu/test_decoder_beside_gpu.py)."""

import threading
import time
import types

import pytest

from moss_cli import batch, stages


class FakeDecoder:
    def __init__(self):
        self.asked = []

    def graph_maker(self, shape):
        self.asked.append(shape)
        return lambda: None


def _model(device, plan=None):
    checkpoint = types.SimpleNamespace(config=lambda name: {"latent_channels": 128})
    return types.SimpleNamespace(device=device, plan=plan, decoder=FakeDecoder(), checkpoint=checkpoint)


@pytest.mark.parametrize("device,mode,made", [("cuda", None, True), ("cuda", "resident", True),
                                              ("cuda", "released", False), ("cuda", "streamed", False),
                                              ("cpu", None, False)])
def test_only_a_gpu_run_whose_plan_keeps_every_weight_resident_makes_the_graph_beside(device, mode, made):
    plan = None if mode is None else types.SimpleNamespace(resident=mode == "resident")
    model = _model(device, plan)
    options = types.SimpleNamespace(width=512, height=384)
    beside = stages.decoder_beside(model, options)
    assert (beside is not None) == made
    assert model.decoder.asked == ([(1, 128, 24, 32)] if made else [])


@pytest.mark.parametrize("same", [True, False])
def test_batch_made_passes_it_only_where_one_model_denoises_and_decodes(monkeypatch, same):
    seen = {}
    denoising = _model("cuda")
    decoding = denoising if same else _model("cuda")

    def denoise(model, enc, options, next_seed=None, init=None, beside=None):
        seen["beside"] = beside
        return b"lat", None
    monkeypatch.setattr(stages, "denoise", denoise)
    monkeypatch.setattr(stages, "decode_pixels", lambda model, lat: ("pixels", "text"))
    monkeypatch.setattr(batch.artifacts, "parse", lambda *a: "parsed")
    options = types.SimpleNamespace(width=256, height=256)
    out = batch.made({"denoise": denoising, "decode": decoding}.get, "enc", options, "fp")
    assert out == (b"lat", "pixels", "text")
    assert (seen["beside"] is not None) == same


def test_the_beside_thread_runs_apart_and_its_error_is_raised_where_it_is_waited_for():
    from moss_cli.gpu.denoiser import _Beside
    ran = {}

    def work():
        ran["thread"] = threading.current_thread().name
        time.sleep(0.05)
    seconds, waited = _Beside(work).wait()
    assert ran["thread"] == "beside-steps" and seconds >= 0.05 and waited >= 0

    def broken():
        raise RuntimeError("planted")
    with pytest.raises(RuntimeError, match="planted"):
        _Beside(broken).wait()
