"""ENC, LAT and TRACE artifacts: safetensors files with string metadata, written atomically.

Every artifact names its stage (`moss.stage`) and the model it came from (`moss.model`, the checkpoint
fingerprint), so a file from another stage or another model is refused with one line.
"""

import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import __version__
from .errors import ArtifactError, UsageError
from .safetensors_io import SafetensorsError, dumps, loads

FORMAT = "1"
STAGES = {"encode": "ENC", "denoise": "LAT", "trace": "TRACE"}


@dataclass
class Artifact:
    tensors: dict
    metadata: dict
    sha256: str
    source: str

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


def read_bytes(path):
    """The bytes of PATH, or of stdin for '-'."""
    if str(path) == "-":
        if sys.stdin.isatty():
            raise ArtifactError("stdin is a terminal; pipe an artifact in or give a file name")
        data = sys.stdin.buffer.read()
        if not data:
            raise ArtifactError("stdin: no data (is the previous command's --out '-'?)")
        return data, "stdin"
    try:
        return Path(path).read_bytes(), str(path)
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ArtifactError(f"{path}: is a directory, not an artifact file") from None
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read ({e.strerror})") from None


def parse(data, source, stage, fingerprint=None):
    """Check stage, format and model of an artifact's bytes and return it."""
    try:
        tensors, metadata = loads(data)
    except SafetensorsError as e:
        raise ArtifactError(f"{source}: not a valid {STAGES[stage]} file ({e})") from None
    found = metadata.get("moss.stage")
    if found is None:
        raise ArtifactError(f"{source}: not a moss-cli artifact (no moss.stage metadata)")
    if found != stage:
        raise ArtifactError(f"{source}: is a {STAGES.get(found, found)} file, expected {STAGES[stage]}")
    if metadata.get("moss.format") != FORMAT:
        raise ArtifactError(f"{source}: artifact format {metadata.get('moss.format')!r} is not {FORMAT!r}")
    if fingerprint is not None and metadata.get("moss.model") != fingerprint:
        raise ArtifactError(
            f"{source}: made with another model (fingerprint {metadata.get('moss.model', '?')[:12]}, "
            f"this model is {fingerprint[:12]})")
    return Artifact(dict(tensors), metadata, hashlib.sha256(data).hexdigest(), source)


def read(path, stage, fingerprint=None):
    data, source = read_bytes(path)
    return parse(data, source, stage, fingerprint)


def check_writable(path):
    """Fail before any compute when PATH cannot be written (its folder is missing or read-only)."""
    if str(path) == "-":
        if sys.stdout.isatty():
            raise UsageError("stdout is a terminal; redirect it or pipe it into the next command")
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{path}: is a directory; give a file name")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"{path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{path}: folder {folder} is not writable")


def write(path, data):
    """Write DATA to PATH through a temporary name and a rename, or to stdout for '-'."""
    if str(path) == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    p = Path(path)
    check_writable(p)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".part", dir=p.parent if str(p.parent) else ".")
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
