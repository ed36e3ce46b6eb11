"""What a call does only because it makes one picture: the decoder's graph made beside the DiT's steps (which
runs get it: stages.decoder_beside, batch.made; the host thread that runs it: gpu.denoiser._Beside), and rows,
a first step or pixels used once computed eagerly, with no graph (`once`: stages.encode, denoise and decode;
batch's one prompt and one picture). That
these change no byte and write nothing the steps read is checked on a GPU (tests/gpu/test_decoder_beside_gpu.py,
test_decoder_gpu.py, test_cuda_encoder_tiny.py)."""

import dataclasses
import threading
import time
import types

import numpy as np
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

    def denoise(model, enc, options, next_seed=None, init=None, beside=None, once=False):
        seen["beside"], seen["once"] = beside, once
        return b"lat", None
    monkeypatch.setattr(stages, "denoise", denoise)
    monkeypatch.setattr(stages, "decode_pixels", lambda model, lat: ("pixels", "text"))
    monkeypatch.setattr(batch.artifacts, "parse", lambda *a: "parsed")
    options = types.SimpleNamespace(width=256, height=256)
    out = batch.made({"denoise": denoising, "decode": decoding}.get, "enc", options, "fp", once=same)
    assert out == (b"lat", "pixels", "text")
    assert (seen["beside"] is not None) == same and seen["once"] == same


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


class FakeEncoder:
    def __init__(self):
        self.onces = []

    def __call__(self, ids, once=False):
        self.onces.append(once)
        return np.zeros((len(ids), 4), np.float32)


@pytest.mark.parametrize("device,once,expected", [("cuda", True, [True, True]), ("cuda", False, [False, False]),
                                                  ("cpu", True, [False, False])])
def test_encode_asks_the_gpu_encoder_for_rows_used_once_only_when_told(monkeypatch, device, once, expected):
    model = types.SimpleNamespace(device=device, encoder=FakeEncoder(), fingerprint="fp",
                                  progress=types.SimpleNamespace(note=lambda m: None, warn=lambda m: None),
                                  lora_metadata=lambda: {}, tokenizer=types.SimpleNamespace(
                                      encode_prompt=lambda text: ([1, 2, 3] if text == "p" else [4, 5], False)))
    monkeypatch.setattr(stages.artifacts, "build", lambda stage, tensors, meta, fp: tensors)
    stages.encode(model, "p", "n", once=once)
    assert model.encoder.onces == expected


@pytest.mark.parametrize("prompts,seeds,once,denoised_once", [(["a"], ["1"], True, True),
                                                               (["a"], ["1,2"], True, False),
                                                               (["a", "b"], ["1"], False, False)])
def test_moss_image_encodes_and_denoises_once_only_with_one_prompt_and_one_picture(monkeypatch, tmp_path, prompts,
                                                                                  seeds, once, denoised_once):
    seen, denoised = [], []
    monkeypatch.setattr(batch, "encoded", lambda *a, once=False: (seen.append(once), (b"enc", "enc"))[1])
    monkeypatch.setattr(batch, "made", lambda *a, once=False, **k: (denoised.append(once), (b"lat", "pixels", "text"))[1])
    model = types.SimpleNamespace(device="cpu", plan=None, draw_noise_ahead=lambda *a: None,
                                  checkpoint=types.SimpleNamespace(config=lambda name: {"latent_channels": 128}))
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    pictures = batch.plan(None, str(tmp_path / "prompts.txt"), seeds, str(tmp_path / "p-{index}-{seed}.png"))
    options = dataclasses.make_dataclass("Options", [("width", int, 64), ("height", int, 64), ("noise", str, "cpu"),
                                                     ("cfg", bool, True), ("seed", int, 1)])()
    list(batch._made(pictures, options, "neg", lambda stage: model, "fp", None, types.SimpleNamespace(
        picture=lambda *a: None)))
    assert seen == [once] * len(prompts) and denoised == [denoised_once] * len(pictures)


def test_an_eager_pass_no_graph_follows_lets_go_of_the_blocks_it_made_and_keeps_older_ones():
    from moss_cli.memory.pool import Pool
    pool = Pool(lambda n: bytearray(n))
    pool.give(pool.take(4 << 20))                  # made before the pass: kept
    pool.record()
    a, b = pool.take(4 << 20), pool.take(8 << 20)  # the older block lent again, and one made by the pass
    pool.give(a)
    pool.give(b)
    assert pool.bytes == 12 << 20                  # the control: a recording alone keeps what the pass made
    pool.forget()
    assert pool.bytes == pool.free_bytes == 4 << 20 and pool.take(4 << 20).order == 0
