"""The graphs a runner keeps (gpu.capture.Graphs): the `limit` used last, by key; past it the least recently used
goes, and a key used again after that is captured again. The text encoder's buckets, the decoder's and the VAE
encoder's sizes keep theirs so, checked in the numba CUDA simulator with the capture replaced by a counter (a
graph captured again gives the same bytes: tests/gpu/test_cuda_encoder_tiny.py, test_decoder_gpu.py)."""

import pytest

from sim_util import simulated_lines


def test_the_last_used_are_kept_and_a_key_used_again_stays():
    from moss_cli.gpu.capture import Graphs
    made = []
    graphs = Graphs(2)

    def use(key):
        return graphs.get(key, lambda: made.append(key) or f"graph {key}")
    assert use("a") == "graph a" and use("b") == "graph b"
    assert use("a") == "graph a" and made == ["a", "b"]         # replayed, not made again
    use("c")                                                   # b, used least recently, goes; a stays
    assert graphs.keys() == ["a", "c"] and "b" not in graphs and len(graphs) == 2
    use("b")
    assert made == ["a", "b", "c", "b"] and graphs.keys() == ["c", "b"] and graphs.made == 4
    graphs.put("d", "graph d")
    assert graphs.keys() == ["b", "d"] and graphs["d"] == "graph d"
    graphs.clear()
    assert len(graphs) == 0
    with pytest.raises(ValueError):
        Graphs(0)


SCRIPT = r'''
import numpy as np
from moss_cli.checkpoint import open_checkpoint
from moss_cli.gpu import decoder, encoder
from numba import cuda

captured = []
cuda.event_elapsed_time = lambda a, b: 0.0     # not in the simulator

class FakeGraph:
    def launch(self, stream):
        pass

def fake_capture(ops, eager, run):
    return FakeGraph(), 0, run()            # the capture's ops: the stub model's
encoder.planned_capture = fake_capture

checkpoint = open_checkpoint()
comp = checkpoint.component("text_encoder")
enc = encoder.CudaEncoder(comp.tensors, comp.config)
hidden = enc.config["hidden_size"]
enc.model = lambda ids: captured.append(len(ids)) or cuda.device_array((len(ids), hidden), np.float32)
enc._captured.limit = 2
for n in (3, 7, 3, 11, 7):          # buckets 4, 8, 4 (replayed), 12 (8 goes), 8 (captured again: 4 goes)
    enc(np.zeros(n, np.int64))
print("encoder", *captured, "kept", *enc._captured.keys())

sizes = []

class FakeSized:
    def __init__(self, shape):
        self.shape = shape
    def replay(self, lat):
        return np.zeros((16 * lat.shape[1], 16 * lat.shape[2], 3), np.uint8)

def fake_sized(ops, run, shape, dry=False):
    sizes.append((shape[1], shape[2], dry))
    return FakeSized(shape)
decoder.capture_sized = fake_sized
vae = checkpoint.component("vae")
dec = decoder.CudaDecoder(vae.tensors, vae.config, split_ahead=False)
dec.graphs = True                   # the simulator's decoder runs eagerly: here its graphs are the fakes
dec._captured.limit = 2
for h in (2, 3, 2):
    dec.decode(np.zeros((1, 128, h, h), np.float32))
dec.graph_maker((1, 128, 4, 4))()   # made beside the steps: 3 goes
dec.decode(np.zeros((1, 128, 4, 4), np.float32))
dec.decode(np.zeros((1, 128, 3, 3), np.float32))
print("decoder", *[f"{h}x{w}{'d' if dry else ''}" for h, w, dry in sizes], "kept",
      *[f"{h}x{w}" for h, w in dec._captured.keys()])
'''


def test_encoder_buckets_and_decoder_sizes_past_the_limit_are_captured_again():
    lines = simulated_lines(SCRIPT)
    assert lines == ["encoder 4 8 12 8 kept 12 8",
                     "decoder 2x2 3x3 4x4d 3x3 kept 4x4 3x3"], lines
