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
import sys
from dataclasses import dataclass
from pathlib import Path

from . import artifacts, stages
from .errors import UsageError

MAX_PICTURES = 10000                       # per run: a mistyped range fails at once, not after hours
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

_SEED = re.compile(r"-?\d+")
_RANGE = re.compile(r"(-?\d+)-(-?\d+)")


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


def parse_seeds(values):
    """The seeds of one or more --seed values, in order: '42', '1,2,3', '10-13' (inclusive), '-5'."""
    seeds = []
    for value in values:
        for item in str(value).split(","):
            item = item.strip()
            if _SEED.fullmatch(item):
                seeds.append(check_seed(int(item)))
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
        raise UsageError("--prompt and --prompt-file: give one of them, not both")
    if prompt is None and prompt_file is None:
        raise UsageError("give --prompt TEXT or --prompt-file FILE")
    if prompt is not None:
        return [Prompt(prompt, 1, 1)]
    name = str(prompt_file)
    if name == "-":
        if sys.stdin.isatty():
            raise UsageError("--prompt-file -: stdin is a terminal; pipe the prompts in or give a file name")
        data = sys.stdin.buffer.read()
    else:
        try:
            data = Path(name).read_bytes()
        except FileNotFoundError:
            raise UsageError(f"--prompt-file {name}: no such file") from None
        except IsADirectoryError:
            raise UsageError(f"--prompt-file {name}: is a directory, not a file") from None
        except OSError as e:
            raise UsageError(f"--prompt-file {name}: cannot read ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--prompt-file {name}: not UTF-8 text (byte {e.start})") from None
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


def _write_png(path, pixels, text):
    from .png import encode_png
    artifacts.write(path, encode_png(pixels, text))


def run(pictures, options, negative, model_for, fingerprint, keep, progress, init=None):
    """Make every picture, yielding (picture, note) as each is written: each distinct prompt text encoded
    once, then its seeds denoised and decoded in turn; the kept ENC and LAT written as soon as they exist.
    A picture's PNG is compressed and written in a second thread while the next picture is made (zlib runs
    without the GIL); its (picture, note) comes once it is written, and a failed write raises then. INIT: the
    stages.Init every picture starts from, or None."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="png") as writer:
        pending = None
        for picture, note, pixels, text in _made(pictures, options, negative, model_for, fingerprint, keep, progress,
                                                 init):
            written = writer.submit(_write_png, picture.path, pixels, text)
            if pending is not None:
                pending[2].result()
                yield pending[:2]
            pending = (picture, note, written)
        if pending is not None:
            pending[2].result()
            yield pending[:2]


def _made(pictures, options, negative, model_for, fingerprint, keep, progress, init=None):
    """(picture, note, pixels, PNG text) of every picture in turn (run's order and kept files)."""
    several = len(pictures) > 1
    groups = {}
    for picture in pictures:
        groups.setdefault(picture.prompt.text, []).append(picture)
    order = [picture for group in groups.values() for picture in group]     # as the loop below makes them
    if order:         # the first picture's noise is drawn while the weights load and the first prompt encodes
        model = model_for("denoise")
        model.draw_noise_ahead(stages.noise_shape(model, options), order[0].seed, options.noise)
        # the GPU's components made before the first encode: the encoder's and then the transformer's weights
        # go to the GPU on the uploader's thread while the encoder's first pass runs (CudaOps.preload), and the
        # decoder's weight splits run on a host thread (CudaDecoder)
        for stage, part in (("encode", "encoder"), ("denoise", "transformer"), ("decode", "decoder")):
            if model_for(stage).device == "cuda":
                getattr(model_for(stage), part)
    negative_cache = {}
    number = 0
    for text, group in groups.items():
        enc_bytes = stages.encode(model_for("encode"), text, negative if options.cfg else None,
                                  negative_cache=negative_cache)
        if keep is not None:
            for picture in {picture.prompt.index: picture for picture in group}.values():
                artifacts.write(Path(keep) / keep_names(picture, several)[0], enc_bytes)
        enc = artifacts.parse(enc_bytes, "prompt encoding", "encode", fingerprint)
        for picture in group:
            number += 1
            if several:
                progress.picture(number, len(pictures), describe(picture, len({p.prompt for p in pictures})))
            lat_bytes, _ = stages.denoise(model_for("denoise"), enc, dataclasses.replace(options, seed=picture.seed),
                                          next_seed=order[number].seed if number < len(order) else None, init=init)
            if keep is not None:
                artifacts.write(Path(keep) / keep_names(picture, several)[1], lat_bytes)
            lat = artifacts.parse(lat_bytes, "latents", "denoise", fingerprint)
            pixels, text = stages.decode_pixels(model_for("decode"), lat)
            notes = [f"picture {number}/{len(pictures)}"] if several else []
            if keep is not None:
                notes.append(f"ENC and LAT kept in {keep}")
            yield picture, f" ({'; '.join(notes)})" if notes else "", pixels, text
