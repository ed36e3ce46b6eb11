"""The DiT's step graphs kept by last use (moss_cli/gpu/denoiser.py), in the numba CUDA simulator with the capture
replaced by a counter: past KEEP_GRAPHS the graph used least recently goes, and with it the text slots and size
buffers that no kept graph reads, while a graph used again is replayed, not captured. The captured step's bytes
after an eviction are checked on a GPU (tests/gpu/test_denoiser_tiny.py)."""

from sim_util import simulated_lines

SCRIPT = r'''
import numpy as np
from moss_cli.checkpoint import open_checkpoint
from moss_cli.gpu import denoiser
from moss_cli.transformer import Text

captured = []
def fake_capture(ops, eager, run):
    captured.append(1)
    return object(), "stream", None
denoiser.planned_capture = fake_capture

comp = open_checkpoint().component("transformer")
dit = denoiser.CudaDenoiser(comp.tensors, comp.config)
dit.KEEP_GRAPHS = 3

def use(h, w, cond_len, uncond_len, kind):
    cond = Text(np.zeros((cond_len, 8), np.uint16), cond_len)
    uncond = Text(np.zeros((uncond_len, 8), np.uint16), uncond_len)
    reads = {(128, h, w), dit._slot_key("cond", cond), dit._slot_key("uncond", uncond)}
    x, step, velocity = dit._buffers(128, h, w)
    c, u = dit._slot("cond", cond), dit._slot("uncond", uncond)
    key = (128, h, w, (cond_len, uncond_len), True, kind)
    return dit._graph(key, (h, w), x, step, c, u, kind, True, velocity, reads)

a = use(4, 4, 7, 5, ())
b = use(4, 4, 7, 5, (22,))
assert use(4, 4, 7, 5, ()) is a and len(captured) == 2            # replayed, not captured again
use(6, 8, 9, 5, ())                                                 # three graphs: nothing goes yet
print("kept", len(dit._graphs), "captured", len(captured), "slots", len(dit._slots), "sizes", len(dit._fixed))
use(6, 8, 9, 5, (22,))                                              # four: the least recently used, b, goes
print("kept", len(dit._graphs), "captured", len(captured), "slots", len(dit._slots), "sizes", len(dit._fixed))
assert (128, 4, 4, (7, 5), True, (22,)) not in dit._graphs and (128, 4, 4, (7, 5), True, ()) in dit._graphs
use(8, 8, 11, 3, ())
use(8, 8, 11, 3, (22,))                                             # the 4x4 and 7-token graphs all gone now
print("kept", len(dit._graphs), "captured", len(captured), "slots", sorted(k[1][0] for k in dit._slots),
      "sizes", sorted(k[1:] for k in dit._fixed))
assert use(4, 4, 7, 5, ()) is not a and len(captured) == 7          # gone, so captured again
'''


def test_graphs_past_the_limit_go_by_last_use_with_what_only_they_read():
    lines = simulated_lines(SCRIPT)
    # slots by (role, length): cond 7 and 9 share the negative's 5; the 5-token slot stays while the 6x8 graph reads it
    assert lines == ["kept 3 captured 3 slots 3 sizes 2",
                     "kept 3 captured 4 slots 3 sizes 2",
                     "kept 3 captured 6 slots [3, 5, 9, 11] sizes [(6, 8), (8, 8)]"], lines
