"""The DiT's sampling loop on the GPU: the latents stay on the device for the whole trajectory, and each
denoising step (time embedding and modulation, the conditional pass, the unconditional pass with or
without its skipped blocks, the CFG combination and the Euler update) is one CUDA graph, captured once per
(size, text lengths, pass kind) and replayed every step with no host synchronisation inside it.

A step reads its scalars (the time sinusoid, dt, the guidance) from a small device buffer that one
device-to-device copy refreshes before each replay, from a table of every step's values made up front.
It reads the refined texts from fixed buffers, one per (pass, length), into which each trajectory copies its
prompt's tokens first: a new prompt of a length seen before replays the graphs already captured. The refined
texts of the last few distinct prompts are kept, so a later picture of the same prompt (and every negative
prompt after the first) skips the refiner.
"""

import collections
import time

import numpy as np
from numba import cuda

from cuda_kernels import dit

from ..sampler import skipped
from ..schedule import keep_region, timesteps
from ..transformer import MossTransformer, RefinedTexts, Text, check_layers, time_sinusoid
from ..ops.cuda.table import CudaOps, numba_stream
from .capture import attached, eager_once, make_window, planned_capture


def _owned(text):
    """text with its tokens copied out of the pool into memory of their own (queued after the refiner)."""
    tokens = cuda.device_array(text.tokens.shape, text.tokens.dtype)
    tokens.copy_to_device(text.tokens)
    return Text(tokens, text.length)


class CudaDenoiser:
    """MossTransformer on the CUDA op table with a graph-per-step sampler (`sample`).

    A step graph is captured per (size, text lengths, pass kind); the KEEP_GRAPHS used last are kept (a server sees
    prompts of many lengths), and with the graphs that go, the text slots and size buffers no kept graph reads."""

    KEEP_GRAPHS = 8

    def __init__(self, tensors, config, streamed=()):
        self.ops = CudaOps()
        self.model = MossTransformer(self.ops, tensors, config)
        if streamed:        # the memory plan's streamed blocks: read from pinned host memory (memory.window)
            self.ops.window = make_window(tensors, self.model.weight_names(), streamed)
        self.num_layers = self.model.num_layers
        self.config = self.model.config
        self._graphs = collections.OrderedDict()      # key -> (graph, its kept uploads, what it reads)
        self._stream = None
        self._fixed = {}
        self._slots = {}
        self.timings = {}
        self.texts = RefinedTexts(self.model.prepare_text, own=_owned)

    def upload(self):
        """Every weight handed to the uploader (bf16 matrices as bf16), in the order the refiner and a step
        read them; returns at once. The first refiner and the first step's eager pass take each weight as its
        copies are queued, and compile (or load) the kernels meanwhile."""
        self.ops.preload(self.model.tensors, self.model.weight_names())

    def prepare_text(self, rows):
        """The text refiner on one prompt's rows (eager), once per distinct rows (RefinedTexts)."""
        with attached():
            return self.texts(rows)

    def forget_texts(self):
        """Drop the kept refined texts (the refiner's weights changed: moss-server's adapter switch)."""
        self.texts = RefinedTexts(self.model.prepare_text, own=_owned)

    # --- the step graph --------------------------------------------------------------------
    def _step(self, size, x, step, cond, uncond, skip, cfg, velocity):
        """The ops of one step on latents x [C, h w] (device, updated in place) of size (h, w); `step` the
        device scalars."""
        ops, model = self.ops, self.model
        freq, ch = self.config["freq_dim"], self.config["latent_channels"]
        h, w = size
        n = h * w
        mod, head = model.conditioning(step[:freq].reshape(1, freq))
        tokens = ops.new((n, ch), np.uint16)
        dit.patchify(x, tokens, stream=ops.stream)
        cos, sin = model.rope(h, w, cond.length)
        c = model.tokens_velocity(tokens, n, mod, head, cos, sin, cond)
        u = c
        if cfg:
            cos, sin = model.rope(h, w, uncond.length)
            u = model.tokens_velocity(tokens, n, mod, head, cos, sin, uncond, skip)
        dit.cfg_euler(x, c, u, velocity, step[freq:], cfg=cfg, stream=ops.stream)

    def _graph(self, key, size, x, step, cond, uncond, skip, cfg, velocity, reads):
        """The step graph of `key`, captured on first use; `reads`: the keys of the text slots and size buffers it
        reads (kept while it is)."""
        if key in self._graphs:
            self._graphs.move_to_end(key)
            return self._graphs[key][0]
        scratch = cuda.device_array_like(x)
        scratch.copy_to_device(x)
        graph, stream, _ = planned_capture(        # the eager step compiles, plans the products and the blocks
            self.ops, lambda: self._step(size, scratch, step, cond, uncond, skip, cfg, velocity),
            lambda: self._step(size, x, step, cond, uncond, skip, cfg, velocity))
        if self._stream is None:
            self._stream = stream        # every graph replays on this one stream, in step order
        self._graphs[key] = (graph, self.ops.kept, frozenset(reads))
        self._evict()
        return graph

    def _evict(self):
        """Drop the graphs used least recently past KEEP_GRAPHS, then the slots and buffers no kept graph reads (a
        trajectory's graphs are the last used: every earlier trajectory has finished, its stream synchronized)."""
        if len(self._graphs) <= self.KEEP_GRAPHS:
            return
        while len(self._graphs) > self.KEEP_GRAPHS:
            self._graphs.popitem(last=False)
        read = set().union(*(r for _, _, r in self._graphs.values()))
        for store in (self._slots, self._fixed):
            for key in [k for k in store if k not in read]:
                del store[key]

    @staticmethod
    def _slot_key(role, text):
        return (role, tuple(text.tokens.shape), np.dtype(text.tokens.dtype).str)

    def _slot(self, role, text):
        """The fixed buffer the graphs read the `role` pass's text of this length from, holding `text`."""
        key = self._slot_key(role, text)
        shape, dtype = key[1], np.dtype(text.tokens.dtype)
        if key not in self._slots:
            self._slots[key] = Text(cuda.device_array(shape, dtype), text.length)
        slot = self._slots[key]
        slot.tokens.copy_to_device(text.tokens)
        return slot

    def _buffers(self, ch, h, w):
        """The latents, the step's scalars and the velocity: fixed per size, as the graphs read them."""
        key = (ch, h, w)
        if key not in self._fixed:
            freq = self.config["freq_dim"]
            self._fixed[key] = (cuda.device_array((ch, h * w), np.float32), cuda.device_array(freq + 2, np.float32),
                                cuda.device_array((ch, h * w), np.float32))
        return self._fixed[key]

    def sample(self, noise, sigmas, cond, uncond, guidance, skip_layers=(), skip_start=0.0, skip_stop=1.0,
               on_step=None, arrays=False, keep=None, beside=None, once=False):
        """Denoise noise [1, C, h, w] along sigmas [N+1] as sampler.sample does; returns float32 latents.

        `beside`: a function a host thread runs while the steps replay, started once every step graph of the
        trajectory is captured and waited for before this returns (its exception raised here): host work that
        runs nothing on the GPU and takes pool blocks only for graphs (the decoder's, CudaDecoder.graph_maker).
        `once`: this process samples nothing else, so a first step whose pass kind no other step has (the full
        negative pass before the skip window) runs eagerly on the latents, with no graph made for it (a graph's
        making runs the same ops eagerly first); `beside` then starts after it.

        on_step(i, sigma, latents_in, velocity) after each step's graph has run: with `arrays` the two are
        host copies (a trace), else None (progress only). `keep`: inpainting's (image latents, latent mask,
        noise), put back after each step on the host by the CPU's own schedule.keep_region (the latents go
        out and back between two graphs: a few MB a step)."""
        sigmas = np.asarray(sigmas, dtype=np.float32)
        steps = len(sigmas) - 1
        cfg = float(guidance) != 1.0
        skip = check_layers(skip_layers, self.num_layers)
        _, ch, h, w = noise.shape
        freq = self.config["freq_dim"]
        table = np.zeros((steps, freq + 2), np.float32)
        for i, t in enumerate(timesteps(sigmas)):
            table[i, :freq] = time_sinusoid(float(t), freq)[0]
            table[i, freq] = np.float32(sigmas[i + 1]) - np.float32(sigmas[i])
            table[i, freq + 1] = np.float32(guidance)
        table_d = cuda.to_device(table)
        x, step, velocity = self._buffers(ch, h, w)
        step.copy_to_device(table_d[0])
        x.copy_to_device(np.ascontiguousarray(noise, np.float32).reshape(ch, h * w))
        reads = {(ch, h, w), self._slot_key("cond", cond)} | ({self._slot_key("uncond", uncond)} if cfg else set())
        cond = self._slot("cond", cond)
        uncond = self._slot("uncond", uncond) if cfg else cond
        cuda.synchronize()        # the tokens are in place before any replay reads them
        lengths = (cond.length, uncond.length if cfg else 0)
        # each step's pass kind: the blocks its negative pass skips (none outside the window, or without CFG)
        kinds = [skipped(i, steps, skip if cfg else (), skip_start, skip_stop) for i in range(steps)]
        eager_first = once and steps > 0 and kinds.count(kinds[0]) == 1 and self.ops.window is None
        graphs = {}
        for kind in kinds[1:] if eager_first else kinds:
            if kind not in graphs:
                key = (ch, h, w, lengths, cfg, kind)
                graphs[kind] = self._graph(key, (h, w), x, step, cond, uncond, kind, cfg, velocity, reads)
        began = time.perf_counter()
        start, stop = cuda.event(), cuda.event()
        stream = self._stream
        queue = numba_stream(stream) if stream is not None else cuda.default_stream()
        ends = [cuda.event() for _ in range(steps)]       # each step's end: its time in `timings`, and progress
        helper, launch_s = None, 0.0
        try:
            for i in range(steps):
                latents_in = x.copy_to_host(stream=queue).reshape(1, ch, h, w) if arrays else None
                if i == 0 and eager_first:       # on the default stream, waited for: the replays are not behind it
                    start.record(cuda.default_stream())
                    eager_once(self.ops, lambda: self._step((h, w), x, step, cond, uncond, kinds[0], cfg, velocity))
                    cuda.synchronize()
                    ends[0].record(queue)
                else:
                    if i == 0 or (i == 1 and eager_first):
                        helper = _Beside(beside) if beside is not None else None
                    step.copy_to_device(table_d[i], stream=queue)
                    if i == 0:
                        start.record(queue)
                    first = time.perf_counter()
                    graphs[kinds[i]].launch(stream)
                    ends[i].record(queue)
                    if i == int(eager_first):
                        launch_s = time.perf_counter() - first
                if keep is not None:
                    stepped = x.copy_to_host(stream=queue)
                    queue.synchronize()
                    kept = keep_region(stepped.reshape(1, ch, h, w), *keep, sigmas[i + 1], last=i == steps - 1)
                    x.copy_to_device(np.ascontiguousarray(kept.reshape(ch, h * w)), stream=queue)
                if on_step is None:
                    continue
                if arrays:           # a trace: this step's velocity, copied out before the next step overwrites it
                    v = velocity.copy_to_host(stream=queue).reshape(1, ch, h, w)
                    queue.synchronize()
                    on_step(i, sigmas[i], latents_in, v)
                    continue
                # progress only: report step i - 1 once it is done, with step i already queued behind it, so
                # the GPU never waits for the host between steps
                if i > 0:
                    ends[i - 1].synchronize()
                    on_step(i - 1, sigmas[i - 1], None, None)
            stop.record(queue)
            queued = time.perf_counter()
            out = x.copy_to_host(stream=queue).reshape(1, ch, h, w)
            queue.synchronize()
        except Exception:
            # its pool takes end before anything else of this process takes more (an interrupt ends the process:
            # it does not wait for the thread)
            if helper is not None:
                helper.thread.join()
            raise
        if on_step is not None and not arrays and steps:
            on_step(steps - 1, sigmas[steps - 1], None, None)
        beside_s = helper.wait() if helper is not None else None
        # launch_s: the host's cost of one step (its graph launch on an idle queue); later launches wait for
        # room in the launch queue while the GPU works, so the loop's time (queue_s) follows the GPU's
        marks = [start] + ends
        self.timings = {"steps": steps, "gpu_s": cuda.event_elapsed_time(start, stop) / 1e3, "launch_s": launch_s,
                        "queue_s": queued - began, "wall_s": time.perf_counter() - began,
                        "step_ms": [cuda.event_elapsed_time(a, b) for a, b in zip(marks, marks[1:])]}
        if beside_s is not None:
            self.timings["beside_s"], self.timings["beside_wait_s"] = beside_s
        return out


class _Beside:
    """A function run on a host thread of its own from now on (CudaDenoiser.sample's `beside`)."""

    def __init__(self, fn):
        import threading
        self.error, self.seconds = None, 0.0
        self.thread = threading.Thread(target=self._run, args=(fn,), name="beside-steps", daemon=True)
        self.thread.start()

    def _run(self, fn):
        began = time.perf_counter()
        try:
            fn()
        except BaseException as e:       # raised again in the sampling thread (wait)
            self.error = e
        self.seconds = time.perf_counter() - began

    def wait(self):
        """(its seconds, the seconds waited for it now); its exception raised."""
        began = time.perf_counter()
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.seconds, time.perf_counter() - began
