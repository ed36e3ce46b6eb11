"""ENC, LAT, TRACE and IMAGE (an encoded picture) artifacts: safetensors files with string metadata, written atomically.

Every artifact names its stage (`moss.stage`) and the model it came from (`moss.model`, the checkpoint
fingerprint), so a file from another stage or another model is refused with one line.

The bytes are read by `safetensors_io.loads`: its header checks first (one-line reasons for truncated or corrupt
files), then the tensors through `safetensors.numpy.load`, which reads the float32 and int32 tensors of our
artifacts and of foreign files. They are written by `safetensors_io.dumps`, because the library's writer
orders the metadata differently on every call and artifacts must be the same bytes run to run.
"""

import hashlib
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import __version__
from .errors import ArtifactError, UsageError
from .safetensors_io import SafetensorsError, dumps, loads

FORMAT = "1"
STAGES = {"encode": "ENC", "denoise": "LAT", "trace": "TRACE", "encode-image": "IMAGE"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# foreign stage files (no moss metadata): the tensors a file must hold to stand in for a stage's artifact
FOREIGN_TENSORS = {"encode": ("prompt_rows", "prompt_ids"), "denoise": ("latents",)}
WIDENED = ("float16", "bfloat16")   # float dtypes a foreign file may use: widened to float32 exactly
# (a foreign file with a BF16 tensor is read by safetensors_io's own reader, as ml_dtypes.bfloat16:
# safetensors.numpy.load cannot read BF16, numpy having no such dtype)


def kind(stage):
    """'an ENC', 'a LAT', 'a TRACE'."""
    name = STAGES.get(stage, stage)
    return ("an " if name[:1].upper() in "AEIOU" else "a ") + name


@dataclass
class Artifact:
    tensors: dict
    metadata: dict
    sha256: str
    source: str
    foreign: bool = False   # a safetensors file without moss metadata: its model could not be checked

    def meta(self, key):
        try:
            return self.metadata[key]
        except KeyError:
            raise ArtifactError(f"{self.source}: metadata {key!r} is missing") from None


def build(stage, tensors, metadata, fingerprint):
    """Serialise an artifact: stage, format, model and version first, then the stage's own fields."""
    meta = {"moss.stage": stage, "moss.format": FORMAT, "moss.model": fingerprint,
            "moss.version": __version__}
    meta.update({k: str(v) for k, v in metadata.items()})
    return dumps({k: np.ascontiguousarray(v) for k, v in tensors.items()}, meta)


def read_input(path, what, file_kind, error=ArtifactError, option=None):
    """(bytes, source) of PATH, or of stdin for '-'; a failure is one line of type ERROR. WHAT: what the input holds
    ('an artifact'), FILE_KIND what a folder given for it is not ('an artifact file'); OPTION: the option that
    named it, leading its lines."""
    lead = f"{option} {path}: " if option else ""
    if str(path) == "-":
        if sys.stdin is None:
            raise error(f"{lead}stdin is closed; pipe {what} in or give a file name")
        if sys.stdin.isatty():
            raise error(f"{lead}stdin is a terminal; pipe {what} in or give a file name")
        return sys.stdin.buffer.read(), "stdin"
    lead = lead or f"{path}: "
    try:
        return Path(path).read_bytes(), str(path)
    except FileNotFoundError:
        raise error(f"{lead}no such file") from None
    except IsADirectoryError:
        raise error(f"{lead}is a directory, not {file_kind}") from None
    except OSError as e:
        raise error(f"{lead}cannot read ({e.strerror})") from None


def read_bytes(path):
    """The bytes of PATH, or of stdin for '-'."""
    data, source = read_input(path, "an artifact", "an artifact file")
    if source == "stdin" and not data:
        raise ArtifactError("stdin: no data (is the previous command's --out '-'?)")
    return data, source


def parse(data, source, stage, fingerprint=None, merged=False):
    """Check stage, format and model of an artifact's bytes and return it. MERGED: this model has LoRA
    adapters merged (the refusal then says how to match)."""
    if data[:len(PNG_SIGNATURE)] == PNG_SIGNATURE:
        raise ArtifactError(f"{source}: is a PNG picture, not {kind(stage)} file (a safetensors artifact)")
    try:
        tensors, metadata = loads(data)
    except SafetensorsError as e:
        raise ArtifactError(f"{source}: not a valid {STAGES[stage]} file ({e})") from None
    found = metadata.get("moss.stage")
    if found is None:
        tensors = _foreign_tensors(tensors, source, stage)
        return Artifact(tensors, dict(metadata), hashlib.sha256(data).hexdigest(), source, foreign=True)
    if found != stage:
        raise ArtifactError(f"{source}: is {kind(found)} file, expected {STAGES[stage]}")
    if metadata.get("moss.format") != FORMAT:
        raise ArtifactError(f"{source}: artifact format {metadata.get('moss.format')!r} is not {FORMAT!r}")
    if fingerprint is not None and metadata.get("moss.model") != fingerprint:
        lora = ("; a model with LoRA adapters is another model: give every command of a chain the same --lora "
                "options" if merged or "moss.lora" in metadata else "")
        raise ArtifactError(
            f"{source}: made with another model (fingerprint {metadata.get('moss.model', '?')[:12]}, "
            f"this model is {fingerprint[:12]}){lora}")
    return Artifact(dict(tensors), metadata, hashlib.sha256(data).hexdigest(), source)


def _describe(array):
    return f"{array.dtype}{list(array.shape)}"


def _float32(array, source, name, expected):
    if array.dtype == np.float32:
        return array
    if array.dtype.name in WIDENED:
        return array.astype(np.float32)
    raise ArtifactError(f"{source}: {name} is {_describe(array)}, expected {expected} "
                        f"({' or '.join(WIDENED)} are widened to float32)")


def _foreign_tensors(tensors, source, stage):
    """The stage's tensors of a safetensors file without moss metadata, checked for names, dtypes and shapes
    (the model-dependent sizes, text_dim and latent channels, are checked by the stage that uses them)."""
    wanted = FOREIGN_TENSORS.get(stage, ())
    missing = [name for name in wanted if name not in tensors]
    if not wanted or missing:
        found = ", ".join(sorted(tensors)) or "none"
        raise ArtifactError(f"{source}: not a moss-cli artifact (no moss.stage metadata) and not usable as "
                            f"{kind(stage)} file: no {', '.join(missing) or 'known'} tensor (it holds: {found})")
    out = {}
    if stage == "encode":
        for role in ("prompt", "negative"):
            rows, ids = tensors.get(f"{role}_rows"), tensors.get(f"{role}_ids")
            if rows is None and ids is None:
                continue
            if rows is None or ids is None:
                have, lacks = (f"{role}_rows", f"{role}_ids") if ids is None else (f"{role}_ids", f"{role}_rows")
                raise ArtifactError(f"{source}: has {have} but no {lacks}")
            expected = "float32[L, text_dim]"
            if rows.ndim != 2 or rows.shape[0] < 1:
                raise ArtifactError(f"{source}: {role}_rows is {_describe(rows)}, expected {expected}")
            rows = _float32(rows, source, f"{role}_rows", expected)
            if ids.dtype != np.int32 or ids.shape != (rows.shape[0],):
                raise ArtifactError(f"{source}: {role}_ids is {_describe(ids)}, expected int32[{rows.shape[0]}] "
                                    f"(one id per row of {role}_rows)")
            out[f"{role}_rows"], out[f"{role}_ids"] = rows, ids
    else:
        x = tensors["latents"]
        expected = "float32[1, channels, h, w]"
        if x.ndim != 4 or x.shape[0] != 1 or min(x.shape) < 1:
            raise ArtifactError(f"{source}: latents are {_describe(x)}, expected {expected}")
        out["latents"] = _float32(x, source, "latents", expected)
    return out


def mark_foreign_input(data):
    """An artifact's bytes with `moss.input=foreign` added: it was made from a file without moss metadata."""
    tensors, metadata = loads(data)
    return dumps({k: np.ascontiguousarray(v) for k, v in tensors.items()}, {**metadata, "moss.input": "foreign"})


def read(path, stage, fingerprint=None, merged=False):
    data, source = read_bytes(path)
    return parse(data, source, stage, fingerprint, merged)


def _kind_of(path):
    """'regular', 'missing', 'folder', or what a special file is: 'device' (character), 'fifo' (also a
    /dev/fd pipe) or 'other' (block device, socket)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "missing"
    if stat.S_ISREG(mode):
        return "regular"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISCHR(mode):
        return "device"
    return "fifo" if stat.S_ISFIFO(mode) else "other"


def check_writable(path, suffix=None):
    """Fail before any compute when PATH cannot be written (its folder is missing or read-only, it names a
    folder, or it lacks SUFFIX, e.g. '.png'). A character device or a FIFO is written in place, as stdout is."""
    if str(path) == "-":
        if sys.stdout is None:
            raise UsageError("stdout is closed; give a file name or redirect stdout")
        if sys.stdout.isatty():
            raise UsageError("stdout is a terminal; redirect it or pipe it into the next command")
        return
    if str(path).endswith(("/", os.sep)):
        raise UsageError(f"{path}: ends in {str(path)[-1]!r}, so it names a folder; give a file name")
    p = Path(path)
    found = _kind_of(p)
    if found == "folder":
        raise UsageError(f"{path}: is a directory; give a file name")
    if found in ("device", "fifo"):
        if not os.access(p, os.W_OK):
            raise UsageError(f"{path}: is not writable")
        return
    if found == "other":
        raise UsageError(f"{path}: is a block device or a socket, not a file to write; give a file name")
    if suffix and p.suffix.lower() != suffix:
        raise UsageError(f"{path}: the file written is {suffix[1:].upper()}; give a name ending in {suffix} "
                         "(or - for stdout)")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"{path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{path}: folder {folder} is not writable")


def _identity(path):
    """What names the file PATH writes or reads: its device and inode when it exists, else its resolved path;
    None for stdin/stdout and for special files (written in place, never replaced)."""
    if str(path) == "-":
        return None
    found = _kind_of(path)
    if found == "missing":
        return os.path.normcase(os.path.realpath(path))
    if found != "regular":
        return None
    st = os.stat(path)
    return st.st_dev, st.st_ino


def check_apart(outputs, inputs=()):
    """Refuse, before any work, an output that is one of the inputs or another output. OUTPUTS and INPUTS are
    (what, path) pairs, e.g. ('--out', 'a.lat') and ('the input ENC', 'fox.enc')."""
    seen = {}
    for what, path in inputs:
        key = _identity(path)
        if key is not None:
            seen.setdefault(key, (what, path, True))
    for what, path in outputs:
        key = _identity(path)
        if key is None:
            continue
        if key in seen:
            other, other_path, is_input = seen[key]
            if is_input:
                raise UsageError(f"{what} {path}: is {other} {other_path}; writing it would replace the input, "
                                 "give another name")
            raise UsageError(f"{other} {other_path} and {what} {path}: are one file; give each its own name")
        seen[key] = (what, path, False)


def write(path, data):
    """Write DATA to PATH through a temporary name and a rename (a symbolic link's target is replaced, not the
    link), or in place for stdout ('-'), a character device or a FIFO."""
    if str(path) == "-":
        if sys.stdout is None:
            raise UsageError("stdout is closed; give a file name or redirect stdout")
        try:
            _write_stdout(data)
        except OSError as e:
            _drop_stdout()   # else Python's flush at exit fails again, with a second message
            if isinstance(e, BrokenPipeError):
                raise
            raise UsageError(f"stdout: cannot write ({e.strerror or e})") from None
        return
    check_writable(path)
    if _kind_of(path) in ("device", "fifo"):
        _write_in_place(path, data)
        return
    p = Path(os.path.realpath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".part", dir=p.parent)
    except OSError as e:
        raise UsageError(f"{path}: cannot write ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise UsageError(f"{path}: cannot write ({e.strerror})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_in_place(path, data):
    """Write into a character device or a FIFO (which blocks until a reader opens it); never creates a file."""
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
    except OSError as e:
        raise UsageError(f"{path}: cannot write ({e.strerror or e})") from None


def _write_stdout(data):
    out = sys.stdout.buffer
    out.flush()
    try:
        fd = out.fileno()
    except (OSError, ValueError):          # a stream with no descriptor (io.UnsupportedOperation is both)
        out.write(data)
        out.flush()
        return
    _write_all(fd, data)


def _write_all(fd, data):
    """Every byte of DATA to the descriptor FD. A pipe whose reader leaves during a large write takes part of it
    and says so only by the count (a buffered file's write then returns short, and the rest is lost without an
    error); the next write fails with EPIPE (BrokenPipeError)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def _drop_stdout():
    """Point stdout at /dev/null, dropping what is still buffered for it."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
