"""Safetensors files: the library reads artifact bytes; memory-mapped reading and deterministic writing here.

Format: 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape, data_offsets}},
optional "__metadata__" of strings), then the data buffer that the offsets index, with no holes.
BF16 tensors come back as `ml_dtypes.bfloat16` arrays, every other dtype as plain numpy.

What the safetensors library (0.8.0, measured) does and does not do here:
- `loads` (artifact bytes: ENC, LAT, TRACE, foreign files) reads tensors with `safetensors.numpy.load` when
  every dtype is a numpy one. Files holding BF16 or F8 tensors are read here: that loader raises
  KeyError('BF16') on them (numpy has no bf16; its dtype table stops at the numpy types).
- The header is still parsed and checked here, before the library sees the bytes: the library has no way
  to get metadata from bytes (`safe_open` takes only a file name, `deserialize` returns the tensors only),
  and these checks say in one line which tensor is truncated, overlapping or misdescribed.
- `load` (checkpoints) returns read-only views of a memory map. `safe_open(path, "numpy").get_tensor` does
  read BF16, but into a copy: a 400 MB bf16 tensor raised the process's RSS by ~760 MB, where the map
  costs nothing until pages are touched; a checkpoint is ~27 GB.
- `dumps` writes the bytes itself. `safetensors.numpy.save` writes "__metadata__" in the order of a Rust
  hash map that is seeded anew on every call: 10 calls in one process with the same 6 metadata keys gave
  10 different byte strings (PYTHONHASHSEED does not fix it). Artifacts must be the same bytes run to run,
  and the checkpoint fingerprint hashes headers written here; making the library's output deterministic
  would mean re-serialising the header it wrote. Its reader reads these files back (tests check it).
"""

import json
import mmap
import os
import tempfile
from pathlib import Path

import numpy as np

MAX_HEADER = 100_000_000  # the safetensors library's own limit on the JSON header

ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8,
            "F16": 2, "F32": 4, "F64": 8, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"), "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"), "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
LIBRARY_DTYPES = frozenset(DTYPES)   # the dtypes safetensors.numpy.load reads (before ml_dtypes adds BF16, F8)


def _with_ml_dtypes():
    """Add BF16 and F8 (ml_dtypes) on first need: importing ml_dtypes costs about a second."""
    if "BF16" not in DTYPES:
        import ml_dtypes
        extra = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
        for name, dtype in extra.items():
            DTYPES[name] = np.dtype(dtype)
            NAMES[np.dtype(dtype)] = name


class SafetensorsError(ValueError):
    """A safetensors file or buffer is truncated, corrupt or holds something we cannot read."""


def load(path):
    """(tensors, metadata) of the file at `path`; the arrays are read-only views of a memory map."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise SafetensorsError(f"file is {size} bytes, too short for a safetensors header")
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise SafetensorsError(f"cannot read {path.name}: {e.strerror}") from None
    return _tensors(buffer)


def loads(data):
    """(tensors, metadata) from the bytes of a safetensors file, the header checked here.

    Tensors of numpy dtypes come from `safetensors.numpy.load` (writable copies); a file with a BF16 or F8
    tensor, which that loader cannot read, is read here as arrays sharing `data`.
    """
    buffer = memoryview(data).cast("B")
    n = _header_length(bytes(buffer[:8]), len(buffer))
    entries = _parse(bytes(buffer[8:8 + n]), len(buffer) - 8 - n)
    if any(e["dtype"] not in LIBRARY_DTYPES for name, e in entries.items() if name != "__metadata__"):
        return _tensors(buffer)
    import safetensors
    import safetensors.numpy
    try:
        tensors = safetensors.numpy.load(data if type(data) is bytes else bytes(buffer))
    except (safetensors.SafetensorError, ValueError, KeyError) as e:
        raise SafetensorsError(f"the safetensors library cannot read it ({e})") from None
    return tensors, entries.get("__metadata__") or {}


def header(path):
    """(raw JSON header bytes as stored, parsed entries) of the file at `path`, checked against its size.

    Reads only the header, so it is cheap on multi-GB files.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            n = _header_length(prefix, size)
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"cannot read {path.name}: {e.strerror}") from None
    return raw, _parse(raw, size - 8 - n)


def dumps(tensors, metadata=None):
    """The bytes of a safetensors file holding `tensors`, the same bytes for the same input.

    Tensors are laid out in sorted name order; the header is compact JSON with sorted keys, padded
    with spaces to a multiple of 8 bytes. Metadata values must be strings.
    """
    entries, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        if dtype not in NAMES and dtype.type.__module__.startswith("ml_dtypes"):
            _with_ml_dtypes()
        if dtype not in NAMES:
            raise SafetensorsError(f"tensor {name!r}: dtype {array.dtype} cannot be stored in safetensors")
        blob = np.ascontiguousarray(array, dtype=dtype).tobytes()
        entries[name] = {"dtype": NAMES[dtype], "shape": list(array.shape),
                         "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise SafetensorsError(f"metadata {bad[0]!r}: keys and values must be strings")
        entries["__metadata__"] = dict(metadata)
    try:
        raw = json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise SafetensorsError(f"metadata is not valid unicode ({e.reason})") from None
    raw += b" " * (-len(raw) % 8)
    return b"".join([len(raw).to_bytes(8, "little"), raw, *blobs])


def save(path, tensors, metadata=None):
    """Write `dumps(tensors, metadata)` to `path` through a temporary file, so no partial file is left."""
    path = Path(path)
    data = dumps(tensors, metadata)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _tensors(buffer):
    n = _header_length(bytes(buffer[:8]), len(buffer))
    entries = _parse(bytes(buffer[8:8 + n]), len(buffer) - 8 - n)
    metadata = entries.pop("__metadata__", None) or {}
    start = 8 + n
    tensors = {}
    for name, e in entries.items():
        begin, end = e["data_offsets"]
        if e["dtype"] not in DTYPES:
            _with_ml_dtypes()
        dtype = DTYPES[e["dtype"]]
        array = np.frombuffer(buffer, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=start + begin)
        tensors[name] = array.reshape(e["shape"])
    return tensors, metadata


def _header_length(prefix, size):
    if len(prefix) < 8 or size < 8:
        raise SafetensorsError(f"file is {size} bytes, too short for a safetensors header")
    n = int.from_bytes(prefix, "little")
    if n > MAX_HEADER:
        raise SafetensorsError(f"header length {n} is larger than the {MAX_HEADER}-byte limit")
    if 8 + n > size:
        raise SafetensorsError(f"header length {n} runs past the end of the {size}-byte file (truncated?)")
    return n


def _parse(raw, data_size):
    """Parsed header entries, each checked: known dtype, integer shape, offsets inside the data and
    matching shape x itemsize, no overlaps and no holes."""
    try:
        entries = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"header is not valid JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(entries, dict):
        raise SafetensorsError("header is not a JSON object")
    metadata = entries.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise SafetensorsError("header __metadata__ is not a map of strings")
    spans = []
    for name, e in entries.items():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
            raise SafetensorsError(f"tensor {name!r}: header entry needs dtype, shape and data_offsets")
        if e["dtype"] not in ITEMSIZE:
            raise SafetensorsError(f"tensor {name!r}: unsupported dtype {e['dtype']!r}")
        shape, offsets = e["shape"], e["data_offsets"]
        if not (isinstance(shape, list) and all(_count(d) for d in shape)):
            raise SafetensorsError(f"tensor {name!r}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
            raise SafetensorsError(f"tensor {name!r}: bad data_offsets {offsets!r}")
        begin, end = offsets
        if not begin <= end <= data_size:
            raise SafetensorsError(
                f"tensor {name!r}: data_offsets [{begin}, {end}] outside the {data_size}-byte data (truncated?)")
        nbytes = int(np.prod(shape, dtype=object)) * ITEMSIZE[e["dtype"]]
        if end - begin != nbytes:
            raise SafetensorsError(
                f"tensor {name!r}: {end - begin} data bytes for shape {shape} {e['dtype']} ({nbytes} bytes)")
        spans.append((begin, end, name))
    position, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin < position:
            raise SafetensorsError(f"tensor {name!r}: data overlaps tensor {previous!r}")
        if begin > position:
            raise SafetensorsError(f"tensor {name!r}: {begin - position} unindexed bytes before its data")
        position, previous = end, name
    if position != data_size:
        raise SafetensorsError(f"{data_size - position} bytes after the last tensor are not indexed by the header")
    return entries


def _count(x):
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
