"""The resident pipeline behind moss-server: one checkpoint loaded once, requests made in arrival order.

A worker thread owns the models (on the GPU every stage runs on that one thread): it loads the components,
warms the default size, then takes requests from a bounded queue, one picture at a time. Each picture goes
through batch.encoded and batch.made, the path moss-image takes, so a request's PNG equals moss-image's for
the same options. A request withdrawn before its turn (its client went away) is dropped without compute.

LoRA: the adapters named at start are read once; a request picks any of them with scales (none: the set given at
start). When its set differs from the one merged, the models go on with it before its pictures (stages.Model.use:
on the GPU the touched weights are put back to the base and merged again in place, on the CPU merged again on the
host), so its PNG equals moss-image's with the same --lora options in the same order.
"""

import collections
import dataclasses
import functools
import json
import math
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from .. import artifacts, batch, lora, picture, stages
from ..device import resolve
from ..errors import MossError, UsageError
from ..memory.plan import size_text
from ..png import encode_png
from ..progress import Silent

MAX_PICTURES = 8            # per request, as OpenAI's n
MAX_PROMPT = 16384          # characters of a prompt or negative (over 4096 tokens is refused: stages.check_prompts)
MAX_SIDE = 4096             # pixels a side, and ...
MAX_STEPS = 1000            # ... steps: one request cannot hold the worker for hours
KEEP_PROMPTS = 8            # prompt encodings and negative rows kept for later requests
WARM_STEPS = 2              # the warm-up picture's steps: one without and one with the skip window


class Busy(MossError):
    """The queue is full; RETRY_AFTER is a guess in whole seconds of when a place frees up."""

    def __init__(self, message, retry_after):
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(MossError):
    """The engine takes no work: its model failed to load, or it is shutting down."""


@dataclass(frozen=True)
class Picture:
    seed: int
    png: bytes
    parameters: dict        # the PNG's parameters text, as JSON
    seconds: float = 0.0    # its making in the engine: denoise, decode and PNG (and the prompt's encode when new)


@dataclass(eq=False)
class Request:
    """COUNT pictures of PROMPT, the i-th with seed options.seed + i; `future` gets the list of Pictures."""

    prompt: str
    negative: str
    options: stages.SamplingOptions
    count: int = 1
    adapters: tuple = None      # the lora.Adapters to merge, in order (None: those given at start)
    start: tuple = None         # a picture to start from: (picture.Picture, strength, mask Picture or None)
    future: Future = dataclasses.field(default_factory=Future)
    withdrawn: bool = False     # set when the client left while the request was being made: no more pictures


class Recent(collections.OrderedDict):
    """A dict that keeps the KEEP entries most recently set or read, so a long-running server's caches stay
    bounded; stages.encode takes it as its negative cache."""

    def __init__(self, keep):
        super().__init__()
        self.keep = keep

    def get(self, key, default=None):
        if key in self:
            self.move_to_end(key)
            return self[key]
        return default

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.keep:
            self.popitem(last=False)


class Engine:
    """The models of CHECKPOINT on DEVICE behind a queue of at most MAX_QUEUE waiting requests.

    GPU_MEMORY: the GB the GPU memory plan may use (None: what is free); the plan is made for the default size
    and every component stays loaded (held). WARM: make one small picture at the default size before `ready`, so
    the first request does not pay for compiling and capturing the graphs."""

    def __init__(self, checkpoint, device="auto", gpu_memory=None, max_queue=16, progress=None, warm=True,
                 adapters=None):
        self.checkpoint = checkpoint
        self.at_start = checkpoint      # its adapters serve a request that names none
        self.adapters = dict(adapters or {})    # name -> lora.Adapter (at the scale given at start) a request may pick
        self.switch_s = None            # the last adapter switch's time
        self.devices = {stage: resolve(device, stage) for stage in batch.STAGES}   # a DeviceError now, not later
        self.device = device
        self.gpu_memory = gpu_memory
        self.max_queue = max_queue
        self.progress = progress or Silent()
        self.warm = warm
        self.defaults = stages.sampling_defaults(checkpoint)
        self.state = "loading"          # then warming, ready; failed when the load failed
        self.error = None
        self.made = 0                   # pictures made for requests (the warm-up not counted)
        self.dropped = 0                # requests withdrawn before their turn, never computed
        self.seconds = None             # the last picture's time, for Retry-After
        self.plan = None                # the GPU memory plan once loaded (None on the CPU)
        self._queue = collections.deque()
        self._running = None
        self._closed = False
        self._lock = threading.Condition()
        self._tokenizing = threading.Lock()     # the requests' own tokenizer, made on first use
        self._prompts = Recent(KEEP_PROMPTS)
        self._negatives = Recent(KEEP_PROMPTS)
        self.loaded = threading.Event()      # set once the load (and warm-up) succeeded or failed
        self._thread = threading.Thread(target=self._work, name="moss-engine", daemon=True)

    @property
    def fingerprint(self):
        return self.checkpoint.fingerprint

    @functools.cached_property
    def _tokenizer(self):
        return stages.chat_tokenizer(self.checkpoint)

    def start(self):
        self._thread.start()
        return self

    def options(self, seed, **given):
        """Checked SamplingOptions: the given stages.sampling_options arguments, the checkpoint's defaults for
        the rest (the defaults moss-image takes)."""
        return stages.sampling_options(self.checkpoint, seed, **given)

    def request(self, prompt, negative=stages.DEFAULT_NEGATIVE, seed=None, count=1, lora=None, init_image=None,
                strength=None, mask=None, transparent=False, **given):
        """A checked Request of COUNT pictures (seeds seed .. seed + count - 1; a seed drawn when None), the
        adapters `lora` picks (see `choose`), a picture to start from (INIT_IMAGE, MASK: a PNG, JPEG or WebP file's
        bytes; STRENGTH, as moss-image --init-image takes them; TRANSPARENT: a mask with alpha repaints where it is
        transparent, as OpenAI's edits take it), the other options as `options` takes them."""
        adapters = self.choose(lora)
        start = self._start(init_image, strength, mask, given, transparent)
        for name, text in (("prompt", prompt), ("negative", negative)):
            if len(text) > MAX_PROMPT:
                raise UsageError(f"{name}: {len(text)} characters, more than the {MAX_PROMPT} a request may hold")
            stages.check_text(name, text)
        with self._tokenizing:              # the engine's thread encodes with the model's tokenizer meanwhile
            stages.check_prompts(self._tokenizer, [("prompt", prompt), ("negative", negative)])
        if not 1 <= count <= MAX_PICTURES:
            raise UsageError(f"n {count}: give 1 to {MAX_PICTURES} pictures")
        if seed is None:
            seed = secrets.randbelow(2**32)
        options = self.options(seed, **given)
        try:
            self.options(seed + count - 1, **given)      # the last picture's seed is in range too
        except UsageError:
            raise UsageError(f"--seed {seed}: with n {count} the last picture's seed, {seed + count - 1}, is out of "
                             "the range torch.Generator.manual_seed takes (-2**63 to 2**64-1)") from None
        for name, value, most in (("width", options.width, MAX_SIDE), ("height", options.height, MAX_SIDE),
                                  ("steps", options.steps, MAX_STEPS)):
            if value > most:
                raise UsageError(f"--{name} {value}: the server takes at most {most}")
        self.check_size(options.width, options.height)
        return Request(prompt, negative, options, count, adapters=adapters, start=start)

    @staticmethod
    def _start(init_image, strength, mask, given, transparent=False):
        """(Picture, strength, mask Picture) of a request that starts from a picture, else None; the picture's size
        (floored to multiples of 16) goes into GIVEN's width and height where they are not given."""
        strength = stages.check_start(init_image, strength, mask)
        if init_image is None:
            return None
        source = picture.from_bytes(init_image, "init_image")
        shape = None if mask is None else picture.from_bytes(mask, "mask")
        if shape is not None and transparent:
            shape = shape.transparent_repaints()
        if shape is not None and shape.size != source.size:
            raise UsageError(f"--mask: the mask is {shape.size[0]}x{shape.size[1]}, the picture "
                             f"{source.size[0]}x{source.size[1]}; give a mask of the picture's size")
        given["width"], given["height"] = source.target(given.get("width"), given.get("height"))
        return source, strength, shape

    def check_size(self, width, height):
        """Refuse a picture size whose pool would not fit the GPU memory plan beside the weights it holds (the plan
        was made for the default size; the weights stay where it put them)."""
        plan = self.plan
        need = None if plan is None else plan.need_at(width, height)
        if need is None or need <= plan.budget:
            return
        raise UsageError(f"--width {width}: {width}x{height} needs {size_text(need)} of GPU memory beside this "
                         f"server's weights, past its budget of {size_text(plan.budget)} (planned for "
                         f"{plan.size[0]}x{plan.size[1]}); ask for a smaller size, or start the server with more "
                         "--gpu-memory")

    def choose(self, choices):
        """The adapters of CHOICES, [(name, scale or None)], in its order and at its scales (None: the scale given at
        start); None picks those given at start (returns None), [] the base model."""
        if choices is None:
            return None
        chosen = []
        for name, scale in choices:
            adapter = self.adapters.get(name)
            if adapter is None:
                have = ", ".join(self.adapters) or "none"
                raise UsageError(f"lora: no adapter named {name!r} (this server has {have})")
            if scale is not None:
                if not math.isfinite(scale):
                    raise UsageError(f"lora: the scale of {name!r} must be a finite number")
                adapter = dataclasses.replace(adapter, scale=float(scale))
            chosen.append(adapter)
        return tuple(chosen)

    @property
    def depth(self):
        """Requests waiting (the one being made not counted)."""
        with self._lock:
            return len(self._queue)

    @property
    def running(self):
        """The request being made, or None."""
        return self._running

    def submit(self, request):
        """Queue REQUEST (Busy when the queue is full, Unavailable when the engine takes no work); its
        future is done when its pictures are."""
        with self._lock:
            if self._closed or self.state == "failed":
                raise Unavailable(self._why())
            if len(self._queue) >= self.max_queue:
                raise Busy(f"the queue is full ({self.max_queue} waiting); try again later",
                           self._retry_after())
            self._queue.append(request)
            self._lock.notify()
        return request

    def withdraw(self, request):
        """The client of REQUEST left: drop it if it still waits, else make no more of its pictures."""
        with self._lock:
            if request in self._queue:
                self._queue.remove(request)
                self.dropped += 1
                request.future.cancel()
            else:
                request.withdrawn = True

    def close(self):
        """Take no more work and fail every waiting request; the picture being made is finished."""
        with self._lock:
            self._closed = True
            waiting, self._queue = list(self._queue), collections.deque()
            self._lock.notify_all()
        for request in waiting:
            request.future.set_exception(Unavailable("the server is shutting down"))

    def join(self, timeout=None):
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _why(self):
        if self.state == "failed":
            return f"the model failed to load: {self.error}"
        return "the server is shutting down"

    def _retry_after(self):
        waiting = sum(r.count for r in self._queue) + (self._running.count if self._running else 0)
        return max(1, math.ceil((self.seconds or 1.0) * waiting))

    def _work(self):
        try:
            self._load()
        except Exception as e:        # served as 503 with its message; /health says failed
            with self._lock:
                self.state, self.error = "failed", e
                waiting, self._queue = list(self._queue), collections.deque()
            for request in waiting:
                request.future.set_exception(Unavailable(self._why()))
            return
        finally:
            self.loaded.set()
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                request = self._running = self._queue.popleft()
                request.future.set_running_or_notify_cancel()
            try:
                pictures, error = self._make(request), None
            except Exception as e:             # fails this request only; the engine goes on
                pictures, error = None, e
            with self._lock:
                self._running = None           # before the answer: a client that has it finds the engine idle
            if error is None:
                request.future.set_result(pictures)
            else:
                request.future.set_exception(error)

    def _load(self):
        defaults = stages.sampling_defaults(self.checkpoint)     # the plan is made for the default size
        self.model_for, chosen = batch.open_models(self.checkpoint, self.device, self.progress, self.gpu_memory,
                                                   (defaults["width"], defaults["height"]), held=True)
        if "cuda" in chosen.values():
            self.plan = self.model_for(next(s for s, d in chosen.items() if d == "cuda")).plan
        for stage, part in batch.COMPONENTS.items():
            getattr(self.model_for(stage), part)
        if self.warm:
            self.state = "warming"
            opts = self.options(0, steps=WARM_STEPS)
            list(self._pictures("", stages.DEFAULT_NEGATIVE, opts, 1))
        self.state = "ready"
        self.progress.note("ready")

    def _make(self, request):
        self.check_size(request.options.width, request.options.height)     # a request queued while loading
        self._use(self.at_start if request.adapters is None else self.at_start.with_adapters(request.adapters))
        init = self._init(request)
        made = []
        for each in self._pictures(request.prompt, request.negative, request.options, request.count, init):
            made.append(each)
            self.made += 1
            if request.withdrawn:
                break
        return made

    def _init(self, request):
        """The stages.Init of a request's picture to start from, encoded as moss-image --init-image encodes it (the
        VAE encoder on the encoder stage's device); None for text-to-image, a strength of 1 without a mask too."""
        if request.start is None:
            return None
        source, strength, shape = request.start
        if stages.literal(strength, shape):
            self.progress.note("strength 1 without a mask keeps nothing of the picture: this is text-to-image")
            return None
        options = request.options
        encoded = stages.encode_image(self.model_for("encode-image"), source, options.width, options.height)
        image = artifacts.parse(encoded, "picture encoding", "encode-image", self.fingerprint)
        return stages.start_from(image, strength, shape)

    def _use(self, checkpoint):
        """Go on with CHECKPOINT's adapter set (Model.use on every model), its switch time noted."""
        if lora.merged_set(checkpoint.adapters) == lora.merged_set(self.checkpoint.adapters):
            return
        began = time.perf_counter()
        models = {id(m): m for m in (self.model_for(stage) for stage in batch.STAGES)}.values()
        changed = set()
        for model in models:
            changed.update(model.use(checkpoint))
        self.checkpoint = checkpoint
        if "text_encoder" in changed:
            self._negatives.clear()          # negative rows by token ids: another encoder's
        self.switch_s = time.perf_counter() - began
        names = {id(a.layers): n for n, a in self.adapters.items()}
        now = ", ".join(f"{names.get(id(a.layers), a.path.name)} {a.scale:g}" for a in checkpoint.adapters) or "none"
        self.progress.note(f"LoRA {now}: {' and '.join(sorted(changed)) or 'no weight'} changed in "
                           f"{self.switch_s:.2f} s")

    def _next_seed(self, options):
        """The first seed of the next waiting request when its noise has the shape and kernel of OPTIONS': that
        noise is then drawn on a host thread while this picture denoises (Model.draw_noise_ahead)."""
        with self._lock:
            waiting = self._queue[0].options if self._queue else None
        if waiting and (waiting.width, waiting.height, waiting.noise) == (options.width, options.height, options.noise):
            return waiting.seed
        return None

    def _pictures(self, prompt, negative, options, count, init=None):
        """The COUNT pictures of a prompt, seeds options.seed + i, one at a time (a generator); INIT: a
        stages.Init to start from."""
        key = (self.fingerprint, prompt, negative if options.cfg else None)
        found = self._prompts.get(key)
        if found is None:
            found = self._prompts[key] = batch.encoded(self.model_for, prompt, negative, options, self.fingerprint,
                                                       self._negatives)
        enc = found[1]
        seeds = [options.seed + i for i in range(count)]
        for i, seed in enumerate(seeds):
            began = time.perf_counter()
            self.progress.start_clock()
            _, pixels, text = batch.made(self.model_for, enc, dataclasses.replace(options, seed=seed), self.fingerprint,
                                         next_seed=seeds[i + 1] if i + 1 < count else self._next_seed(options),
                                         init=init)
            png = encode_png(pixels, text)
            self.seconds = time.perf_counter() - began
            yield Picture(seed, png, json.loads(text["parameters"]), self.seconds)
