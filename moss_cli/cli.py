"""The four commands. Each reads its inputs, calls a stage function, and writes its artifact."""

import os
import sys
from pathlib import Path

import click

from . import __version__, artifacts, batch, stages
from .device import DEVICES, resolve
from .errors import MossError, UsageError, out_of_memory
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
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo(f"{prog}: interrupted", err=True)
        sys.exit(130)
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


def _open(model_dir, device, stage, progress, gpu_memory=None, show_plan=False, size=None):
    """The stage's Model on its device, with its GPU memory plan; `size` (width, height), or a function of the
    checkpoint giving it (the decoder's comes from its LAT)."""
    from .checkpoint import open_checkpoint
    chosen = resolve(device, stage)
    checkpoint = open_checkpoint(model_dir)
    if callable(size):
        size = size(checkpoint)
    plan = _memory_plan(checkpoint, chosen, (stage,), gpu_memory, size, show_plan, progress)
    if stage == "denoise":
        _warn_cpu_dit(checkpoint, device, chosen, progress)
    progress.note(f"model {checkpoint.root} ({checkpoint.fingerprint[:12]}), device {chosen}")
    return stages.Model(checkpoint, device=chosen, progress=progress, plan=plan)


def _warn_cpu_dit(checkpoint, device, chosen, progress):
    """--device auto that chose the CPU for a real-size DiT says why the GPU could not take it (hours on the CPU)."""
    from .device import gpu_status
    from .ops.memory_plan import component_weights
    if device != "auto" or chosen != "cpu" or component_weights(checkpoint.component("transformer")).total < 1e9:
        return
    progress.warn(f"the DiT runs on the CPU in float32 (hours at this size): {gpu_status()[1]}")


def _size(width, height):
    """(width, height) of the picture: the options', else the checkpoint's defaults."""
    def of(checkpoint):
        d = stages.sampling_defaults(checkpoint)
        return (d["width"] if width is None else width, d["height"] if height is None else height)
    return of


def _memory_plan(checkpoint, chosen, stage_list, gpu_memory, size, show_plan, progress, memory=None):
    """The GPU memory plan of a process running these stages (None on the CPU); with --plan printed on stdout,
    then the command exits. On the CPU --plan shows the plan a --gpu-memory budget would get."""
    if show_plan:
        plan = stages.memory_plan(checkpoint, stage_list, gpu_memory, size,
                                  memory=memory if chosen == "cuda" else False)
        click.echo(plan.line())
        raise click.exceptions.Exit(0)
    if chosen != "cuda":
        return None
    plan = stages.memory_plan(checkpoint, stage_list, gpu_memory, size, memory=memory)
    progress.note(plan.line())
    return plan


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


def _skip_layers(text):
    text = text.strip()
    if not text:
        return ()
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise UsageError(f"--uncond-skip-layers {text!r}: give block indices like 22 or 21,22, or '' for none") from None


def _sampling(model, seed, steps, guidance, width, height, shift, skip_layers, skip_start, skip_stop, noise):
    d = stages.sampling_defaults(model.checkpoint)
    opts = stages.SamplingOptions(
        seed=seed, steps=d["steps"] if steps is None else steps,
        guidance=d["guidance"] if guidance is None else guidance,
        width=d["width"] if width is None else width, height=d["height"] if height is None else height,
        shift=d["shift"] if shift is None else shift, uncond_skip_layers=_skip_layers(skip_layers),
        skip_start=skip_start, skip_stop=skip_stop, noise=noise)
    opts.check()
    return opts


model_option = click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
                            help="MOSS-Image folder (default: $MOSS_IMAGE_MODEL, else the embedded tiny demo).")
device_option = click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
quiet_option = click.option("--quiet", is_flag=True, help="No progress on stderr.")


def memory_options(f):
    """--gpu-memory and --plan (ops.memory_plan)."""
    f = click.option("--plan", "show_plan", is_flag=True,
                     help="Print the GPU memory plan (what stays on the GPU, what streams) and exit without "
                          "loading.")(f)
    return click.option("--gpu-memory", default=None, metavar="GB",
                        help="GPU memory budget in GB [the GPU's free memory; $MOSS_GPU_MEMORY]. Weights that do "
                             "not fit stream from host memory; the output is the same.")(f)
version_option = click.version_option(__version__, message="%(prog)s (moss-cli) %(version)s")


def sampling_options(f, seed=None):
    """The sampling options; SEED replaces the --seed option (moss-image's takes several seeds)."""
    for opt in reversed([
        seed or click.option("--seed", type=int, required=True,
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
@device_option
@memory_options
@click.option("--out", required=True, help="ENC file, or - for stdout.")
@quiet_option
@version_option
def _encode(model_dir, prompt, negative, no_negative, device, gpu_memory, show_plan, out, quiet):
    progress = Progress(quiet, "moss-encode")
    if no_negative and _given("negative"):
        raise UsageError("--negative and --no-negative conflict: give one of them")
    artifacts.check_writable(out)
    model = _open(model_dir, device, "encode", progress, gpu_memory, show_plan, _size(None, None))
    artifacts.write(out, stages.encode(model, prompt, None if no_negative else negative))
    _wrote(progress, out, "ENC")


@click.command(help="Denoise from seeded noise to the final latents (LAT) for an ENC file.")
@model_option
@click.argument("enc")
@sampling_options
@click.option("--trace", default=None, help="Also write a TRACE file (noise, sigmas, per-step latents/velocity).")
@device_option
@memory_options
@click.option("--out", required=True, help="LAT file, or - for stdout.")
@quiet_option
@version_option
def _denoise(model_dir, enc, seed, steps, guidance, width, height, shift, skip_layers, skip_start, skip_stop,
             noise, trace, device, gpu_memory, show_plan, out, quiet):
    progress = Progress(quiet, "moss-denoise")
    artifacts.check_writable(out)
    if trace:
        artifacts.check_writable(trace)
    model = _open(model_dir, device, "denoise", progress, gpu_memory, show_plan, _size(width, height))
    opts = _sampling(model, seed, steps, guidance, width, height, shift, skip_layers, skip_start, skip_stop, noise)
    enc_artifact = artifacts.read(enc, "encode", model.fingerprint)
    progress.start_clock()
    _foreign(progress, enc_artifact)
    lat, traced = stages.denoise(model, enc_artifact, opts, trace=bool(trace))
    if enc_artifact.foreign:
        lat, traced = artifacts.mark_foreign_input(lat), traced and artifacts.mark_foreign_input(traced)
    if trace:
        artifacts.write(trace, traced)
    artifacts.write(out, lat)
    _wrote(progress, out, "LAT")


@click.command(help="Decode a LAT file to an RGB PNG.")
@model_option
@click.argument("lat")
@device_option
@memory_options
@click.option("--out", required=True, help="PNG file, or - for stdout.")
@quiet_option
@version_option
def _decode(model_dir, lat, device, gpu_memory, show_plan, out, quiet):
    progress = Progress(quiet, "moss-decode")
    artifacts.check_writable(out, suffix=".png")
    read = {}

    def size(checkpoint):        # the picture's size from its latents: the LAT is read once, before the plan
        read["lat"] = artifacts.read(lat, "denoise", checkpoint.fingerprint)
        x = read["lat"].tensors.get("latents")
        shape = x.shape if x is not None and x.ndim == 4 else (1, 1, 64, 64)
        return (shape[3] * stages.PATCH, shape[2] * stages.PATCH)
    model = _open(model_dir, device, "decode", progress, gpu_memory, show_plan, size)
    lat_artifact = read["lat"]
    _foreign(progress, lat_artifact)
    artifacts.write(out, stages.decode(model, lat_artifact))
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
@device_option
@memory_options
@quiet_option
@version_option
def _image(model_dir, prompt, prompt_file, negative, seed, steps, guidance, width, height, shift, skip_layers,
           skip_start, skip_stop, noise, picture, keep, device, gpu_memory, show_plan, quiet):
    progress = Progress(quiet, "moss-image")
    pictures = batch.plan(prompt, prompt_file, seed, picture)
    if keep is not None and keep.exists() and not keep.is_dir():
        raise UsageError(f"--keep {keep}: exists and is not a folder")
    from .checkpoint import open_checkpoint
    checkpoint = open_checkpoint(model_dir)
    size = _size(width, height)(checkpoint)
    gpu_stages = ("encode", "denoise", "decode")
    if show_plan:
        _memory_plan(checkpoint, resolve(device, "denoise"), gpu_stages, gpu_memory, size, True, progress)
    # the encoder's and the transformer's weights start for the GPU now, while the kernel library is imported
    # (as much of them as the memory plan, made once the driver answers, keeps there from the start)
    preloaded, plan = stages.preload_gpu_weights(
        checkpoint, device, planner=lambda memory: stages.memory_plan(checkpoint, gpu_stages, gpu_memory, size, memory))
    if plan is not None:
        progress.note(plan.line())
    models = {}

    def model_for(stage):
        nonlocal plan
        chosen = resolve(device, stage)
        if chosen == "cuda" and plan is None:
            plan = _memory_plan(checkpoint, chosen, gpu_stages, gpu_memory, size, False, progress)
        if chosen not in models:
            models[chosen] = stages.Model(checkpoint, device=chosen, progress=progress,
                                          plan=plan if chosen == "cuda" else None)
        return models[chosen]

    chosen = {stage: resolve(device, stage) for stage in ("encode", "denoise", "decode")}
    _warn_cpu_dit(checkpoint, device, chosen["denoise"], progress)
    if preloaded and "cpu" in (chosen["encode"], chosen["denoise"]):     # auto chose the CPU after all
        from .ops.cuda_preload import discard
        discard()
    on = (next(iter(chosen.values())) if len(set(chosen.values())) == 1
          else ", ".join(f"{dev} for {stage}" for stage, dev in chosen.items()))
    progress.note(f"model {checkpoint.root} ({checkpoint.fingerprint[:12]}), device {on}")
    opts = _sampling(model_for("denoise"), pictures[0].seed, steps, guidance, width, height, shift,
                     skip_layers, skip_start, skip_stop, noise)
    if not opts.cfg and _given("negative"):
        progress.warn(f"--negative is unused: guidance {opts.guidance:g} runs no negative pass")
    if keep is not None:
        _make_folder(keep, "--keep")
    # each stage's file kept as soon as it exists, so an interrupted run keeps it
    for done, extra in batch.run(pictures, opts, negative, model_for, checkpoint.fingerprint, keep, progress):
        _wrote(progress, done.path, "PNG", extra)


def encode_command():
    _run(_encode, "moss-encode")


def denoise_command():
    _run(_denoise, "moss-denoise")


def decode_command():
    _run(_decode, "moss-decode")


def image_command():
    _run(_image, "moss-image")


def build_kernels_command():
    """moss-cli-build-kernels [build options]: what a first process would otherwise compile, compiled now (no GPU
    needed, e.g. in an image's build step): the upload lanes' host loop into numba's cache, then the prebuilt GPU
    kernel files from the kernels recorded in the kernel cache (python -m cuda_kernels.prebuilt build --help)."""
    from cuda_kernels import prebuilt
    from .ops.cuda_lanes import warm_without_gpu
    warm_without_gpu()
    click.echo("moss-cli-build-kernels: the upload lanes' loop is compiled", err=True)
    sys.exit(prebuilt.main(["build"] + sys.argv[1:]))
