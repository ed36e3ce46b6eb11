"""The five commands. Each reads its inputs, calls a stage function, and writes its artifact."""

import os
import sys
from pathlib import Path

import click

from . import __version__, artifacts, batch, stages
from .device import DEVICES, resolve
from .errors import CheckpointError, MossError, OptionError, PictureError, UsageError, out_of_memory
from .progress import Progress


def _run(command, prog):
    """Run a click command; every failure becomes one line on stderr and a non-zero exit. A command that
    succeeded leaves at once (_leave)."""
    try:
        code = command.main(prog_name=prog, standalone_mode=False)     # an exit code where --help or --version ran
        _leave(code if isinstance(code, int) else 0)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        click.echo(f"{prog}: error: {e.format_message()}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo(f"{prog}: aborted", err=True)
        sys.exit(130)
    except MossError as e:
        click.echo(f"{prog}: error: {e}", err=True)
        sys.exit(2 if isinstance(e, OptionError) else 1)
    except KeyboardInterrupt:
        click.echo(f"{prog}: interrupted", err=True)
        sys.exit(130)
    except MemoryError as e:    # a size past the room check's lower bound: still bad input, not a bug
        click.echo(f"{prog}: error: out of memory ({e}); give a smaller size", err=True)
        sys.exit(1)
    except BrokenPipeError:
        sys.exit(1)
    except Exception as e:  # a bug: still one line, the traceback only on request
        oom = out_of_memory(e, _gpu_memory_now)
        if oom is not None:
            click.echo(f"{prog}: error: {oom}", err=True)
            sys.exit(1)
        if os.environ.get("MOSS_DEBUG"):
            raise
        click.echo(f"{prog}: internal error: {type(e).__name__}: {e} (set MOSS_DEBUG=1 for a traceback)", err=True)
        sys.exit(3)


def _leave(code):
    """End the process once the command's files are written and closed, its output flushed: the interpreter's
    teardown (freeing the pinned host buffers, destroying the CUDA context, collecting every module) is work
    that nobody waits for."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):      # the reader went away, or the stream was closed
            os._exit(1)
    os._exit(code)


def _gpu_memory_now():
    """(free, total) bytes of the GPU where this process has a CUDA context, for an out-of-memory line."""
    if "numba.cuda" not in sys.modules:
        raise RuntimeError("no CUDA context")
    return stages._gpu_memory()


def _open(model_dir, device, stage, progress, gpu_memory=None, show_plan=False, size=None, lora=(), room=False):
    """The stage's Model on its device, with its GPU memory plan and the --lora adapters; `size` (width, height),
    or a function of the checkpoint giving it (the decoder's comes from its LAT). On a GPU the driver opens and
    the plan is made first, and the encoder's or the transformer's weights start for the GPU then, while the
    kernel library is imported (stages.preload_gpu_weights, as moss-image does). `room`: the host memory the
    stage needs at that size is checked first (stages.check_room), and again for the CPU where auto takes it."""
    if device not in DEVICES:
        resolve(device, stage)                  # its error, before anything is read
    checkpoint = _checkpoint(model_dir, lora)
    if callable(size):
        size = size(checkpoint)
    if room:
        stages.check_room(checkpoint, stage, *size, "cpu" if device == "cpu" else "cuda")
    plan = None
    if not show_plan:
        def planner(memory):
            made = stages.memory_plan(checkpoint, (stage,), gpu_memory, size, memory)
            progress.note(made.line())
            return made
        _, plan = stages.preload_gpu_weights(checkpoint, device, [s for s in (stage,) if s in stages.GPU_COMPONENTS],
                                             planner=planner)
    chosen = resolve(device, stage)
    if room and device != "cpu" and chosen == "cpu":
        stages.check_room(checkpoint, stage, *size, "cpu")
    if chosen != "cuda" and plan is not None:       # auto chose the CPU after all
        from .memory.preload import discard
        discard()
    if plan is None or chosen != "cuda":
        plan = _memory_plan(checkpoint, chosen, (stage,), gpu_memory, size, show_plan, progress)
    if stage == "denoise":
        _warn_cpu_dit(checkpoint, device, chosen, progress)
    _note_model(progress, checkpoint, chosen)
    return stages.Model(checkpoint, device=chosen, progress=progress, plan=plan)


def _warn_cpu_dit(checkpoint, device, chosen, progress):
    """--device auto that chose the CPU for a real-size DiT says why the GPU could not take it (hours on the CPU)."""
    from .device import gpu_status
    from .memory.plan import component_weights
    if device != "auto" or chosen != "cpu" or component_weights(checkpoint.base_component("transformer")).total < 1e9:
        return
    progress.warn(f"the DiT runs on the CPU in float32 (hours at this size): {gpu_status()[1]}")


def _size(width, height):
    """(width, height) of the picture: the options', else the checkpoint's defaults."""
    def of(checkpoint):
        d = stages.sampling_defaults(checkpoint)
        return (d["width"] if width is None else width, d["height"] if height is None else height)
    return of


def _memory_plan(checkpoint, chosen, stage_list, gpu_memory, size, show_plan, progress):
    """The GPU memory plan of a process running these stages (None on the CPU); with --plan printed on stdout,
    then the command exits. On the CPU --plan shows the plan a --gpu-memory budget would get."""
    if show_plan:
        plan = stages.memory_plan(checkpoint, stage_list, gpu_memory, size,
                                  memory=None if chosen == "cuda" else False)
        click.echo(plan.line())
        raise click.exceptions.Exit(0)
    if chosen != "cuda":
        return None
    plan = stages.memory_plan(checkpoint, stage_list, gpu_memory, size)
    progress.note(plan.line())
    return plan


def _checkpoint(model_dir, lora=()):
    """The checkpoint of --model, else of $MOSS_IMAGE_MODEL (named in its errors), else the embedded one, with the
    --lora adapters read and checked (merged as each component loads)."""
    from . import lora as lora_io
    from .checkpoint import ENV, open_checkpoint
    adapters = [lora_io.parse_spec(text) for text in lora]
    seen = {}
    for text, (path, _) in zip(lora, adapters):
        key = os.path.realpath(path)
        if key in seen:
            raise OptionError(f"--lora {text}: the same adapter as --lora {seen[key]}; give it once, with the scales' "
                              "sum as its scale")
        seen[key] = text
    if model_dir is None and os.environ.get(ENV):
        try:
            return open_checkpoint(os.environ[ENV], lora=adapters)
        except CheckpointError as e:
            raise CheckpointError(f"${ENV}: {e}") from None
    return open_checkpoint(model_dir, lora=adapters)


def _note_model(progress, checkpoint, device):
    """The model line (the device first of all notes), then one line per adapter."""
    progress.note(f"model {checkpoint.root} ({checkpoint.fingerprint[:12]}), device {device}")
    for adapter in checkpoint.adapters:
        progress.note(f"LoRA {adapter.describe()}")


def _stdin_once(*inputs):
    """Refuse two inputs that both read stdin ('-'): INPUTS are (name, path) pairs."""
    named = [name for name, path in inputs if path == "-"]
    if len(named) > 1:
        both = "both" if len(named) == 2 else "all"
        raise OptionError(f"{', '.join(named[:-1])} and {named[-1]} cannot {both} be stdin: give files for all but one")


def _given(name):
    """Whether option NAME was given (on the command line or through the environment), not defaulted."""
    source = click.get_current_context().get_parameter_source(name)
    return source not in (None, click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP)


def _wrote(progress, path, what, extra=""):
    """The run's last line: where its result went (stderr, unless --quiet)."""
    progress.note((f"wrote {what} to stdout" if str(path) == "-" else f"wrote {what} {path}") + extra)


def _make_folder(path, option):
    """mkdir -p PATH, or one line saying why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{option} {path}: cannot create the folder ({e.strerror or e})") from None


def _foreign(progress, artifact):
    if artifact.foreign:
        progress.warn(f"{artifact.source} has no moss-cli metadata: used as is, its model could not be checked")


def _sampling(checkpoint, progress, seed, steps, guidance, width, height, shift, skip_layers, skip_start, skip_stop,
              noise):
    """The checked sampling options (stages.sampling_options), and one warning when the schedule runs fewer
    steps than asked."""
    opts = stages.sampling_options(checkpoint, seed, steps, guidance, width, height, shift, skip_layers, skip_start,
                                   skip_stop, noise)
    runs = stages.steps_run(opts)
    if runs != opts.steps:
        progress.warn(f"--steps {opts.steps}: the schedule runs {runs} steps (steps that snap to one sigma of "
                      "the training grid run once)")
    return opts


LITERAL = "--strength 1 without --mask keeps nothing of the picture: this is text-to-image"


def _start(image, strength, mask, progress):
    """The stages.Init of an IMAGE artifact with the strength and the mask picture (or None)."""
    start = stages.start_from(image, strength, mask)
    if start.literal:
        progress.warn(LITERAL)
    return start


def _start_size(start, width, height):
    """--width/--height of a run that starts from an IMAGE: its size, which the options must not contradict."""
    if start is None:
        return width, height
    size = {"width": int(start.image.meta("moss.width")), "height": int(start.image.meta("moss.height"))}
    for name, given in (("width", width), ("height", height)):
        if given is not None and given != size[name]:
            raise UsageError(f"--{name} {given}: {start.image.source} was encoded at {size['width']}x"
                             f"{size['height']}; leave --{name} out or encode the picture at that size")
    return size["width"], size["height"]


init_option = click.option("--strength", type=float, default=None,
                           help=f"How much of the schedule runs from the picture, in (0, 1]: the last "
                                f"strength x steps, from the picture noised to their first sigma (diffusers' "
                                f"FluxImg2ImgPipeline) [{stages.DEFAULT_STRENGTH}].")
mask_option = click.option("--mask", default=None, metavar="MASK.png",
                           help="Inpaint: white repaints, black keeps the picture (FluxInpaintPipeline); the "
                                "picture's size.")

model_option = click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
                            help="MOSS-Image folder (default: $MOSS_IMAGE_MODEL, else the embedded tiny demo).")
device_option = click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
quiet_option = click.option("--quiet", is_flag=True, help="No progress on stderr.")


def memory_options(f):
    """--gpu-memory and --plan (memory.plan)."""
    f = click.option("--plan", "show_plan", is_flag=True,
                     help="Print the GPU memory plan (what stays on the GPU, what streams) and exit without "
                          "loading.")(f)
    return click.option("--gpu-memory", default=None, metavar="GB", callback=_budget,
                        help="GPU memory budget in GB [the GPU's free memory; $MOSS_GPU_MEMORY]. Weights that do "
                             "not fit stream from host memory; the output is the same.")(f)


def _budget(ctx, param, value):
    """--gpu-memory (or $MOSS_GPU_MEMORY) checked as it is read, whatever device the stages take: a number of GB
    above 0 (memory.plan.budget_bytes' own check)."""
    from .memory.plan import ENV, budget_bytes
    if value is not None or os.environ.get(ENV, "").strip():
        budget_bytes(value, free=1 << 62)     # any free memory: only the value is checked
    return value


lora_option = click.option(
    "--lora", multiple=True, metavar="FILE[:SCALE]",
    help="A LoRA or LoKr adapter (diffusers/peft, kohya/LyCORIS or ComfyUI keys) merged into the weights at "
         "load, at SCALE (default 1); repeatable. The adapted model is another model: give every command of "
         "a chain the same --lora options.")
version_option = click.version_option(__version__, message="%(prog)s (moss-cli) %(version)s")


def sampling_options(f, seed=None):
    """The sampling options; SEED replaces the --seed option (moss-image's takes several seeds)."""
    for opt in reversed([
        seed or click.option("--seed", required=True, metavar="SEED",
                     help="Seed of torch's CPU generator, as torch.Generator.manual_seed takes it (-2**63 "
                          "to 2**64-1; a negative s means 2**64 + s). The initial noise is "
                          "torch.randn([1, channels, height/16, width/16]) from that generator, float32: torch's CPU "
                          "randn re-implemented bit for bit (see --noise), so a seed gives torch's noise."),
        click.option("--steps", type=int, default=None, help="Denoising steps [checkpoint's or 50]."),
        click.option("--guidance", type=float, default=None,
                     help="CFG scale; 1 = no negative pass [checkpoint's or 3.0]."),
        click.option("--width", type=int, default=None, help="Pixels, a multiple of 16 [checkpoint's or 1024]."),
        click.option("--height", type=int, default=None, help="Pixels, a multiple of 16 [checkpoint's or 1024]."),
        click.option("--shift", type=float, default=None, help="Schedule shift [scheduler_config.json]."),
        click.option("--uncond-skip-layers", "skip_layers", default="22", show_default=True,
                     help="Blocks skipped on the negative pass, comma-separated; '' for none."),
        click.option("--skip-start", type=float, default=stages.DEFAULT_SKIP_START, show_default=True,
                     help="The negative pass skips the --uncond-skip-layers blocks on the steps i with "
                          "start <= i/steps < stop (0 <= start <= stop <= 1; 0 = from the first step)."),
        click.option("--skip-stop", type=float, default=stages.DEFAULT_SKIP_STOP, show_default=True,
                     help="End of that window, a fraction of the steps (1 = through the last step)."),
        click.option("--noise", type=click.Choice(["avx2", "generic"]), default="avx2", show_default=True,
                     help="torch CPU randn kernel to reproduce (avx2 = official x86 wheels)."),
    ]):
        f = opt(f)
    return f


@click.command(help="Encode a prompt (and negative) into an ENC file of encoder rows.")
@model_option
@click.option("--prompt", required=True)
@click.option("--negative", default=stages.DEFAULT_NEGATIVE, show_default=True)
@click.option("--no-negative", is_flag=True, help="Encode no negative (only for --guidance 1).")
@lora_option
@device_option
@memory_options
@click.option("--out", required=True, help="ENC file, or - for stdout.")
@quiet_option
@version_option
def _encode(model_dir, prompt, negative, no_negative, lora, device, gpu_memory, show_plan, out, quiet):
    progress = Progress(quiet, "moss-encode")
    if no_negative and _given("negative"):
        raise OptionError("--negative and --no-negative conflict: give one of them")
    prompt, negative = stages.check_text("--prompt", prompt), stages.check_text("--negative", negative)
    artifacts.check_writable(out)
    model = _open(model_dir, device, "encode", progress, gpu_memory, show_plan, _size(None, None), lora)
    artifacts.write(out, stages.encode(model, prompt, None if no_negative else negative, once=True))
    _wrote(progress, out, "ENC")


@click.command(help="Denoise from seeded noise to the final latents (LAT) for an ENC file.")
@model_option
@click.argument("enc")
@sampling_options
@click.option("--trace", default=None, help="Also write a TRACE file (noise, sigmas, per-step latents/velocity).")
@lora_option
@click.option("--init", default=None, metavar="IMAGE.lat",
              help="Start from a picture (moss-encode-image's file): image-to-image, or inpainting with --mask.")
@init_option
@mask_option
@device_option
@memory_options
@click.option("--out", required=True, help="LAT file, or - for stdout.")
@quiet_option
@version_option
def _denoise(model_dir, enc, seed, steps, guidance, width, height, shift, skip_layers, skip_start, skip_stop,
             noise, trace, init, strength, mask, lora, device, gpu_memory, show_plan, out, quiet):
    progress = Progress(quiet, "moss-denoise")
    seed = batch.parse_seed(seed)
    artifacts.check_writable(out)
    if trace:
        artifacts.check_writable(trace)
    strength = stages.check_start(init, strength, mask)
    _stdin_once(("ENC", enc), ("--init", init), ("--mask", mask))
    artifacts.check_apart([("--out", out)] + ([("--trace", trace)] if trace else []),
                          [(name, path) for name, path in (("the input ENC", enc), ("--init", init), ("--mask", mask))
                           if path is not None])
    model = _open(model_dir, device, "denoise", progress, gpu_memory, show_plan, _size(width, height), lora)
    start = None
    if init is not None:
        from . import picture
        # a picture's latents are the VAE's: a DiT adapter does not change them, so the folder's own model signs them
        image = artifacts.read(init, "encode-image", model.checkpoint.base_fingerprint)
        start = _start(image, strength, None if mask is None else picture.read(mask), progress)
        width, height = _start_size(start, width, height)
    opts = _sampling(model.checkpoint, progress, seed, steps, guidance, width, height, shift, skip_layers,
                     skip_start, skip_stop, noise)
    stages.check_room(model.checkpoint, "denoise", opts.width, opts.height, model.device)
    enc_artifact = artifacts.read(enc, "encode", model.fingerprint, bool(lora))
    progress.start_clock()
    _foreign(progress, enc_artifact)
    lat, traced = stages.denoise(model, enc_artifact, opts, trace=bool(trace), init=start, once=True)
    if enc_artifact.foreign:
        lat, traced = artifacts.mark_foreign_input(lat), traced and artifacts.mark_foreign_input(traced)
    if trace:
        artifacts.write(trace, traced)
    artifacts.write(out, lat)
    _wrote(progress, out, "LAT")


@click.command(help="Encode a picture (PNG, JPEG or WebP) with the VAE encoder into an IMAGE file of latents, the "
                    "start of moss-denoise --init.")
@model_option
@click.argument("picture")
@click.option("--width", type=int, default=None,
              help="Resize to this width, a multiple of 16 [the picture's, floored to a multiple of 16].")
@click.option("--height", type=int, default=None,
              help="Resize to this height, a multiple of 16 [the picture's, floored to a multiple of 16].")
@device_option
@memory_options
@click.option("--out", required=True, help="IMAGE file, or - for stdout.")
@quiet_option
@version_option
def _encode_image(model_dir, picture, width, height, device, gpu_memory, show_plan, out, quiet):
    from . import picture as pictures
    progress = Progress(quiet, "moss-encode-image")
    artifacts.check_writable(out)
    artifacts.check_apart([("--out", out)], [("the input picture", picture)])
    source = pictures.read(picture)
    model = _open(model_dir, device, "encode-image", progress, gpu_memory, show_plan, source.target(width, height),
                  room=True)
    artifacts.write(out, stages.encode_image(model, source, width, height))
    _wrote(progress, out, "IMAGE")


@click.command(help="Decode a LAT file to an RGB PNG.")
@model_option
@click.argument("lat")
@lora_option
@device_option
@memory_options
@click.option("--out", required=True, help="PNG file, or - for stdout.")
@quiet_option
@version_option
def _decode(model_dir, lat, lora, device, gpu_memory, show_plan, out, quiet):
    progress = Progress(quiet, "moss-decode")
    artifacts.check_writable(out, suffix=".png")
    artifacts.check_apart([("--out", out)], [("the input LAT", lat)])
    read = {}

    def size(checkpoint):        # the picture's size from its latents: the LAT is read once, before the plan
        read["lat"] = artifacts.read(lat, "denoise", checkpoint.fingerprint, bool(lora))
        x = read["lat"].tensors.get("latents")
        shape = x.shape if x is not None and x.ndim == 4 else (1, 1, 64, 64)
        return (shape[3] * stages.PATCH, shape[2] * stages.PATCH)
    model = _open(model_dir, device, "decode", progress, gpu_memory, show_plan, size, lora)
    lat_artifact = read["lat"]
    _foreign(progress, lat_artifact)
    latents = lat_artifact.tensors.get("latents")
    if latents is not None and latents.ndim == 4:
        stages.check_room(model.checkpoint, "decode", latents.shape[3] * stages.PATCH,
                          latents.shape[2] * stages.PATCH, model.device)
    artifacts.write(out, stages.decode(model, lat_artifact, once=True))
    _wrote(progress, out, "PNG")


@click.command(help="Prompt to picture in one process: encode, denoise, decode. Several seeds and/or a prompt "
                    "file make one picture each (weights loaded once, each prompt encoded once), each equal to "
                    "the single run's.")
@model_option
@click.option("--prompt", default=None, help="The prompt (or --prompt-file).")
@click.option("--prompt-file", default=None, metavar="FILE", help=batch.PROMPT_FILE_HELP)
@click.option("--negative", default=stages.DEFAULT_NEGATIVE, show_default=True)
@(lambda f: sampling_options(f, seed=click.option("--seed", multiple=True, required=True, metavar="SEEDS",
                                                  help=batch.SEED_HELP)))
@click.option("--picture", required=True, help=batch.PICTURE_HELP)
@click.option("--keep", type=click.Path(path_type=Path), default=None, help=batch.KEEP_HELP)
@lora_option
@click.option("--init-image", default=None, metavar="PICTURE",
              help="Start from this picture (PNG, JPEG or WebP), resized to --width/--height [its size floored to "
                   "multiples of 16]: image-to-image, or inpainting with --mask.")
@init_option
@mask_option
@device_option
@memory_options
@quiet_option
@version_option
def _image(model_dir, prompt, prompt_file, negative, seed, steps, guidance, width, height, shift, skip_layers,
           skip_start, skip_stop, noise, picture, keep, init_image, strength, mask, lora, device, gpu_memory,
           show_plan, quiet):
    from . import picture as pictures_in
    progress = Progress(quiet, "moss-image")
    prompt = None if prompt is None else stages.check_text("--prompt", prompt)
    negative = stages.check_text("--negative", negative)
    _stdin_once(("--prompt-file", prompt_file), ("--init-image", init_image), ("--mask", mask))
    pictures = batch.plan(prompt, prompt_file, seed, picture)
    if keep is not None and keep.exists() and not keep.is_dir():
        raise UsageError(f"--keep {keep}: exists and is not a folder")
    source = mask_picture = None
    strength = stages.check_start(init_image, strength, mask)
    if init_image is not None:
        source = pictures_in.read(init_image)
        mask_picture = None if mask is None else pictures_in.read(mask)
        if mask_picture is not None and mask_picture.size != source.size:
            raise PictureError(f"{mask}: the mask is {mask_picture.size[0]}x{mask_picture.size[1]}, the picture "
                               f"{source.size[0]}x{source.size[1]}; give a mask of the picture's size")
        width, height = source.target(width, height)
    outputs = [("--picture", p.path) for p in pictures]
    if keep is not None:
        several = len(pictures) > 1
        kept = {name for p in pictures for name in batch.keep_names(p, several)}
        outputs += [("--keep", keep / name) for name in sorted(kept)]
    artifacts.check_apart(outputs, [(name, path) for name, path in (("--prompt-file", prompt_file),
                                                                    ("--init-image", init_image), ("--mask", mask))
                                    if path not in (None, "-")])
    checkpoint = _checkpoint(model_dir, lora)
    opts = _sampling(checkpoint, progress, pictures[0].seed, steps, guidance, width, height, shift,
                     skip_layers, skip_start, skip_stop, noise)
    size = (opts.width, opts.height)
    encodes = source is not None and not stages.literal(strength, mask)     # the VAE encoder runs here too
    planned = batch.STAGES + (("encode-image",) if encodes else ())
    if show_plan:
        _memory_plan(checkpoint, resolve(device, "denoise"), planned, gpu_memory, size, True, progress)
    # the devices resolve after the preload (which must start before the kernel library is imported): until
    # then only the host's part of a GPU run is checked, and a stage that auto puts on the CPU is checked again
    checked = ("denoise", "decode") + (("encode-image",) if encodes else ())
    for stage in checked:
        stages.check_room(checkpoint, stage, opts.width, opts.height, "cpu" if device == "cpu" else "cuda")
    # the encoder's and the transformer's weights start for the GPU now, while the kernel library is imported
    # (the base weights: --lora adapters are merged on the GPU once they are there)
    model_for, chosen = batch.open_models(checkpoint, device, progress, gpu_memory, size, image=encodes)
    for stage in checked:
        if device != "cpu" and resolve(device, stage) == "cpu":
            stages.check_room(checkpoint, stage, opts.width, opts.height, "cpu")
    _warn_cpu_dit(checkpoint, device, chosen["denoise"], progress)
    on = (next(iter(chosen.values())) if len(set(chosen.values())) == 1
          else ", ".join(f"{dev} for {stage}" for stage, dev in chosen.items()))
    _note_model(progress, checkpoint, on)
    prompts = {p.prompt.index: p.prompt for p in pictures}.values()
    stages.check_prompts(model_for("encode").tokenizer,               # every prompt, before the first picture
                         [("prompt" if prompt_file is None else f"prompt on line {p.line} of --prompt-file", p.text)
                          for p in prompts] + ([("negative", negative)] if opts.cfg else []))
    if not opts.cfg and _given("negative"):
        progress.warn(f"--negative is unused: guidance {opts.guidance:g} runs no negative pass")
    if keep is not None:
        _make_folder(keep, "--keep")
    start = None
    if encodes:
        # a model of its own: the VAE encoder's weights go once the picture is encoded (the plan counted them)
        image_bytes = stages.encode_image(stages.Model(checkpoint, device=resolve(device, "encode-image"),
                                                       progress=progress), source, opts.width, opts.height)
        if keep is not None:
            artifacts.write(keep / batch.IMAGE_NAME, image_bytes)
        image = artifacts.parse(image_bytes, "picture encoding", "encode-image", checkpoint.fingerprint)
        start = _start(image, strength, mask_picture, progress)
    elif source is not None:
        progress.warn(LITERAL)
    # each stage's file kept as soon as it exists, so an interrupted run keeps it; each PNG announced once written
    batch.run(pictures, opts, negative, model_for, checkpoint.fingerprint, keep, progress,
              lambda done, extra: _wrote(progress, done.path, "PNG", extra), init=start)


def encode_command():
    _run(_encode, "moss-encode")


def denoise_command():
    _run(_denoise, "moss-denoise")


def encode_image_command():
    _run(_encode_image, "moss-encode-image")


def decode_command():
    _run(_decode, "moss-decode")


def image_command():
    _run(_image, "moss-image")


def build_kernels_command():
    """moss-cli-build-kernels [--cache DIR] [--out DIR] [--targets ...] [--jobs N]: what a first process would
    otherwise compile, compiled now (no GPU needed, e.g. in an image's build step): the upload lanes' host loop
    into numba's cache, then the prebuilt GPU kernel files from the kernels recorded in the kernel cache
    (cuda_kernels/prebuilt.py). Usage errors and a missing --cache folder stop it before any work."""
    from cuda_kernels import prebuilt
    prog = "moss-cli-build-kernels"
    args = prebuilt.build_arguments(sys.argv[1:], prog, "Compile now, without a GPU, what a first process would "
                                    "compile: the upload lanes' host loop, then the prebuilt kernel files from the "
                                    "kernels a GPU run recorded in the kernel cache.")

    def compile_the_lanes():
        from .memory.lanes import warm_without_gpu
        warm_without_gpu()
        click.echo(f"{prog}: the upload lanes' loop is compiled", err=True)
    sys.exit(prebuilt.run_build(args, prog, prepare=compile_the_lanes))
