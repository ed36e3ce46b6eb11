"""A text encoder saved by transformers' save_pretrained (official prefix, its own config.json, with the
vision tower and lm_head it adds) goes through exactly the same reader and graph as the embedded one."""

import shutil

import numpy as np
import torch

from cli_util import copy_model, run
from moss_cli.checkpoint import EMBEDDED, open_checkpoint
from moss_cli.safetensors_io import load


def test_rows_from_a_save_pretrained_text_encoder_equal_the_embedded_ones(tmp_path):
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.utils import logging
    logging.set_verbosity_error()
    model = Qwen3_5ForConditionalGeneration.from_pretrained(EMBEDDED / "text_encoder", dtype=torch.float32)
    folder = copy_model(tmp_path)
    shutil.rmtree(folder / "text_encoder")
    model.save_pretrained(folder / "text_encoder")
    saved = open_checkpoint(folder).component("text_encoder")
    keys = set(load(folder / "text_encoder" / "model.safetensors")[0])
    assert any(k.startswith("model.language_model.layers.") for k in keys)
    assert any(not k.startswith("model.language_model.") for k in keys)      # visual / lm_head ride along
    embedded = open_checkpoint(None).component("text_encoder")
    assert set(saved.tensors) == set(embedded.tensors)

    outs = []
    for m in (None, folder):
        args = ["--model", m] if m else []
        r = run("moss-encode", *args, "--prompt", "a red fox", "--out", tmp_path / f"{len(outs)}.enc", "--quiet")
        assert r.code == 0, r.stderr
        outs.append(load(tmp_path / f"{len(outs)}.enc")[0])
    for name in ("prompt_rows", "prompt_ids", "negative_rows"):
        np.testing.assert_array_equal(outs[0][name], outs[1][name])
