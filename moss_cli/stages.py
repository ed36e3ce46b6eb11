"""The three stages as functions of (model, artifact, options): tokens -> rows -> latents -> pixels, and the
picture's way in (encode_image: pixels -> latents, the start of image-to-image and inpainting).

The commands only read, call and write; `moss-image` calls the same functions on the same bytes, which is
why its PNG equals the chained commands' PNG.
"""

import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from . import artifacts, schedule
from .errors import ArtifactError, CheckpointError, DeviceError, PictureError, UsageError
from .ops import numpy_ops
from .memory.plan import HOST_TENSORS    # read on the host, never uploaded: the plan and the room check agree
from .progress import Silent

# denoiser.md §5: defaults of the official pipeline where the checkpoint does not name its own.
DEFAULT_STEPS = 50
DEFAULT_GUIDANCE = 3.0
DEFAULT_SIZE = 1024
DEFAULT_NEGATIVE = ""
DEFAULT_SKIP_LAYERS = (22,)
DEFAULT_SKIP_START = 0.01   # [M] S1 + SGLang cookbook; S2/S3 start at 0.0
DEFAULT_SKIP_STOP = 1.0
DEFAULT_STRENGTH = 0.6      # FluxImg2ImgPipeline's and FluxInpaintPipeline's default
PATCH = 16                  # image pixels per latent token side
# the seeds torch.Generator.manual_seed takes: a uint64, or an int64 whose bits it reads as one (so -1 is 2**64-1)
SEED_MIN = -2**63
SEED_MAX = 2**64 - 1


@dataclass
class SamplingOptions:
    seed: int
    steps: int = DEFAULT_STEPS
    guidance: float = DEFAULT_GUIDANCE
    width: int = DEFAULT_SIZE
    height: int = DEFAULT_SIZE
    shift: float = schedule.DEFAULT_SHIFT
    uncond_skip_layers: tuple = DEFAULT_SKIP_LAYERS
    skip_start: float = DEFAULT_SKIP_START
    skip_stop: float = DEFAULT_SKIP_STOP
    noise: str = "avx2"

    def check(self):
        for name in ("width", "height"):
            v = getattr(self, name)
            if v <= 0 or v % PATCH:
                raise UsageError(f"--{name} {v}: must be a positive multiple of {PATCH}")
        if self.steps < 1:
            raise UsageError(f"--steps {self.steps}: must be at least 1")
        if not math.isfinite(self.guidance) or self.guidance < 0:
            raise UsageError(f"--guidance {self.guidance}: must be finite and >= 0")
        if not math.isfinite(self.shift) or self.shift <= 0:
            raise UsageError(f"--shift {self.shift}: must be finite and > 0")
        if not SEED_MIN <= self.seed <= SEED_MAX:
            raise UsageError(f"--seed {self.seed}: out of the range torch.Generator.manual_seed takes "
                             "(-2**63 to 2**64-1; a negative seed s stands for 2**64 + s)")
        for name in ("skip_start", "skip_stop"):
            if not math.isfinite(getattr(self, name)):
                raise UsageError(f"--{name.replace('_', '-')}: must be finite")
        if not 0.0 <= self.skip_start <= self.skip_stop <= 1.0:
            raise UsageError(f"--skip-start {self.skip_start} --skip-stop {self.skip_stop}: the skip window is a "
                             "range of step fractions and needs 0 <= start <= stop <= 1")

    @property
    def cfg(self):
        return self.guidance != 1.0   # exact compare, as the official pipeline does

    def metadata(self):
        return {"moss.seed": self.seed, "moss.steps": self.steps, "moss.guidance": repr(float(self.guidance)),
                "moss.shift": repr(float(self.shift)), "moss.width": self.width, "moss.height": self.height,
                "moss.uncond_skip_layers": ",".join(str(i) for i in self.uncond_skip_layers),
                "moss.skip_start": repr(float(self.skip_start)), "moss.skip_stop": repr(float(self.skip_stop)),
                "moss.noise": self.noise}


def steps_run(options):
    """The steps the schedule runs for the options: fewer than asked when snapping to the training grid
    makes neighbouring sigmas equal (schedule.sigmas drops the repeats)."""
    return len(schedule.sigmas(options.steps, shift=options.shift)) - 1


def check_finite(array, what):
    """Refuse a stage's output holding NaN or infinities (weights holding them make such outputs)."""
    if not np.all(np.isfinite(array)):
        raise CheckpointError(f"{what} hold NaN or infinite values: the model's weights may hold them; "
                              "nothing written")
    return array


# --- room: what a size needs of the host's memory --------------------------------------------

def host_memory():
    """Bytes of memory this process may use: the machine's physical memory, or its cgroup's limit if lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def host_need(checkpoint, stage, width, height, device):
    """A lower bound of the host memory STAGE holds at once for a WIDTH x HEIGHT picture on DEVICE: the
    noise draw (a uint64 and a float32 per element); on the CPU also the latents, the velocity, one DiT
    block's activations per token and one block of attention scores and their softmax, or the decoder's first
    full-size maps (the last up block's input, its normed copy, its first conv's output); for "encode-image"
    the picture resized and its latents, on the CPU the VAE encoder's first full-size maps. On the GPU those
    live in its memory, which its memory plan checks."""
    from .ops.numpy.core import ATTENTION_BLOCK
    from .vae import _config
    tc = checkpoint.config("transformer")
    tokens = (height // PATCH) * (width // PATCH)
    channels = int(tc.get("latent_channels", 128))
    if stage == "denoise":
        need = 12 * channels * tokens
        if device == "cpu":
            block = 4 * tokens * (3 * channels + 4 * int(tc["dim"]) + 2 * int(tc["ffn_dim"]))
            scores = 8 * int(tc["num_heads"]) * min(tokens, ATTENTION_BLOCK) * tokens
            need = max(need, block + scores)
        return need
    pixels = width * height
    if stage == "encode-image":
        # the picture resized (RGB bytes) and as float32 [3, H, W], and its latents; on the CPU also the VAE
        # encoder's first full-size maps: conv_in's output beside the picture and a band of its columns (the
        # numpy conv's im2col), then that output and its normed copy
        need = 4 * channels * tokens + 15 * pixels
        if device == "cpu":
            from .ops.numpy.conv import IM2COL_BUDGET
            first = _config(checkpoint.config("vae"))["widths"][0]
            band = max(0, min(27 * pixels, IM2COL_BUDGET - 27 * (width + 3)))
            need = max(need, 12 * pixels + 4 * first * pixels + 4 * band, 4 * pixels * 2 * first)
        return need
    need = 4 * channels * tokens + 3 * pixels
    if device == "cpu":
        widths = _config(checkpoint.config("vae"))["widths"]
        entering = widths[1] if len(widths) > 1 else widths[0]    # what the last upsampler brings to full size
        need = max(need, 4 * pixels * (2 * entering + widths[0]))
    return need


def check_room(checkpoint, stage, width, height, device, memory=None):
    """Refuse, before any work, a picture size whose STAGE needs more host memory than the machine has.
    `memory`: the bytes available (host_memory() by default)."""
    need = host_need(checkpoint, stage, width, height, device)
    have = host_memory() if memory is None else memory
    if need > have:
        doing = {"denoise": "denoising", "decode": "decoding", "encode-image": "encoding the picture"}[stage]
        raise UsageError(f"{width}x{height}: {doing} needs at least {need / 1e9:.1f} GB of memory, and this "
                         f"machine has {have / 1e9:.1f} GB; give a smaller --width/--height")


def sampling_defaults(checkpoint):
    """Defaults from the checkpoint where it has them (shift; the demo's size/steps), else the spec's."""
    out = {"steps": DEFAULT_STEPS, "guidance": DEFAULT_GUIDANCE, "width": DEFAULT_SIZE, "height": DEFAULT_SIZE,
           "shift": float(checkpoint.config("scheduler").get("shift", schedule.DEFAULT_SHIFT))}
    demo = checkpoint.model_index.get("_moss_cli_defaults", {})
    out.update({k: demo[k] for k in ("steps", "guidance", "width", "height") if k in demo})
    return out


def skip_layers(text):
    """The blocks of --uncond-skip-layers: '22', '21,22', or '' for none."""
    text = text.strip()
    if not text:
        return ()
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise UsageError(f"--uncond-skip-layers {text!r}: give block indices like 22 or 21,22, or '' for none") from None


def sampling_options(checkpoint, seed, steps=None, guidance=None, width=None, height=None, shift=None,
                     uncond_skip_layers="22", skip_start=DEFAULT_SKIP_START, skip_stop=DEFAULT_SKIP_STOP,
                     noise="avx2"):
    """The checked options of the commands' flags; None takes the checkpoint's default (sampling_defaults). The
    skip layers are checked against the transformer's blocks here, before any work."""
    from .transformer import check_layers
    d = sampling_defaults(checkpoint)
    opts = SamplingOptions(
        seed=seed, steps=d["steps"] if steps is None else steps,
        guidance=d["guidance"] if guidance is None else guidance,
        width=d["width"] if width is None else width, height=d["height"] if height is None else height,
        shift=d["shift"] if shift is None else shift, uncond_skip_layers=skip_layers(uncond_skip_layers),
        skip_start=skip_start, skip_stop=skip_stop, noise=noise)
    opts.check()
    check_layers(opts.uncond_skip_layers, int(checkpoint.config("transformer")["num_layers"]))
    return opts


def _gpu_memory():
    """(free, total) bytes of the current GPU."""
    from numba import cuda
    return cuda.current_context().get_memory_info()


def _require_gpu_room(comp, matrix_bytes, memory=None):
    """Refuse, before any upload, a component whose weights alone do not fit in the GPU's free memory: on
    the GPU its 2-D matrices take `matrix_bytes` an element (bf16: 2; the decoder keeps float32: 4), every
    other tensor float32; the tensors it reads from the host (HOST_TENSORS) take nothing there, nor do the
    weights already allocated for it at process start (preload_gpu_weights). `memory`: () -> (free, total) bytes
    (numba's by default)."""
    host = HOST_TENSORS.get(comp.name, ())
    need = sum(int(a.size) * (matrix_bytes if a.ndim == 2 else 4) for k, a in comp.tensors.items() if k not in host)
    if need:
        from .memory.preload import handed_bytes
        need = max(0, need - handed_bytes(comp.tensors))
    if not need:
        return
    free, total = (memory or _gpu_memory)()
    if need > free:
        what = {"text_encoder": "text encoder", "vae": "VAE"}.get(comp.name, comp.name)
        raise DeviceError(f"the {what} needs {need / 1e9:.1f} GB of GPU memory for its weights, and "
                          f"{free / 1e9:.1f} of the GPU's {total / 1e9:.1f} GB are free; free some, or run this "
                          "stage with --device cpu")


GPU_COMPONENTS = {"encode": "text_encoder", "denoise": "transformer"}   # stages whose weights preload sends
PLAN_COMPONENTS = {"encode-image": "vae", "encode": "text_encoder", "denoise": "transformer", "decode": "vae"}


def memory_plan(checkpoint, stages, gpu_memory=None, size=(DEFAULT_SIZE, DEFAULT_SIZE), memory=None, held=False):
    """The GPU memory plan (memory.plan) for running `stages` in this process at this picture size, from the
    budget `gpu_memory` (GB, or $MOSS_GPU_MEMORY) within the GPU's free memory. `memory`: () -> (free, total)
    bytes, numba's by default; False with no GPU but a given budget (a plan printed on any machine); `held`: as
    memory.plan.make takes it."""
    from .memory import plan as mp
    weights = {PLAN_COMPONENTS[s]: mp.component_weights(checkpoint.base_component(PLAN_COMPONENTS[s])) for s in stages}
    free = None if memory is False else (memory or _gpu_memory)()[0]
    budget, source = mp.budget_bytes(gpu_memory, free)
    return mp.make(weights, stages, budget, source, size[0], size[1], held=held)


def preload_gpu_weights(checkpoint, device, stages=("encode", "denoise"), planner=None):
    """Start sending the weights of these stages' components to the GPU now, before the kernel library is
    imported (memory.preload: the CUDA driver through ctypes, the upload lanes), and return at once; the
    components made later take them. Nothing happens on the CPU or the simulator, where the GPU extra is
    missing, or where no usable GPU answers (the stages then say why when they resolve their device).
    `planner`: (free, total) memory function -> the memory plan, made once the driver answers: the components
    it does not keep resident from the start (a released or streamed plan sends only the encoder, without its
    streamed layers) are left for later. Returns (bytes handed over, the plan or None)."""
    if device == "cpu" or os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return 0, None
    import importlib.util
    if any(importlib.util.find_spec(m) is None for m in ("numba", "nvmath")):
        return 0, None
    import threading
    from .memory import driver as cuda_driver
    try:
        drv = cuda_driver.Driver(open=False)
    except DeviceError:
        return 0, None
    import time
    from .memory import lanes as cuda_lanes, preload as cuda_preload
    marks = cuda_preload.MARKS
    marks.clear()
    marks["began"] = time.perf_counter()
    failed = []

    def open_and_prepare():           # the GIL released in the driver's calls: numba loads the lane loop meanwhile
        drv.open()
        marks["opened"] = time.perf_counter()
        if drv.compute_capability < (8, 0):
            raise DeviceError("bf16 needs compute capability 8.0 or newer")
        cuda_driver.driver(opened=drv)
        if stages:                                    # weights to send: pinned slots, streams and lane threads
            cuda_lanes.process_lanes().prepare()
        marks["lanes_ready"] = time.perf_counter()

    opening = threading.Thread(target=lambda: _try(open_and_prepare, failed), name="cuda-open")
    opening.start()
    cuda_lanes.warm(drv)
    marks["warmed"] = time.perf_counter()
    opening.join()
    if failed:
        return 0, None
    drv.activate()
    plan = planner(drv.memory_info) if planner is not None else None
    if plan is not None and not plan.resident:
        stages = [s for s in stages if s == "encode"]
    handed = 0
    for stage in stages:
        comp = checkpoint.base_component(GPU_COMPONENTS[stage])      # adapters are merged on the GPU
        if plan is None:
            _require_gpu_room(comp, 2, drv.memory_info)
        handed += cuda_preload.start(comp, streamed=plan.layers(comp.name) if plan else ())
        marks[f"handed_{GPU_COMPONENTS[stage]}"] = time.perf_counter()
    return handed, plan


def _try(call, failed):
    try:
        call()
    except Exception as e:     # no GPU, a driver problem: the stages report it when they resolve their device
        failed.append(e)


class Model:
    """One checkpoint with its graphs built lazily and kept: every component is loaded once."""

    def __init__(self, checkpoint, device="cpu", progress=None, plan=None):
        self.checkpoint = checkpoint
        self.device = device
        self.progress = progress or Silent()
        self.plan = plan          # the GPU memory plan (memory.plan); None: every component resident
        self.ops = numpy_ops(np.float32)
        self._ahead = None        # ((shape, seed, kernel), the future of its noise) from draw_noise_ahead
        self._noise_thread = None

    def noise(self, shape, seed, kernel):
        """noise.randn(shape, seed, kernel): the draw that draw_noise_ahead started when it is this one, else
        drawn now. Either way the same bits: the draw depends on its arguments only."""
        from . import noise
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == (tuple(shape), seed, kernel):
            return ahead[1].result()
        return noise.randn(shape, seed, kernel=kernel)

    def draw_noise_ahead(self, shape, seed, kernel):
        """Start drawing a later picture's noise on a host thread, to overlap the current picture's GPU work
        (the host waits on the GPU then); the next `noise` call with these arguments takes it."""
        from concurrent.futures import ThreadPoolExecutor

        from . import noise
        if self._noise_thread is None:
            self._noise_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="noise")
        key = (tuple(shape), seed, kernel)
        self._ahead = (key, self._noise_thread.submit(noise.randn, key[0], seed, kernel=kernel))

    @property
    def fingerprint(self):
        return self.checkpoint.fingerprint

    def lora_metadata(self):
        """{"moss.lora": the adapters' sha256 and scales} for the artifacts of a merged model, else {}: a base
        model's artifacts stay as they were."""
        if not self.checkpoint.adapters:
            return {}
        from . import lora
        return {"moss.lora": lora.record(self.checkpoint.adapters)}

    @cached_property
    def tokenizer(self):
        return chat_tokenizer(self.checkpoint)

    @cached_property
    def encoder(self):
        from . import encoder
        self.progress.note(f"loading text encoder ({self.device})")
        if self.device == "cuda":
            comp = self.checkpoint.base_component("text_encoder")
            streamed = self._streamed(comp)
            from .gpu.encoder import cuda_encoder
            enc = cuda_encoder(comp, streamed=streamed)
            self._merge(enc, comp, ())
            return enc
        comp = self.checkpoint.component("text_encoder")
        return encoder.Qwen35Encoder(self.ops, comp.tensors, encoder.text_config(comp.config))

    @cached_property
    def transformer(self):
        from .transformer import MossTransformer
        self.progress.note(f"loading transformer ({self.device})")
        if self.device == "cuda":
            comp = self.checkpoint.base_component("transformer")
            streamed = self._streamed(comp)
            from .gpu.denoiser import CudaDenoiser
            dit = CudaDenoiser(comp.tensors, comp.config, streamed=streamed)
            dit.upload()
            self._merge(dit, comp, ())
            return dit
        comp = self.checkpoint.component("transformer")
        return MossTransformer(self.ops, comp.tensors, comp.config)

    def _merge(self, runner, comp, merged):
        """The checkpoint's adapters merged into a GPU runner's weights (gpu/lora_merge.py), after those of MERGED (the
        adapters merged in it now) are put back to the base; nothing when the two sets merge alike."""
        from . import lora
        if lora.merged_set(merged, comp.name) == lora.merged_set(self.checkpoint.adapters, comp.name):
            return
        from .gpu import lora_merge
        count, seconds = lora_merge.apply(runner.ops, comp.tensors, runner.model.weight_names(), comp.name, merged,
                                         self.checkpoint.adapters)
        self.progress.note(f"{comp.name}: LoRA merged into {count} weights on the GPU in {seconds:.2f} s")

    def use(self, checkpoint):
        """Go on with CHECKPOINT, the same folder with another adapter set (Checkpoint.with_adapters): on the GPU the
        loaded encoder and DiT are merged again in place (back to the base, then the new set; the DiT's kept refined
        texts dropped), on the CPU they are made again from the merged weights. Returns the components changed."""
        from . import lora
        old, self.checkpoint = self.checkpoint, checkpoint
        changed = []
        for name, attr in (("text_encoder", "encoder"), ("transformer", "transformer")):
            if lora.merged_set(old.adapters, name) == lora.merged_set(checkpoint.adapters, name):
                continue
            changed.append(name)
            runner = self.__dict__.get(attr)
            if runner is None:
                continue
            if self.device == "cuda":
                try:
                    self._merge(runner, checkpoint.base_component(name), old.adapters)
                except BaseException:            # a weight half merged: the runner is made again when next used
                    from .gpu.capture import release
                    release(self.__dict__.pop(attr))
                    raise
                if attr == "transformer":
                    runner.forget_texts()
            else:
                del self.__dict__[attr]
                self.ops = numpy_ops(np.float32)     # its weight cache is keyed by the tensors mappings' ids
        return changed

    def _streamed(self, comp):
        """The layers of comp the plan streams (no plan: the room checked, everything resident)."""
        if self.plan is None:
            _require_gpu_room(comp, 2)
            return ()
        layers = self.plan.layers(comp.name)
        if layers:
            self.progress.note(f"{comp.name}: {len(layers)} layers streamed from pinned host memory")
        return layers

    def release_encoder(self):
        """Free the GPU encoder's weights, graphs and window (a plan that is not all resident, once every prompt is
        encoded); its pool blocks stay in the shared pool for the DiT and the decoder."""
        encoder = self.__dict__.pop("encoder", None)
        if encoder is None or self.device != "cuda":
            return
        from .gpu.capture import release
        release(encoder)

    @cached_property
    def image_encoder(self):
        """The VAE encoder: image [3, H, W] -> latents [1, 128, H/16, W/16] on the host."""
        from .vae import Encoder, expected_encoder_tensors
        comp = self.checkpoint.component("vae")
        for name, shape in expected_encoder_tensors(comp.config).items():
            if name not in comp.tensors:
                raise CheckpointError(f"{self.checkpoint.root}: vae has no {name}; the picture needs the VAE's "
                                      "encoder (a decoder-only vae folder cannot start from an image)")
            if tuple(comp.tensors[name].shape) != shape:
                raise CheckpointError(f"{self.checkpoint.root}: vae tensor {name} has shape "
                                      f"{list(comp.tensors[name].shape)}, expected {list(shape)}")
        self.progress.note(f"loading VAE encoder ({self.device})")
        if self.device == "cuda":
            _require_gpu_room(comp, 4)
            from .gpu.image_encoder import CudaImageEncoder
            return CudaImageEncoder(comp.tensors, comp.config)
        return Encoder(self.ops, comp.tensors, comp.config)

    @cached_property
    def decoder(self):
        from .vae import Decoder
        comp = self.checkpoint.component("vae")
        self.progress.note(f"loading VAE decoder ({self.device})")
        if self.device == "cuda":
            if self.plan is None:
                _require_gpu_room(comp, 4)
            from .gpu.decoder import CudaDecoder
            return CudaDecoder(comp.tensors, comp.config)
        return Decoder(self.ops, comp.tensors, comp.config)


# --- encode ----------------------------------------------------------------------------------

def chat_tokenizer(checkpoint):
    """The checkpoint's tokenizer with its chat template (tokenizer.ChatTokenizer)."""
    from .tokenizer import ChatTokenizer
    cls = checkpoint.model_index.get("tokenizer", [None, None])[-1]
    return ChatTokenizer.from_folder(checkpoint.root / "tokenizer", tokenizer_class=cls)


def check_text(name, text):
    """TEXT, or one line naming NAME when it holds what is not UTF-8 text: bytes a command line gave that are not
    UTF-8 (Python keeps them as lone surrogates), or a lone surrogate a JSON request escaped; the tokenizer takes
    neither."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        at = len(text[:e.start].encode("utf-8"))
        raise UsageError(f"{name}: not UTF-8 text (byte {at})") from None
    return text


def check_prompts(tokenizer, texts):
    """The token ids of each (role, text) after the chat template; a text over the encoder's limit is refused, where
    the official pipeline cuts it there, losing the template's end (the assistant's turn)."""
    from .tokenizer import MAX_TOKENS
    out = []
    for role, text in texts:
        ids, truncated = tokenizer.encode_prompt(text)
        if truncated:
            raise UsageError(f"{role}: over the encoder's {MAX_TOKENS} tokens after the chat template; shorten it "
                             "(the official pipeline would cut it there, dropping the template's end)")
        out.append(ids)
    return out


def encode(model, prompt, negative=DEFAULT_NEGATIVE, negative_cache=None, once=False):
    """ENC bytes for PROMPT (and NEGATIVE unless it is None). NEGATIVE_CACHE, a dict the caller keeps between
    calls, holds the negative's rows by token ids, so several prompts with one negative encode it once. ONCE: the
    process encodes nothing else, so the GPU encoder makes no graph for these rows (CudaEncoder's `once`)."""
    tensors = {}
    texts = [(role, text) for role, text in (("prompt", prompt), ("negative", negative)) if text is not None]
    token_ids = check_prompts(model.tokenizer, texts)         # both, before the encoder loads
    for (role, text), ids in zip(texts, token_ids):
        encoder = model.encoder
        cache = negative_cache if role == "negative" and negative_cache is not None else {}
        rows = cache.get(tuple(ids))
        if rows is None:
            model.progress.note(f"encoding {role}: {len(ids)} tokens")
            kept = encoder(ids, once=True) if once and model.device == "cuda" else encoder(ids)
            rows = np.array(kept, dtype=np.float32)   # a copy: the cache keeps it
            cache[tuple(ids)] = check_finite(rows, f"the text encoder's rows for the {role}")
        tensors[f"{role}_rows"] = rows
        tensors[f"{role}_ids"] = np.asarray(ids, dtype=np.int32)
    meta = {"moss.prompt": prompt, "moss.device": model.device}
    if negative is not None:
        meta["moss.negative"] = negative
    meta.update(model.lora_metadata())
    return artifacts.build("encode", tensors, meta, model.fingerprint)


# --- encode-image ----------------------------------------------------------------------------

def encode_image(model, picture, width=None, height=None):
    """IMAGE bytes for a picture.Picture: resized to WIDTH x HEIGHT (default: its size floored to multiples of
    16), encoded to the packed, BN-normalised latents the transformer works in."""
    from .picture import RESAMPLE
    w, h = picture.target(width, height)
    x = picture.rgb(w, h)
    model.progress.note(f"encoding picture {picture.size[0]}x{picture.size[1]} at {w}x{h}")
    latents = np.asarray(model.image_encoder(x), dtype=np.float32)
    meta = {"moss.picture_sha256": picture.sha256, "moss.width": w, "moss.height": h,
            "moss.picture_width": picture.size[0], "moss.picture_height": picture.size[1],
            "moss.resample": RESAMPLE, "moss.device": model.device}
    return artifacts.build("encode-image", {"latents": latents}, meta, model.fingerprint)


@dataclass
class Init:
    """Where an image-to-image or inpainting run starts: an IMAGE artifact, the strength, and the mask [H, W]
    of 0/1 at the encoded size (1 = repaint) or None."""
    image: object
    strength: float = DEFAULT_STRENGTH
    mask: object = None
    mask_sha256: str = ""

    @property
    def literal(self):
        """Text-to-image exactly: strength 1 keeps none of the image, and without a mask nothing is put back."""
        return literal(self.strength, self.mask)


def literal(strength, mask):
    """Whether a start from a picture at STRENGTH with MASK (or None) is text-to-image exactly: nothing of the
    picture kept, nothing put back (the picture then need not be encoded)."""
    return strength == 1.0 and mask is None


START_HINT = "give --init IMAGE.lat (moss-image: --init-image)"     # the server names its own field instead


def check_start(init, strength, mask):
    """--strength and --mask only with a picture to start from; the strength in (0, 1] (default DEFAULT_STRENGTH)."""
    if init is None and mask is not None:
        raise UsageError(f"--mask needs a picture to keep: {START_HINT}")
    if init is None and strength is not None:
        raise UsageError(f"--strength needs a picture to start from: {START_HINT}")
    strength = DEFAULT_STRENGTH if strength is None else strength
    if not (math.isfinite(strength) and 0 < strength <= 1):
        raise UsageError(f"--strength {strength:g}: must be in (0, 1]")
    return strength


def start_from(image, strength, mask_picture=None):
    """The Init of an IMAGE artifact, a strength (schedule.cut checks it) and an optional mask picture of the
    source picture's size."""
    x = image.tensors.get("latents")
    if x is None or x.dtype != np.float32 or x.ndim != 4 or x.shape[0] != 1:
        raise ArtifactError(f"{image.source}: latents are missing or not float32[1, C, h, w]")
    if mask_picture is None:
        return Init(image, strength)
    size = tuple(int(image.meta(f"moss.picture_{k}")) for k in ("width", "height"))
    if mask_picture.size != size:
        raise PictureError(f"{mask_picture.source}: the mask is {mask_picture.size[0]}x{mask_picture.size[1]}, the "
                           f"picture {size[0]}x{size[1]}; give a mask of the picture's size")
    w, h = int(image.meta("moss.width")), int(image.meta("moss.height"))
    return Init(image, strength, mask_picture.mask(w, h), mask_picture.sha256)


# --- denoise ---------------------------------------------------------------------------------

def _rows(enc, role, text_dim):
    rows = enc.tensors.get(f"{role}_rows")
    if rows is None:
        return None
    if rows.ndim != 2 or rows.shape[1] != text_dim or rows.shape[0] < 1 or rows.dtype != np.float32:
        raise ArtifactError(f"{enc.source}: {role}_rows is {rows.dtype}{list(rows.shape)}, "
                            f"expected float32[L, {text_dim}]")
    return rows


def noise_shape(model, options):
    """[1, C, h, w] of the packed latents (and of the noise) for the options' picture size."""
    channels = int(model.checkpoint.config("transformer").get("latent_channels", 128))
    return (1, channels, options.height // PATCH, options.width // PATCH)


def decoder_beside(model, options):
    """The function that makes the GPU decoder's graph for this picture's latents beside the DiT's steps
    (CudaDenoiser.sample's `beside`, CudaDecoder.graph_maker), or None: not on the GPU, a memory plan that keeps
    some weights off it (the decoder's own then come after the DiT's), or the graph already made."""
    if model.device != "cuda" or (model.plan is not None and not model.plan.resident):
        return None
    return model.decoder.graph_maker(noise_shape(model, options))


def denoise(model, enc, options, trace=False, next_seed=None, init=None, beside=None, once=False):
    """LAT bytes (and TRACE bytes when TRACE) for an ENC artifact and sampling options. NEXT_SEED: the seed
    of the picture made after this one, with the same options: its noise is drawn on a host thread while
    this picture denoises (Model.draw_noise_ahead). INIT: an Init to start from an image (FluxImg2ImgPipeline:
    the schedule cut by the strength, the start latents the image's noised to its first sigma) and, with its
    mask, to inpaint (FluxInpaintPipeline); a literal one (strength 1, no mask) runs text-to-image as is.
    BESIDE: host work done while the GPU's steps replay (decoder_beside; on the GPU only). ONCE: the process
    samples nothing else (CudaDenoiser.sample's `once`: no graph for a step kind only the first step has)."""
    from . import sampler

    options.check()
    text_dim = int(model.checkpoint.config("transformer").get("text_dim", 4096))
    cond_rows = _rows(enc, "prompt", text_dim)
    if cond_rows is None:
        raise ArtifactError(f"{enc.source}: has no prompt_rows")
    uncond_rows = _rows(enc, "negative", text_dim) if options.cfg else None
    if options.cfg and uncond_rows is None:
        raise UsageError(f"guidance {options.guidance} needs negative rows, but {enc.source} was encoded with "
                         "--no-negative; encode again with a negative prompt or use --guidance 1")
    shape = noise_shape(model, options)
    if init is not None and init.literal:
        init = None
    image = mask = None
    if init is not None:
        image = init.image.tensors["latents"]
        if image.shape != shape:
            raise UsageError(f"{init.image.source}: its latents are {list(image.shape)}, the run's {list(shape)} "
                             f"({options.width}x{options.height}); encode the picture at that size")
        if init.mask is not None:
            from .picture import latent_mask
            mask = latent_mask(init.mask, shape[1])
    noise = model.noise(shape, options.seed, options.noise)
    if next_seed is not None:
        model.draw_noise_ahead(shape, next_seed, options.noise)
    sig = schedule.sigmas(options.steps, shift=options.shift)
    x0 = noise
    if init is not None:
        sig = schedule.cut(sig, init.strength)
        x0 = schedule.scale_noise(image, sig[0], noise)
    dit = model.transformer
    cond = dit.prepare_text(cond_rows)
    uncond = dit.prepare_text(uncond_rows) if options.cfg else None
    record = {"noise": noise, "sigmas": sig} if trace else None
    if record is not None and init is not None:
        record["init"] = image
        if mask is not None:
            record["mask"] = mask
    n = len(sig) - 1

    def on_step(i, sigma, latents_in, velocity):
        model.progress.step(i, n, float(sig[i]), float(sig[i + 1]))
        if record is not None:
            record[f"latents.{i:03d}"] = np.array(latents_in, dtype=np.float32)
            record[f"velocity.{i:03d}"] = np.array(velocity, dtype=np.float32)

    keep = None if mask is None else (image, mask, noise)
    if model.device == "cuda":     # the trajectory on the GPU, one graph per step (gpu.denoiser)
        latents = dit.sample(x0, sig, cond, uncond, options.guidance, options.uncond_skip_layers,
                             options.skip_start, options.skip_stop, on_step=on_step, arrays=trace, keep=keep,
                             beside=beside, once=once)
    else:
        latents = sampler.sample(dit, x0, sig, cond, uncond, options.guidance,
                                 uncond_skip_layers=options.uncond_skip_layers,
                                 skip_start=options.skip_start, skip_stop=options.skip_stop, on_step=on_step,
                                 keep=keep)
    check_finite(latents, "the denoised latents")
    meta = dict(options.metadata())
    if n != options.steps:      # recorded only then, so a LAT whose steps all ran keeps its bytes
        meta["moss.steps_run"] = n
    meta.update({"moss.enc_sha256": enc.sha256, "moss.prompt": enc.metadata.get("moss.prompt", ""),
                 "moss.negative": enc.metadata.get("moss.negative", "") if options.cfg else "",
                 "moss.device": model.device})
    meta.update(model.lora_metadata())
    if init is not None:
        meta.update({"moss.strength": repr(float(init.strength)), "moss.init_sha256": init.image.sha256,
                     "moss.picture_sha256": init.image.metadata.get("moss.picture_sha256", "")})
        if mask is not None:
            meta["moss.mask_sha256"] = init.mask_sha256
    lat = artifacts.build("denoise", {"latents": np.asarray(latents, dtype=np.float32)}, meta, model.fingerprint)
    traced = artifacts.build("trace", record, meta, model.fingerprint) if trace else None
    return lat, traced


# --- decode ----------------------------------------------------------------------------------

PNG_KEYS = ("prompt", "negative", "seed", "steps", "guidance", "shift", "width", "height",
            "uncond_skip_layers", "skip_start", "skip_stop", "noise", "model")
START_KEYS = ("strength", "picture_sha256", "mask_sha256")
PNG_NUMBERS = {"seed": int, "steps": int, "width": int, "height": int,
               "guidance": float, "shift": float, "skip_start": float, "skip_stop": float}


def png_parameters(lat):
    """The PNG's parameters from a LAT's metadata: numbers as JSON numbers, strings as strings; null for a
    number the LAT does not carry (a foreign LAT), and `input: foreign` when any input had no moss metadata."""
    params = {}
    for key in PNG_KEYS:
        value = lat.metadata.get(f"moss.{key}")
        if key in PNG_NUMBERS:
            try:
                value = PNG_NUMBERS[key](value)
            except (TypeError, ValueError):
                value = None
            if value is not None and not math.isfinite(value):
                value = None
        params[key] = "" if value is None and key not in PNG_NUMBERS else value
    steps_run = lat.metadata.get("moss.steps_run", "")
    if steps_run.isdigit():
        params["steps_run"] = int(steps_run)
    params["moss_cli"] = lat.metadata.get("moss.version", "")
    if "moss.lora" in lat.metadata:        # only then: a base model's PNG keeps its bytes
        try:
            params["lora"] = json.loads(lat.metadata["moss.lora"])
        except json.JSONDecodeError:
            params["lora"] = lat.metadata["moss.lora"]
    for key in START_KEYS:          # only a run that started from a picture has them
        if f"moss.{key}" in lat.metadata:
            value = lat.metadata[f"moss.{key}"]
            params[key] = float(value) if key == "strength" else value
    if lat.foreign or lat.metadata.get("moss.input") == "foreign":
        params["input"] = "foreign"
    return params


def decode(model, lat, once=False):
    """PNG bytes for a LAT artifact; `once`: this process decodes nothing else (decode_pixels)."""
    from .png import encode_png
    return encode_png(*decode_pixels(model, lat, once))


def decode_pixels(model, lat, once=False):
    """(pixels uint8 [H, W, 3], the PNG's text) for a LAT artifact: what `decode` writes as PNG. `once`: the
    process's only decode, which the GPU decoder runs eagerly rather than capturing a graph for it first."""
    from .vae import to_pixels

    x = lat.tensors.get("latents")
    vae_cfg = model.checkpoint.config("vae")
    channels = int(vae_cfg.get("latent_channels", 32)) * 4
    if x is None:
        raise ArtifactError(f"{lat.source}: has no latents tensor")
    if x.dtype != np.float32 or x.ndim != 4 or x.shape[0] != 1 or x.shape[1] != channels or min(x.shape) < 1:
        raise ArtifactError(f"{lat.source}: latents are {x.dtype}{list(x.shape)}, expected float32[1, {channels}, h, w]")
    if not np.all(np.isfinite(x)):
        raise ArtifactError(f"{lat.source}: latents hold NaN or infinite values")
    decoder = model.decoder
    model.progress.note(f"decoding {x.shape[3] * PATCH}x{x.shape[2] * PATCH}")
    # the GPU decoder rounds to uint8 on the device (gpu.decoder); the CPU's pixels are vae.to_pixels
    if model.device == "cuda":
        pixels = decoder.decode(x, once=once)
    else:
        pixels = to_pixels(check_finite(decoder(x), "the decoded pixels"))
    params = png_parameters(lat)
    return pixels, {"parameters": json.dumps(params, ensure_ascii=True, sort_keys=True)}
