"""The VAE decoder on the GPU: packed latents [1, 128, h, w] -> uint8 pixels [16h, 16w, 3], float32-accurate.

vae.Decoder's graph on the CUDA table, whose products here are split fp16 products (ops.cuda.conv): the decoder's
attention projections and attention too, not the table's bf16 ones. The latents' copy in, the BN
de-normalisation and unpatchify, the decoder and the pixels' rounding are one CUDA graph per latent size.
DecoderOps and Captured serve the VAE's encoder too (gpu/image_encoder.py).
"""

import os
import time

import numpy as np
from numba import cuda

from cuda_kernels.core import SIMULATED, from_bf16_bits

from ..vae import Decoder, _config
from ..ops.cuda.conv import split_weight_bits
from ..ops.cuda.table import CudaOps, _is_bf16, numba_stream
from .capture import Graphs, attached, eager_once, planned_capture


def _float32(tensors, name):
    value = np.asarray(tensors[name])
    wide = from_bf16_bits(value.view(np.uint16)) if _is_bf16(value.dtype) else value
    return np.ascontiguousarray(wide, dtype=np.float32)


def weight_form(name, shape):
    """How the products read the VAE weight `name` of this shape (ops.cuda.conv.split_weight_bits): the
    downsamplers' 3x3 as their phase form, other k x k convs as taps, linears and 1x1 convs as a matrix."""
    if len(shape) == 4 and shape[2] > 1:
        return "down" if ".downsamplers." in name else "taps"
    return "matrix"


class DecoderOps(CudaOps):
    """The CUDA table with every matrix float32 on the device and linear / attention as split products. The
    products' split weights (conv.tap_weights, conv.weight_matrix) are made on the host from the checkpoint's
    tensors, on host threads from `split_ahead` on, not from the device weights copied back. `prefixes`:
    the tensors the graph reads (the decoder's; the VAE encoder's ops name theirs)."""

    prefixes = ("decoder.", "post_quant_conv.")

    def __init__(self):
        super().__init__()
        self._sources = {}     # id(device weight) -> (the tensors it came from, its name)
        self._ahead = {}       # (id(tensors), tensor name, form) -> the Future of its split (split_ahead)
        self.late_splits = 0   # splits made when asked for, none ahead
        self.split_wait_s = 0.0   # seconds the decodes waited for splits still being made ahead

    def param(self, tensors, name):
        key = (id(tensors), name)
        out = self._params.get(key)
        if out is None:
            out = self._params[key] = cuda.to_device(_float32(tensors, name))
            self._sources[id(out)] = (tensors, name)
        return out

    SPLIT_THREADS = 4

    def split_ahead(self, tensors):
        """Split every conv and projection weight the graph reads (4-D and 2-D under `prefixes`, as weight_form
        says) on SPLIT_THREADS host threads, taken in the tensors' order, so the first run finds them made (its
        eager pass waits only for one not yet done). numpy lets go of the GIL inside each step of a split: at
        the real decoder's widths two threads took 0.19 s where one took 0.33-0.46 s (a 2-core CPU); moss-decode
        waits for them."""
        from concurrent.futures import ThreadPoolExecutor
        shapes = {n: np.shape(tensors[n]) for n in tensors if n.startswith(self.prefixes) and n.endswith(".weight")}
        worker = ThreadPoolExecutor(max_workers=max(1, min(self.SPLIT_THREADS, os.cpu_count() or 1)),
                                    thread_name_prefix="vae-split")
        for name, shape in shapes.items():
            if len(shape) in (2, 4):
                form = weight_form(name, shape)
                self._ahead[(id(tensors), name, form)] = worker.submit(
                    lambda n=name, f=form: split_weight_bits(_float32(tensors, n), f))
        worker.shutdown(wait=False)        # the thread ends once the queue is done

    def _host_split_weight(self, w, form):
        tensors, name = self._sources.get(id(w), (None, None))
        if tensors is None:
            return super()._host_split_weight(w, form)
        made = self._ahead.pop((id(tensors), name, form), None)
        if made is not None:
            start = time.perf_counter()
            out = made.result()
            self.split_wait_s += time.perf_counter() - start
            return out
        self.late_splits += 1
        return split_weight_bits(_float32(tensors, name), form)

    def linear(self, x, w, b=None, residual=None, narrow=False):
        if residual is not None:
            raise ValueError("the decoder's linear takes no residual")
        return self.split_linear(x, w, b)

    def attention(self, q, k, v, scale, causal=False):
        if causal or q.shape[1] != 1:
            raise ValueError("the decoder's attention is one bidirectional head")
        return self.split_attention(q, k, v, scale)


class CudaDecoder:
    """CudaDecoder(tensors, config).decode(latents float32 [1, 128, h, w]) -> uint8 [16h, 16w, 3], equal to
    vae.to_pixels(Decoder(numpy_ops(), tensors, config)(latents)) but for pixels off by one at rounding
    boundaries. Weights go to the device once; `graphs=False` runs the ops eagerly (the simulator's way). The
    products' split weights are made on host threads from here on (DecoderOps.split_ahead; `split_ahead=False`:
    each when the first decode asks for it). The graphs of the KEEP_GRAPHS sizes decoded last are kept."""

    KEEP_GRAPHS = 4

    def __init__(self, tensors, config, graphs=True, split_ahead=True):
        self.ops = DecoderOps()
        self.decoder = Decoder(self.ops, tensors, config)
        self.c = _config(config)
        self.graphs = graphs and not SIMULATED
        self._captured = Graphs(self.KEEP_GRAPHS)
        self.made_beside = 0      # graphs made by graph_maker's function beside the DiT's steps (the GPU tests read it)
        self.beside_error = None  # why the last of those failed (the decode then makes its graph itself)
        if split_ahead:
            self.ops.split_ahead(tensors)

    def graph_maker(self, shape):
        """A function that makes the graph for latents of `shape` [1, 128, h, w] with nothing run on the GPU (a
        capture thrown away plans the pool's blocks, then the capture: gpu.capture.planned_capture), for a host
        thread to call while the DiT's step graphs replay; None where there is nothing to make (no graphs, or
        this size's is made). Only while no other op of this process takes pool blocks (the DiT's loop replays
        graphs and takes none); the blocks it is lent may be the DiT's, written only when the decode replays."""
        size = tuple(int(n) for n in shape[2:])
        if not self.graphs or size in self._captured:
            return None
        lat_shape = (int(shape[1]),) + size

        def make():
            if size in self._captured:
                return
            try:
                self._captured.put(size, capture_sized(self.ops, self._run, lat_shape, dry=True))
                self.made_beside += 1
            except Exception as e:      # not the picture's failure: decode() makes the graph its own way
                self.beside_error = e
        return make

    def _run(self, latents):
        """The ops of one decode from device latents [128, h, w]; returns the device pixels."""
        ops, d = self.ops, self.decoder
        z = ops.unpack_latents(latents, d.bn_std, d.bn_mean)
        return ops.to_pixels(d.decode_image(z))

    def _check(self, latents):
        latents = np.asarray(latents, dtype=np.float32)
        pi, pj = self.c["patch"]
        packed = self.c["latent"] * pi * pj
        if latents.ndim != 4 or latents.shape[0] != 1 or latents.shape[1] != packed or (pi, pj) != (2, 2):
            from ..errors import ArtifactError
            raise ArtifactError(f"latents have shape {list(latents.shape)}, the VAE expects [1, {packed}, h, w]")
        return latents[0]

    def decode(self, latents, once=False):
        """Pixels of latents [1, 128, h, w]: a replay of this size's graph, made on first use. `once`: the only
        decode of this process (moss-decode), run eagerly where no graph of its size exists, since the graph's
        making runs the same ops eagerly first (equal bytes: tests/gpu/test_decoder_gpu.py)."""
        lat = self._check(latents)
        size = lat.shape[1:]
        eager = lambda: self.ops.host(self._run(cuda.to_device(np.ascontiguousarray(lat))))    # noqa: E731
        if not self.graphs:
            with attached():
                return eager()
        if once and size not in self._captured:
            return eager_once(self.ops, eager)
        return self._captured.get(size, lambda: capture_sized(self.ops, self._run, lat.shape)).replay(lat)


def capture_sized(ops, run, shape, dry=False):
    """The Captured graph of run(device input) -> device output for a float32 input of this shape: an eager pass
    first (compiles the kernels, splits the weights, plans the products and the pool's blocks), then the
    capture, whose first node copies the pinned input in. `dry`: a capture thrown away instead of the eager
    pass, nothing run on the GPU (CudaDecoder.graph_maker)."""
    device = cuda.device_array(shape, np.float32)
    if not dry:       # the eager pass reads it (zeros: no NaN through it); a dry pass reads nothing
        device.copy_to_device(np.zeros(shape, np.float32))
    host = cuda.pinned_array(shape, np.float32)

    def replayed():
        device.copy_to_device(host, stream=numba_stream(ops.stream))
        return run(device)

    graph, stream, out = planned_capture(ops, None if dry else (lambda: run(device)), replayed)
    return Captured(graph, stream, device, host, out)


class Captured:
    """One input size's graph, its stream, the input it reads (pinned host, device) and the output it writes
    (the decoder's pixels, the encoder's latents), with a pinned host twin of that output."""

    def __init__(self, graph, stream, device_in, host_in, out):
        self.graph, self.stream = graph, stream
        self.device_in, self.host_in, self.out = device_in, host_in, out
        self.queue = numba_stream(stream)
        self.host_out = cuda.pinned_array(out.shape, out.dtype)

    def replay(self, host):
        """The output of one replay reading `host` (a copy of the pinned twin)."""
        self.host_in[:] = host
        self.graph.launch(self.stream)
        self.out.copy_to_host(self.host_out, stream=self.queue)
        self.queue.synchronize()
        return self.host_out.copy()
