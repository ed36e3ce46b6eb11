"""The GPU memory plan: which weights stay on the device, which stream from pinned host memory, made before
any upload from the memory a budget allows (`--gpu-memory GB`, `$MOSS_GPU_MEMORY`, else the GPU's free memory).

In order of preference:
* every component resident at once (the encoder, the DiT and the decoder);
* the encoder resident while it encodes, then released before the DiT's weights go up;
* then, layer by layer, the largest components' layers streamed: their matrices copied from pinned host memory
  into two device slots just before each layer runs (memory.window), the encoder's first (it runs once a prompt),
  then the DiT's blocks, spread evenly over the depth so the copies overlap the resident blocks' work;
* else refused before any work, with the smallest budget that would do.

Every plan runs the same kernels in the same order on the same bytes, so every plan gives the same outputs.
The sizes are worked out from the checkpoint's tensor shapes (bf16 matrices, float32 vectors), the pool's
working memory from the picture size and text length (calibrated on scripts/pool_plan.py's op sequence), and a
fixed reserve for the libraries' workspaces and the graphs. Pure Python: nothing here touches the GPU.
"""

import math
import os
import re
from dataclasses import dataclass, field

from ..errors import UsageError

GB = 1e9
# cuBLASLt's and cuDNN's workspaces, the step graphs' own memory, the kernels' modules: what the device holds
# beside the weights and the pool (27.8 GB in use against 26.6 GB of weights and pool, all resident at 1024)
RESERVE = 1.3 * GB
RESERVE_ENV = "MOSS_PLAN_RESERVE_GB"      # another reserve, in GB (a GPU whose libraries need more or less)
# the pool's working memory (memory.pool) at its peak, in bytes per token and per output feature of a layer's
# products (the DiT, the encoder), or per pixel and per channel of the widest convolution (the decoder):
# scripts/pool_plan.py at the real configs gives the DiT's step 0.49 GB at 4120 tokens (31744 features), the
# decoder 2.10 GB at 1024x1024 (384 channels), the encoder 3.9 MB at 24 tokens; with headroom
POOL_PER_FEATURE = 4.4
POOL_PER_CHANNEL_PIXEL = 5.7
SLOTS = 2                   # device slots a streamed component's layers rotate through
HOST_TENSORS = {"text_encoder": ("embed_tokens.weight",)}    # read on the host, never uploaded
ENV = "MOSS_GPU_MEMORY"
_LAYER = re.compile(r"layers\.(\d+)\.")
_COMPONENTS = {"encode-image": "vae", "encode": "text_encoder", "denoise": "transformer", "decode": "vae"}
ORDER = tuple(_COMPONENTS)       # the order a process runs them in: a picture to start from is encoded first


def stored_bytes(array, matrix_bytes=2):
    """Device bytes of a checkpoint tensor as the op tables keep it: 2-D matrices `matrix_bytes` an element,
    everything else float32."""
    return int(math.prod(array.shape)) * (matrix_bytes if len(array.shape) == 2 else 4)


def layer_of(name):
    """The layer index of a weight named layers.N.... (None for any other weight)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def streamed_name(name, tensors, layers):
    """Whether weight `name` (or a stack, a tuple of names) is a matrix of one of the streamed `layers`."""
    first = name[0] if isinstance(name, tuple) else name
    return layer_of(first) in layers and len(tensors[first].shape) == 2


@dataclass
class Weights:
    """A component's device bytes: all of them, and the streamable part of each layer (its 2-D matrices)."""
    total: int
    layers: dict = field(default_factory=dict)      # layer -> bytes of its matrices
    features: int = 0     # per token, the outputs of a layer's products (the decoder: its widest convolution's)

    def streamed(self, layers):
        return sum(self.layers[i] for i in layers)

    @property
    def slot(self):
        return max(self.layers.values(), default=0)


def component_weights(component):
    """Weights of a checkpoint component (its tensors' shapes only: nothing is read)."""
    host = HOST_TENSORS.get(component.name, ())
    matrix = 4 if component.name == "vae" else 2       # the decoder keeps its matrices float32 (split later)
    out = Weights(0)
    features = {}
    for name, array in component.tensors.items():
        if name in host:
            continue
        n = stored_bytes(array, matrix)
        out.total += n
        layer = layer_of(name)
        if component.name == "vae":
            if len(array.shape) == 4:
                out.features = max(out.features, int(array.shape[0]))
        elif layer is not None and len(array.shape) == 2:
            out.layers[layer] = out.layers.get(layer, 0) + n
            features[layer] = features.get(layer, 0) + int(array.shape[0])
    out.features = max(features.values(), default=out.features)
    return out


def size_text(nbytes):
    """Bytes as GB with one decimal, or MB below a tenth of a GB (the tiny checkpoint's plans)."""
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.2f} MB"


def spread(count, layers):
    """`count` of the layer indices, spread evenly over them (the streamed ones), as a sorted tuple."""
    layers = sorted(layers)
    if count <= 0:
        return ()
    if count >= len(layers):
        return tuple(layers)
    return tuple(sorted({layers[int((k + 0.5) * len(layers) / count)] for k in range(count)}))


@dataclass
class Plan:
    budget: int
    source: str                         # where the budget came from
    stages: tuple                       # the stages this process runs on the GPU
    mode: str                           # "resident", "released" (encoder freed after encoding) or "streamed"
    streamed: dict                      # component name -> tuple of its streamed layers
    peak: int                           # the plan's largest need at once
    phases: dict                        # phase -> bytes (what each part of the run holds at once)
    size: tuple                         # (width, height) the pool was planned for
    layer_counts: dict                  # component name -> its layers, for the components the stages load
    pool: int = 0                       # the pool's part of the peak, at `size`
    weights: dict = field(default=None, repr=False, compare=False)    # what it was made from (pool_at)
    text_tokens: int = 512

    def layers(self, component):
        return self.streamed.get(component, ())

    @property
    def resident(self):
        return self.mode == "resident"

    def need_at(self, width, height):
        """The peak of the weights as this plan holds them, with the pool another picture size needs: a process
        planned for one size (a server) takes a request of another only where this fits the budget."""
        if self.weights is None:
            return self.peak
        pool = max(pool_bytes(s, self.weights[_COMPONENTS[s]], width, height, self.text_tokens) for s in self.stages)
        return self.peak - self.pool + max(pool, self.pool)

    def line(self):
        """The plan in one line (stderr)."""
        parts = []
        for comp, label in (("text_encoder", "encoder"), ("transformer", "DiT")):
            if comp not in self.layer_counts:
                continue
            n, total = len(self.layers(comp)), self.layer_counts[comp]
            parts.append(f"{label} {n}/{total} layers streamed" if n else f"{label} resident")
        mode = {"resident": "all resident", "released": "encoder released after encoding",
                "streamed": "layers streamed from pinned host memory"}[self.mode]
        return (f"memory plan: {size_text(self.budget)} ({self.source}), {mode}: {', '.join(parts)}"
                f"{', ' if parts else ''}peak {size_text(self.peak)} at {self.size[0]}x{self.size[1]}")


def budget_bytes(given, free):
    """(bytes, source): --gpu-memory GB (or $MOSS_GPU_MEMORY), at most the free memory, else the free memory.
    `free` None: no GPU to ask (a plan shown with --plan on any machine), so a budget must be given."""
    source = "--gpu-memory"
    if given is None and os.environ.get(ENV, "").strip():
        given, source = os.environ[ENV].strip(), f"${ENV}"
    if given is None:
        if free is None:
            raise UsageError("no GPU to plan for: give the budget with --gpu-memory GB (or $MOSS_GPU_MEMORY)")
        return int(free), "free GPU memory"
    try:
        value = float(given)
    except ValueError:
        raise UsageError(f"{source} {given!r}: give a number of GB (e.g. 16)") from None
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{source} {given}: give a positive number of GB")
    asked = int(value * GB)
    if free is not None and asked > free:
        return int(free), f"{source} {value:g} GB, {size_text(free)} free"
    return asked, source


def pool_bytes(stage, weights, width, height, text_tokens):
    """The pool's working memory of one stage at this size (`weights`: its component's)."""
    if stage == "encode":
        return int(POOL_PER_FEATURE * weights.features * text_tokens)
    if stage == "denoise":
        return int(POOL_PER_FEATURE * weights.features * ((width // 16) * (height // 16) + text_tokens))
    # the VAE's decoder or encoder: `features` is the widest convolution of the two (the encoder's 512 channels)
    return int(POOL_PER_CHANNEL_PIXEL * weights.features * width * height)


def reserve_bytes():
    """RESERVE, or $MOSS_PLAN_RESERVE_GB."""
    given = os.environ.get(RESERVE_ENV, "").strip()
    try:
        value = float(given) * GB if given else RESERVE
    except ValueError:
        raise UsageError(f"${RESERVE_ENV} {given!r}: give a number of GB") from None
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"${RESERVE_ENV} {given}: give a number of GB, 0 or more")
    return value


def make(weights, stages, budget, source="--gpu-memory", width=1024, height=1024, text_tokens=512, reserve=None,
         held=False):
    """The plan for running `stages` (of encode-image, encode, denoise, decode) in one process at this size under
    `budget` bytes. `weights`: component name -> Weights; `reserve`: the bytes kept for the libraries and the
    graphs; `held`: every component stays loaded for the process's life (a server), so none is released: the
    encoder's layers stream first, then the DiT's. encode-image (the VAE encoder, for a picture to start from) runs
    first, while the text encoder's weights arrive: its weights and its pool count in the encoder's phase (its
    weights are freed after it, its pool blocks stay in the shared pool). Raises UsageError when no plan fits."""
    reserve = reserve_bytes() if reserve is None else reserve
    stages = tuple(s for s in ORDER if s in stages)
    names = list(dict.fromkeys(_COMPONENTS[s] for s in stages))
    # the pool is shared and keeps its blocks: the largest stage's working memory is held from then on; the
    # encoder's phase holds only its own
    pool = max(pool_bytes(s, weights[_COMPONENTS[s]], width, height, text_tokens) for s in stages)
    enc, dit, vae = (weights.get(n) for n in ("text_encoder", "transformer", "vae"))
    enc_pool = pool_bytes("encode", enc, width, height, text_tokens) if "encode" in stages else 0
    later = (dit.total if dit and "denoise" in stages else 0) + (vae.total if vae and "decode" in stages else 0)
    first = enc.total if enc and "encode" in stages else 0
    # the VAE encoder beside the text encoder's phase: its weights (the vae component's, counted whole) and pool
    image = vae.total if "encode-image" in stages else 0
    if image:
        enc_pool = max(enc_pool, pool_bytes("encode-image", vae, width, height, text_tokens))
    counts = {n: len(weights[n].layers) for n in names if n in weights and n != "vae"}

    def plan(mode, streamed, peak, phases):
        return Plan(budget, source, stages, mode, streamed, peak, phases, (width, height), counts, pool, weights,
                    text_tokens)

    together = first + later + image + pool + reserve
    if together <= budget:
        return plan("resident", {}, together, {"all": together})
    streamed = {}
    if held and first and later:
        vae_bytes = vae.total if vae and "decode" in stages else 0
        enc_fit = _fit(enc, budget - pool - reserve - later)
        dit_fit = (dit.total, ())
        if enc_fit is None:          # every encoder layer streamed, and then the DiT's as they must
            enc_fit = _fit(enc, enc.total - enc.streamed(enc.layers) + SLOTS * enc.slot)
            dit_fit = _fit(dit, budget - pool - reserve - vae_bytes - enc_fit[0])
            if dit_fit is None:
                return _refuse(weights, stages, budget, source, width, height, text_tokens, reserve)
        streamed = {n: f[1] for n, f in (("text_encoder", enc_fit), ("transformer", dit_fit)) if f[1]}
        need = enc_fit[0] + dit_fit[0] + vae_bytes + image + pool + reserve
        return plan("streamed", streamed, need, {"all": need})
    # the encoder alone, then the DiT (and the decoder) alone: each phase within the budget
    enc_phase = _fit(enc, budget - enc_pool - image - reserve) if first else (0, ())
    if enc_phase is None:
        return _refuse(weights, stages, budget, source, width, height, text_tokens, reserve)
    dit_phase = _fit(dit, budget - pool - reserve - (vae.total if vae and "decode" in stages else 0)) \
        if dit and "denoise" in stages else (0, ())
    if dit_phase is None:
        return _refuse(weights, stages, budget, source, width, height, text_tokens, reserve)
    if enc_phase[1]:
        streamed["text_encoder"] = enc_phase[1]
    if dit_phase[1]:
        streamed["transformer"] = dit_phase[1]
    phases = {"encode": enc_phase[0] + enc_pool + image + reserve,
              "denoise": dit_phase[0] + (vae.total if vae and "decode" in stages else 0) + pool + reserve}
    if not first and not image:
        phases.pop("encode")
    if "denoise" not in stages:
        phases["denoise"] = later + pool + reserve
    if max(phases.values()) > budget:      # what cannot stream (the VAE, the pools) does not fit
        return _refuse(weights, stages, budget, source, width, height, text_tokens, reserve)
    mode = "streamed" if streamed else "released"
    return plan(mode, streamed, max(phases.values()), phases)


def _fit(weights, room):
    """(device bytes, streamed layers) of the fewest streamed layers with which `weights` fit in `room`, or None.
    Streaming costs SLOTS slots of the largest layer's matrices."""
    if weights.total <= room:
        return weights.total, ()
    order = sorted(weights.layers)
    slots = SLOTS * weights.slot
    for count in range(1, len(order) + 1):
        layers = spread(count, order)
        need = weights.total - weights.streamed(layers) + slots
        if need <= room:
            return need, layers
    return None


def smallest(weights, stages, width, height, text_tokens=512, reserve=RESERVE):
    """The smallest budget any plan fits in (every layer streamed)."""
    pool = max(pool_bytes(s, weights[_COMPONENTS[s]], width, height, text_tokens) for s in stages)
    needs = [0]
    for stage in stages:
        w = weights.get(_COMPONENTS[stage])
        if w is None:
            continue
        floor = w.total - w.streamed(w.layers) + (SLOTS * w.slot if w.layers else 0)
        if stage == "denoise" and "decode" in stages and "vae" in weights:
            floor += weights["vae"].total
        if stage == "encode" and "encode-image" in stages:       # the VAE encoder runs beside it
            floor += weights["vae"].total
            needs.append(floor + max(pool_bytes("encode", w, width, height, text_tokens),
                                     pool_bytes("encode-image", weights["vae"], width, height, text_tokens)))
            continue
        needs.append(floor + (pool_bytes("encode", w, width, height, text_tokens) if stage == "encode" else pool))
    return max(needs) + reserve


def _refuse(weights, stages, budget, source, width, height, text_tokens, reserve):
    need = smallest(weights, stages, width, height, text_tokens, reserve)
    raise UsageError(f"the GPU memory budget ({size_text(budget)}, {source}) is below the smallest plan for "
                     f"{width}x{height}, {size_text(need)} with every layer streamed; free GPU memory, raise "
                     "--gpu-memory, or make a smaller picture")
