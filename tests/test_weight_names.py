"""The weight lists the GPU loads hand to the uploader up front (Qwen35Encoder.weight_names,
MossTransformer.weight_names): each equals, name for name and in order, what a forward on the numpy op table
asks for the first time (a stack as one tuple), on the tiny checkpoint. A weight missing from a list would be
uploaded late, in the middle of the first pass; one too many would sit on the GPU unread."""

import numpy as np

from moss_cli.checkpoint import open_checkpoint
from moss_cli.encoder import Qwen35Encoder
from moss_cli.ops.numpy.table import NumpyOps
from moss_cli.transformer import MossTransformer


class AskedOps(NumpyOps):
    """NumpyOps noting each weight (or stack of weights) the first time a forward asks for it."""

    def __init__(self):
        super().__init__()
        self.asked, self._stacking = [], False

    def param(self, tensors, name):
        if not self._stacking and name not in self.asked:
            self.asked.append(name)
        return super().param(tensors, name)

    def params(self, tensors, names):
        names = tuple(names)
        if names not in self.asked:
            self.asked.append(names)
        self._stacking = True
        try:
            return super().params(tensors, names)
        finally:
            self._stacking = False


def _encoder_asks():
    comp = open_checkpoint().component("text_encoder")
    ops = AskedOps()
    model = Qwen35Encoder(ops, comp.tensors, comp.config)
    model(np.arange(5, dtype=np.int64))
    return ops.asked, model.weight_names()


def _transformer_asks():
    comp = open_checkpoint().component("transformer")
    ops = AskedOps()
    model = MossTransformer(ops, comp.tensors, comp.config)
    text = model.prepare_text(np.ones((6, model.config["text_dim"]), np.float32))
    latents = np.zeros((1, model.config["latent_channels"], 2, 3), np.float32)
    model.velocity(latents, 500.0, text, skip_layers={1})      # the skipped block is asked for first here
    model.velocity(latents, 500.0, text)
    return ops.asked, model.weight_names()


def test_the_encoder_weight_list_is_what_a_forward_asks_for_in_order():
    asked, listed = _encoder_asks()
    assert listed == asked
    assert "embed_tokens.weight" not in listed


def test_the_transformer_weight_list_is_what_the_refiner_and_a_step_ask_for():
    asked, listed = _transformer_asks()
    # the velocity with block 1 skipped asks for that block's weights only in the second velocity: the list
    # keeps block order (what the GPU step asks for first, its conditional pass running every block)
    assert sorted(map(str, listed)) == sorted(map(str, asked))
    assert len(set(listed)) == len(listed)
    runs_all = [n for n in asked if "layers.1." not in str(n)]
    assert [n for n in listed if "layers.1." not in str(n)] == runs_all


def test_a_list_missing_a_stack_or_naming_one_weight_apart_is_caught():
    """Controls: the encoder's list without its last MLP stack, and with that stack as two names."""
    asked, listed = _encoder_asks()
    stack = [n for n in listed if isinstance(n, tuple) and "mlp" in n[0]][-1]
    assert [n for n in listed if n != stack] != asked
    at = listed.index(stack)
    assert listed[:at] + list(stack) + listed[at + 1:] != asked
