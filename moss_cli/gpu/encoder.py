"""The text encoder on the GPU: the Qwen3.5 graph on the CUDA op table, captured once per prompt-length bucket."""

import time

import numpy as np
from numba import cuda

from ..encoder import Qwen35Encoder, check_ids, text_config
from ..ops.cuda.table import CudaOps, numba_stream, table_rows
from .capture import Graphs, attached, eager_once, make_window, planned_capture

# Prompt lengths are padded up to a bucket (right padding leaves causal rows unchanged): a multiple of
# 4 tokens up to 256 (short prompts are bound by their weights' bytes, and every padded token costs the
# token-serial delta rule its time), of 64 up to 2048, of 256 up to MAX_TOKENS. One graph per bucket.
MAX_TOKENS = 32768


def bucket(length):
    if length > MAX_TOKENS:
        raise ValueError(f"{length} tokens: more than the GPU encoder takes ({MAX_TOKENS})")
    step = 4 if length <= 256 else 64 if length <= 2048 else 256
    return -(-length // step) * step


class CudaEncoder:
    """ids -> float32 rows [L, hidden] on the GPU: the Qwen3.5 graph captured once per length bucket.

    Weights go to the device once (`upload`), straight from the (memory-mapped) tensors, one at a time, but
    the token embedding table, which stays on the host: each encode gathers its prompt's rows there.
    `graphs=False` runs the ops eagerly (one launch per op), for per-layer checks. The graphs of the KEEP_GRAPHS
    buckets used last are kept (a server meets many prompt lengths; each graph keeps its rows' buffers).
    """

    KEEP_GRAPHS = 16

    def __init__(self, tensors, config, graphs=True, pad_id=0):
        self.ops = CudaOps()
        self.config = text_config(config)
        self.model = Qwen35Encoder(self.ops, tensors, config)
        self.tensors = tensors
        self.graphs = graphs
        self.pad_id = pad_id
        self._captured = Graphs(self.KEEP_GRAPHS)
        self.timings = {}

    def upload(self):
        """Every weight the graph reads handed to the uploader (stacked where it reads them together), in the
        order a forward reads them; returns at once. The first bucket's eager pass takes each weight as its
        copies are queued, and compiles (or loads) the kernels meanwhile."""
        self.ops.preload(self.tensors, self.model.weight_names())

    def host_rows(self, n):
        """A pinned host array for n rows (float32 [n, hidden]): as `out`, the rows' copy is one DMA at the
        bus's speed, queued behind the graph (a pageable array goes through the driver's staging copy)."""
        return cuda.pinned_array((n, self.config["hidden_size"]), np.float32)

    def __call__(self, ids, on_layer=None, out=None, once=False):
        """Rows [n, hidden] float32 for the n ids; into `out` when given (a float32 array of that shape,
        best one from `host_rows`, which the caller keeps). The copy of the prompt's rows is queued on the
        graph's stream; `timings` splits the GPU's time (CUDA events) from the copy's and the host's wall
        time (at 1000 tokens the copy into a pageable array takes several times the pinned array's DMA,
        measured on the H200). `once`: these are the only rows of their bucket this process encodes (moss-encode,
        a moss-image of one prompt): where the bucket has no graph yet they are computed eagerly at the bucket's
        length, the pass a graph's making runs first (equal bytes: tests/gpu/test_cuda_encoder_tiny.py)."""
        ids = check_ids(ids, self.config["vocab_size"]).astype(np.int64)
        if not self.graphs or on_layer is not None:
            with attached():
                return self.model(ids, on_layer=on_layer)
        n = ids.size
        shape = (n, self.config["hidden_size"])
        if out is None:
            out = np.empty(shape, np.float32)
        elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous float32 {shape}, not {out.dtype} {out.shape}")
        size = bucket(n)
        if once and size not in self._captured and self.ops.window is None:
            padded = np.concatenate([ids, np.full(size - n, self.pad_id, np.int64)])
            out[:] = eager_once(self.ops, lambda: self.model(padded))[:n]
            self.timings = {"bucket": size, "eager": True}
            return out
        c = self._captured.get(size, lambda: self._capture(size))
        start = time.perf_counter()
        table = self.tensors["embed_tokens.weight"]      # the prompt's rows: the graph's first node copies them
        table_rows(table, ids, out=c.rows[:n])
        c.rows[n:] = table_rows(table, [self.pad_id])
        uploaded = time.perf_counter()
        c.began.record(c.queue)
        c.graph.launch(c.stream)
        c.ran.record(c.queue)
        c.rows_buffer[:n].copy_to_host(out, stream=c.queue)
        c.copied.record(c.queue)
        launched = time.perf_counter()
        c.copied.synchronize()
        done = time.perf_counter()
        # host: the calls' own time (rows_s: the prompt's table rows into the graph's pinned array; queue_s:
        # graph launch, output rows' copy and events queued; wait_s: until the copy's event); gpu_s, copy_s:
        # CUDA events
        self.timings = {"host_s": launched - start, "total_s": done - start, "bucket": size,
                        "rows_s": uploaded - start, "queue_s": launched - uploaded, "wait_s": done - launched,
                        "gpu_s": cuda.event_elapsed_time(c.began, c.ran) / 1e3,
                        "copy_s": cuda.event_elapsed_time(c.ran, c.copied) / 1e3}
        return out

    def _capture(self, size):
        dummy = np.zeros(size, dtype=np.int64)
        rows = cuda.pinned_array((size, self.config["hidden_size"]), np.uint16)

        def run():
            self.ops.rows_host = rows          # the prompt's rows' upload becomes the graph's first node
            return self.model(dummy)
        try:
            graph, stream, out = planned_capture(self.ops, lambda: self.model(dummy), run)
        finally:
            self.ops.rows_host = None
        return _Bucket(graph, stream, out, rows, self.ops.kept)


class _Bucket:
    """A captured length bucket: its graph and stream, the rows buffer it writes, the pinned bf16 table rows
    [bucket, hidden] its first node reads, the host uploads its capture made (which it reads), and what each
    encode reuses: the stream as numba sees it, three events (an upload through numba cost host time before the
    graph could start)."""

    def __init__(self, graph, stream, rows_buffer, rows, kept=()):
        self.graph, self.stream, self.rows_buffer, self.rows = graph, stream, rows_buffer, rows
        self.kept = list(kept)
        self.queue = numba_stream(stream)
        self.began, self.ran, self.copied = cuda.event(), cuda.event(), cuda.event()


def cuda_encoder(component, graphs=True, streamed=()):
    """The GPU encoder for a text-encoder component (weights uploaded now); `streamed`: the layers the memory plan
    keeps on the host (memory.window)."""
    enc = CudaEncoder(component.tensors, component.config, graphs=graphs)
    if streamed:
        enc.ops.window = make_window(component.tensors, enc.model.weight_names(), streamed)
    enc.upload()
    return enc
