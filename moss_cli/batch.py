"""Several pictures per load for `moss-image`: seed lists and ranges, a prompt file, picture name patterns.

Every check runs before any work. Then each distinct prompt is encoded once (the negative once for all of
them, through `stages.encode`'s cache), the weights stay resident in the stages' Model objects, and each
picture is made by the same stage functions on the same bytes as a single run: each PNG equals, byte for
byte, the one `moss-image` makes for that prompt and seed alone. Each picture's noise is drawn on a host
thread ahead of its turn: the first one's while the weights load and the first prompt encodes, each later
one's while the picture before it denoises.
"""

import dataclasses
import os
import re
import string
from dataclasses import dataclass
from pathlib import Path

from . import artifacts, stages
from .device import resolve
from .errors import OptionError, UsageError

MAX_PICTURES = 10000                       # per run: a mistyped range fails at once, not after hours
STAGES = ("encode", "denoise", "decode")
COMPONENTS = {"encode": "encoder", "denoise": "transformer", "decode": "decoder"}   # the Model attribute of each
FIELDS = ("seed", "index", "line")         # the placeholders of --picture

SEED_HELP = ("Seed of torch's CPU generator, as for moss-denoise (-2**63 to 2**64-1). Several make one picture "
             "each: a list 1,2,3, an inclusive range 10-13, or the option repeated; a negative seed is -5.")
PROMPT_FILE_HELP = ("Prompts, one a line (UTF-8, '-' for stdin); blank lines are skipped, a line is the prompt "
                    "as it stands (only its line ending removed).")
PICTURE_HELP = ("PNG file, or - for stdout (one picture only). A pattern names several pictures: {seed}, "
                "{index} (the prompt's position, from 1) and {line} (its line in --prompt-file); format specs "
                "work ({seed:04d}), {{ and }} are literal braces.")
KEEP_HELP = ("Folder to keep the intermediate ENC and LAT files in, each written as soon as its stage ends; created "
             "if missing. One picture: prompt.enc and latents.lat; several: prompt-INDEX.enc per prompt and "
             "latents-INDEX-SEED.lat per picture; with --init-image also image.lat.")
IMAGE_NAME = "image.lat"                   # the encoded --init-image under --keep

# ASCII digits only: int() would also take '1_000' and other scripts' digits
_SEED = re.compile(r"-?[0-9]+")
_RANGE = re.compile(r"(-?[0-9]+)-(-?[0-9]+)")


@dataclass(frozen=True)
class Prompt:
    text: str
    index: int      # position among the prompts, from 1
    line: int       # line number in the prompt file (1 for --prompt)


@dataclass(frozen=True)
class Picture:
    prompt: Prompt
    seed: int
    path: str       # a file name, or '-' for stdout


def check_seed(seed):
    """SEED when the sampling options' own check (the range torch's manual_seed takes) accepts it."""
    stages.SamplingOptions(seed=seed).check()
    return seed


def parse_seed(value):
    """The one seed of moss-denoise's --seed, written as each seed of moss-image's: 42, -5."""
    text = str(value).strip()
    if not _SEED.fullmatch(text):
        raise UsageError(f"--seed {value!r}: give one seed, an integer such as 42 or -5")
    return check_seed(int(text))


def parse_seeds(values):
    """The seeds of one or more --seed values, in order: '42', '1,2,3', '10-13' (inclusive), '-5'."""
    seeds = []
    for value in values:
        for item in str(value).split(","):
            item = item.strip()
            if _SEED.fullmatch(item):
                seeds.append(parse_seed(item))
                continue
            m = _RANGE.fullmatch(item)
            if not m:
                raise UsageError(f"--seed {value!r}: give a seed (42), a list (1,2,3) or a range (10-13)")
            lo, hi = check_seed(int(m.group(1))), check_seed(int(m.group(2)))
            if lo > hi:
                raise UsageError(f"--seed {item}: the range is empty (write the lower seed first)")
            if len(seeds) + hi - lo + 1 > MAX_PICTURES:
                raise UsageError(f"--seed {value}: more than {MAX_PICTURES} seeds")
            seeds.extend(range(lo, hi + 1))
    if not seeds:
        raise UsageError("--seed: give at least one seed")
    seen = set()
    for s in seeds:
        if s in seen:
            raise UsageError(f"--seed: {s} is given twice")
        seen.add(s)
    return seeds


def read_prompts(prompt, prompt_file):
    """The prompts of --prompt or --prompt-file (exactly one of them)."""
    if prompt is not None and prompt_file is not None:
        raise OptionError("--prompt and --prompt-file: give one of them, not both")
    if prompt is None and prompt_file is None:
        raise OptionError("give --prompt TEXT or --prompt-file FILE")
    if prompt is not None:
        return [Prompt(prompt, 1, 1)]
    name = str(prompt_file)
    data, _ = artifacts.read_input(name, "the prompts", "a file", UsageError, "--prompt-file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UsageError(f"--prompt-file {name}: line {line} is not UTF-8 text (byte {e.start})") from None
    text = text.removeprefix("\ufeff")
    prompts = []
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if line.strip():
            prompts.append(Prompt(line, len(prompts) + 1, number))
    if not prompts:
        raise UsageError(f"--prompt-file {name}: no prompts (every line is blank)")
    return prompts


def _fields(pattern):
    try:
        parsed = list(string.Formatter().parse(pattern))
    except ValueError as e:
        raise UsageError(f"--picture {pattern}: {e} (write {{{{ and }}}} for literal braces)") from None
    fields = {f for _, f, _, _ in parsed if f is not None}
    for f in fields:
        if f not in FIELDS:
            raise UsageError(f"--picture {pattern}: unknown placeholder {{{f}}}; use {{seed}}, {{index}} or {{line}}")
    return fields


def plan(prompt, prompt_file, seed_values, pattern):
    """The pictures of a run, every name checked before any work: distinct, writable, with a placeholder
    when there are several."""
    seeds = parse_seeds(seed_values)
    fields = _fields(pattern)
    prompts = read_prompts(prompt, prompt_file)
    count = len(prompts) * len(seeds)
    if count > MAX_PICTURES:
        raise UsageError(f"{len(prompts)} prompts x {len(seeds)} seeds: more than {MAX_PICTURES} pictures")
    if count > 1 and pattern == "-":
        raise UsageError(f"--picture -: stdout takes one picture, this run makes {count}; give a pattern "
                         "such as picture-{seed}.png")
    if count > 1 and not fields:
        raise UsageError(f"--picture {pattern}: {count} pictures need a placeholder in the name, "
                         "e.g. picture-{seed}.png or picture-{index}-{seed}.png")
    pictures, taken = [], {}
    for p in prompts:
        for s in seeds:
            try:
                name = pattern.format(seed=s, index=p.index, line=p.line)
            except (ValueError, TypeError, KeyError, IndexError) as e:
                raise UsageError(f"--picture {pattern}: {e}") from None
            picture = Picture(p, s, name)
            key = name if name == "-" else os.path.normcase(os.path.abspath(name))
            if key in taken:
                raise UsageError(f"--picture {pattern}: {describe(taken[key], len(prompts))} and "
                                 f"{describe(picture, len(prompts))} would both be {name}")
            taken[key] = picture
            pictures.append(picture)
    for picture in pictures:
        artifacts.check_writable(picture.path, suffix=".png")
    return pictures


def describe(picture, prompts=2):
    """'prompt 2, line 3, seed 11' for messages ('seed 11' when the run has one prompt)."""
    if prompts == 1:
        return f"seed {picture.seed}"
    where = f", line {picture.prompt.line}" if picture.prompt.line != picture.prompt.index else ""
    return f"prompt {picture.prompt.index}{where}, seed {picture.seed}"


def keep_names(picture, several):
    """The ENC and LAT names under --keep: prompt.enc and latents.lat for one picture, else indexed."""
    if not several:
        return "prompt.enc", "latents.lat"
    return f"prompt-{picture.prompt.index}.enc", f"latents-{picture.prompt.index}-{picture.seed}.lat"


def open_models(checkpoint, device, progress, gpu_memory=None, size=None, held=False, image=False):
    """(model_for, {stage: device}): model_for(stage) is the stages.Model of the device STAGE resolves to, one
    per device, made on first use, so every component loads once. The GPU memory plan (stages.memory_plan for
    the picture `size`, within `gpu_memory` GB; `held`: every component kept loaded, as a server keeps them) is
    made as soon as the driver answers and said in one line; the encoder's and the transformer's weights start
    for the GPU then, as far as the plan keeps them there from the start (stages.preload_gpu_weights), while the
    kernel library is imported. `image`: a picture to start from is encoded in this process too (the VAE encoder's
    weights and pool planned beside the text encoder's)."""
    size = size or (stages.DEFAULT_SIZE, stages.DEFAULT_SIZE)
    planned = STAGES + (("encode-image",) if image else ())

    def planner(memory):
        made = stages.memory_plan(checkpoint, planned, gpu_memory, size, memory, held=held)
        progress.note(made.line())
        return made
    preloaded, plan = stages.preload_gpu_weights(checkpoint, device, planner=planner)
    models = {}

    def model_for(stage):
        nonlocal plan
        chosen = resolve(device, stage)
        if chosen == "cuda" and plan is None:
            plan = planner(None)
        if chosen not in models:
            models[chosen] = stages.Model(checkpoint, device=chosen, progress=progress,
                                          plan=plan if chosen == "cuda" else None)
        return models[chosen]

    chosen = {stage: resolve(device, stage) for stage in STAGES}
    if preloaded and "cpu" in (chosen["encode"], chosen["denoise"]):     # auto chose the CPU after all
        from .memory.preload import discard
        discard()
    return model_for, chosen


def encoded(model_for, text, negative, options, fingerprint, negative_cache, once=False):
    """(ENC bytes, the parsed ENC) of a prompt, with NEGATIVE when the options run a negative pass; ONCE as for
    stages.encode."""
    enc_bytes = stages.encode(model_for("encode"), text, negative if options.cfg else None,
                              negative_cache=negative_cache, once=once)
    return enc_bytes, artifacts.parse(enc_bytes, "prompt encoding", "encode", fingerprint)


def made(model_for, enc, options, fingerprint, next_seed=None, init=None, once=False):
    """(LAT bytes, pixels, PNG text) of one picture of a parsed ENC: what moss-image writes for it, the PNG
    being png.encode_png(pixels, text). NEXT_SEED, INIT and ONCE as for stages.denoise. Where the decoder runs on the
    GPU of the denoising model, its graph for this size is made while the steps replay (stages.decoder_beside)."""
    model = model_for("denoise")
    beside = stages.decoder_beside(model, options) if model_for("decode") is model else None
    lat_bytes, _ = stages.denoise(model, enc, options, next_seed=next_seed, init=init, beside=beside, once=once)
    lat = artifacts.parse(lat_bytes, "latents", "denoise", fingerprint)
    pixels, text = stages.decode_pixels(model_for("decode"), lat)
    return lat_bytes, pixels, text


def _write_png(path, pixels, text):
    from .png import encode_png
    artifacts.write(path, encode_png(pixels, text))


def run(pictures, options, negative, model_for, fingerprint, keep, progress, written, init=None):
    """Make every picture: each distinct prompt text encoded once, then its seeds denoised and decoded in turn;
    the kept ENC and LAT written as soon as they exist. A picture's PNG is compressed and written in a second
    thread while the next picture is made (zlib runs without the GIL); that thread calls `written(picture,
    note)` as soon as the file is written, and a failed write raises before the next picture's write. INIT: the
    stages.Init every picture starts from, or None."""
    from concurrent.futures import ThreadPoolExecutor

    def write(picture, note, pixels, text):
        _write_png(picture.path, pixels, text)
        written(picture, note)

    # leaving the pool waits for the last write, also on an interrupt: a PNG written is announced
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="png") as writer:
        pending = None
        for made in _made(pictures, options, negative, model_for, fingerprint, keep, progress, init):
            if pending is not None:
                pending.result()
            pending = writer.submit(write, *made)
        if pending is not None:
            pending.result()


def _made(pictures, options, negative, model_for, fingerprint, keep, progress, init=None):
    """(picture, note, pixels, PNG text) of every picture in turn (run's order and kept files)."""
    several = len(pictures) > 1
    groups = {}
    for picture in pictures:
        groups.setdefault(picture.prompt.text, []).append(picture)
    order = [picture for group in groups.values() for picture in group]     # as the loop below makes them
    encoder = model_for("encode")
    # a memory plan that does not keep everything resident: the encoder's phase first (every prompt encoded),
    # then its GPU memory freed for the DiT's (the same ENC bytes, made in the same order)
    phased = encoder.device == "cuda" and encoder.plan is not None and not encoder.plan.resident
    if order:         # the first picture's noise is drawn while the weights load and the first prompt encodes
        model = model_for("denoise")
        model.draw_noise_ahead(stages.noise_shape(model, options), order[0].seed, options.noise)
        # the GPU's components made before the first encode: the encoder's and then the transformer's weights
        # go to the GPU on the uploader's thread while the encoder's first pass runs (CudaOps.preload), and the
        # decoder's weight splits run on a host thread (CudaDecoder)
        for stage, part in COMPONENTS.items():
            if model_for(stage).device == "cuda" and not (phased and stage != "encode"):
                getattr(model_for(stage), part)
    negative_cache = {}

    def kept_encoding(text, group):
        # one prompt: its rows and the negative's are the only ones this run encodes (no graph made for them)
        enc_bytes, enc = encoded(model_for, text, negative, options, fingerprint, negative_cache,
                                 once=len(groups) == 1)
        if keep is not None:
            for picture in {picture.prompt.index: picture for picture in group}.values():
                artifacts.write(Path(keep) / keep_names(picture, several)[0], enc_bytes)
        return enc

    encs = {}
    if phased:
        encs = {text: kept_encoding(text, group) for text, group in groups.items()}
        encoder.release_encoder()
    number = 0
    for text, group in groups.items():
        enc = encs.pop(text) if phased else kept_encoding(text, group)
        for picture in group:
            number += 1
            if several:
                progress.picture(number, len(pictures), describe(picture, len({p.prompt for p in pictures})))
            lat_bytes, pixels, text = made(model_for, enc, dataclasses.replace(options, seed=picture.seed), fingerprint,
                                           next_seed=order[number].seed if number < len(order) else None, init=init,
                                           once=len(pictures) == 1)
            if keep is not None:
                artifacts.write(Path(keep) / keep_names(picture, several)[1], lat_bytes)
            notes = [f"picture {number}/{len(pictures)}"] if several else []
            if keep is not None:
                notes.append(f"ENC and LAT kept in {keep}")
            yield picture, f" ({'; '.join(notes)})" if notes else "", pixels, text
