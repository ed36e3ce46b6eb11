"""CUDA graph capture over an op table (the pool planned by a first pass: eager, or a capture thrown away), the
graphs a runner keeps, the streamed layers' window and the release of a runner's device memory."""

import collections
import contextlib

from numba import cuda

from cuda_kernels.core import SIMULATED


def attached():
    """A block inside which numba finds its CUDA context attached to this thread: each of its API calls (an array
    made or viewed, a copy, a launch) then takes it from thread-local storage instead of asking the driver for it
    again under numba's lock, which costs tens of microseconds a call over the thousands of calls of a graph's
    passes. numba's own context manager (numba.cuda.cudadrv.devices), where it has one."""
    if SIMULATED:
        return contextlib.nullcontext()
    from numba.cuda.cudadrv import devices
    runtime = getattr(devices, "_runtime", None)
    return runtime.ensure_context() if hasattr(runtime, "ensure_context") else contextlib.nullcontext()


def eager_once(ops, run):
    """run() on `ops` eagerly, for an output used once, so no graph is made of it (a graph's making would run the
    same ops eagerly first). The pool records the pass as a graph's first pass and then lets go of the blocks it
    made, which no graph will be lent."""
    with attached():
        ops.pool.record()
        try:
            return run()
        finally:
            ops.pool.forget()
            if not SIMULATED:
                cuda.current_context().deallocations.clear()


def planned_capture(ops, eager, run):
    """capture(ops, run) after a first pass of the same ops that the pool records (memory.pool): eager(), the
    ops run once on the GPU (compiling the kernels, planning the products), or with `eager` None, run() captured
    into a graph that is thrown away, so that nothing runs on the GPU and the whole of it is host work another
    thread may do while the GPU runs other graphs (no streamed window then). The pool lends the capture's
    requests the blocks it planned for them, keeping those the first pass made that the plan needs as they are
    and letting go of the rest."""
    with attached():
        return _planned_capture(ops, eager, run)


def _planned_capture(ops, eager, run):
    pool, window = ops.pool, ops.window
    if eager is None and window is not None:
        raise ValueError("a streamed window needs an eager first pass")
    pool.record()
    if window is not None:
        window.begin(ops)          # each streamed layer copied when asked; the order kept for the capture
    try:
        if eager is None:
            capture(ops, run, instantiate=False)      # the requests recorded, the graph and its output dropped
        else:
            eager()
            cuda.synchronize()
    finally:
        planned = pool.plan()
        uses = window.finish() if window is not None else None
    cuda.current_context().deallocations.clear()     # the blocks let go, freed now rather than at numba's leisure
    pool.script(planned)
    try:
        return capture(ops, run, uses)
    finally:
        pool.script(None)


def capture(ops, run, uses=None, instantiate=True):
    """(graph, stream, what run() returned): the ops run() launches on `ops`, captured as one CUDA graph
    (cuda.core graph builder) for replay on the returned stream; host uploads it made are in ops.kept. `uses`:
    the streamed layers' order (planned_capture's eager pass), their copies then prefetched inside the graph.
    `instantiate` False: the capture is only a record of the pool's requests; it returns None, and neither the
    graph nor run()'s output outlives it."""
    from cuda.core import Device, StreamOptions

    dev = Device()
    dev.set_current()
    stream = dev.create_stream(options=StreamOptions(nonblocking=True))
    builder = stream.create_graph_builder()
    ops.kept = []
    with cuda.defer_cleanup():
        builder.begin_building("relaxed")
        ops.stream, ops.capturing = builder, True
        try:
            if ops.window is not None:
                ops.window.begin(ops, uses if uses is not None else [])
            out = run()
            if ops.window is not None:
                ops.window.finish()        # every copy on the side branch waited for before the capture ends
        finally:
            ops.stream, ops.capturing = 0, False
            builder.end_building()
    if not instantiate:
        del out
        if hasattr(builder, "close"):
            builder.close()
        ops.kept = []
        return None
    return builder.complete(), stream, out


class Graphs:
    """A runner's captured graphs by key (a picture size, a prompt-length bucket), the `limit` used last kept: a
    server meets many sizes and prompt lengths, and each graph holds memory of its own (its input and output
    buffers, their pinned twins, the driver's copy of its nodes) that no memory plan counts past a few graphs. A
    graph let go is idle: each stage waits for its stream before it returns. Its pool blocks stay in the pool,
    lent again to the next graph's plan."""

    def __init__(self, limit):
        if limit < 1:
            raise ValueError(f"keep at least one graph, not {limit}")
        self.limit = limit
        self.made = 0                    # graphs put so far
        self._kept = collections.OrderedDict()

    def __contains__(self, key):
        return key in self._kept

    def __len__(self):
        return len(self._kept)

    def __getitem__(self, key):
        """The graph of `key` (a script's timing of it; its recency unchanged)."""
        return self._kept[key]

    def keys(self):
        """The keys kept, the least recently used first."""
        return list(self._kept)

    def get(self, key, make):
        """The graph of `key`, now the last used; make() makes it where none is kept (first use, or let go)."""
        if key in self._kept:
            self._kept.move_to_end(key)
            return self._kept[key]
        return self.put(key, make())

    def clear(self):
        """Let go of every graph (a script's variants: the next use captures again)."""
        self._kept.clear()

    def put(self, key, graph):
        """Keep `graph` for `key` as the last used, letting go of the least recently used past the limit."""
        self._kept[key] = graph
        self._kept.move_to_end(key)
        self.made += 1
        while len(self._kept) > self.limit:
            self._kept.popitem(last=False)
        return graph


def make_window(tensors, names, layers):
    from ..memory.window import Window
    return Window(tensors, names, layers)


def release(runner):
    """Let go of a GPU runner's device memory (CudaEncoder, CudaDenoiser): its weights, its graphs and its
    window are freed once nothing refers to them; the pool's blocks stay in the shared pool."""
    runner.__dict__.clear()
    import gc
    gc.collect()
    cuda.synchronize()
    cuda.current_context().deallocations.clear()
