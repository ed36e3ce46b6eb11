"""RGB 8-bit PNG writer and reader, deterministic: equal pixels and text give equal bytes.

Chunks: IHDR, one text chunk per key (sorted by key), one IDAT, IEND; no timestamps. A value that is not
Latin-1 goes into an uncompressed UTF-8 iTXt chunk, since tEXt can only hold Latin-1.
Rows use filter None, Sub or Up, whichever has the smallest sum of |signed bytes| (the libpng heuristic).
"""

import struct
import zlib

import numpy as np

from .errors import ArtifactError, UsageError

SIGNATURE = b"\x89PNG\r\n\x1a\n"
ZLIB_LEVEL = 6
NONE, SUB, UP = 0, 1, 2


def _chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _text_chunk(key, value):
    try:
        k = key.encode("latin-1")
    except UnicodeEncodeError:
        raise UsageError(f"PNG text key {key!r} is not Latin-1") from None
    if not 1 <= len(k) <= 79 or b"\0" in k or key != key.strip():
        raise UsageError(f"PNG text key {key!r} must be 1-79 characters without NUL or outer spaces")
    if "\0" in value:
        raise UsageError(f"PNG text for {key!r} contains NUL")
    try:
        return _chunk(b"tEXt", k + b"\0" + value.encode("latin-1"))
    except UnicodeEncodeError:
        # keyword, compression flag 0, method 0, empty language tag, empty translated keyword
        return _chunk(b"iTXt", k + b"\0\0\0\0\0" + value.encode("utf-8"))


def _filter_rows(pixels):
    """Filtered scanlines, each prefixed by its filter type byte."""
    h, w, _ = pixels.shape
    raw = pixels.reshape(h, w * 3)
    sub = raw.copy()
    sub[:, 3:] -= raw[:, :-3]
    up = raw.copy()
    up[1:] -= raw[:-1]
    options = np.stack([raw, sub, up])                                      # [3, H, W*3] uint8
    cost = np.abs(options.view(np.int8).astype(np.int32)).sum(axis=2)       # [3, H]
    kind = np.argmin(cost, axis=0)                                          # first minimum wins: None < Sub < Up
    rows = options[kind, np.arange(h)]
    return np.concatenate([kind.astype(np.uint8)[:, None], rows], axis=1).tobytes()


def encode_png(pixels, text):
    """PNG bytes of pixels uint8 [H, W, 3] with one text chunk per entry of text."""
    pixels = np.ascontiguousarray(pixels)
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3 or 0 in pixels.shape:
        raise UsageError(f"PNG pixels must be uint8 [H, W, 3], got {pixels.dtype} {list(pixels.shape)}")
    h, w, _ = pixels.shape
    out = [SIGNATURE, _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))]
    out += [_text_chunk(k, text[k]) for k in sorted(text)]
    out += [_chunk(b"IDAT", zlib.compress(_filter_rows(pixels), ZLIB_LEVEL)), _chunk(b"IEND", b"")]
    return b"".join(out)


def _chunks(data):
    """(type, payload) of each chunk, CRC-checked, through IEND."""
    if data[:8] != SIGNATURE:
        raise ArtifactError("not a PNG file")
    pos = 8
    while True:
        if pos + 8 > len(data):
            raise ArtifactError("PNG is truncated")
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        end = pos + 8 + n + 4
        if end > len(data):
            raise ArtifactError("PNG is truncated")
        body = data[pos + 8:end - 4]
        if zlib.crc32(kind + body) != struct.unpack(">I", data[end - 4:end])[0]:
            raise ArtifactError(f"PNG chunk {kind.decode('latin-1')!r} is corrupt (CRC mismatch)")
        yield kind, body
        if kind == b"IEND":
            return
        pos = end


def _read_text(kind, body):
    key, _, rest = body.partition(b"\0")
    if kind == b"tEXt":
        return key.decode("latin-1"), rest.decode("latin-1")
    compressed, _method, rest = rest[0], rest[1], rest[2:]
    _lang, _, rest = rest.partition(b"\0")
    _translated, _, value = rest.partition(b"\0")
    if compressed:
        value = zlib.decompress(value)
    return key.decode("latin-1"), value.decode("utf-8")


def _unfilter(scan, h, w):
    rows = scan.reshape(h, 1 + w * 3)
    out = np.empty((h, w * 3), dtype=np.uint8)
    prior = np.zeros(w * 3, dtype=np.uint8)
    for y in range(h):
        kind, row = rows[y, 0], rows[y, 1:]
        if kind == NONE:
            out[y] = row
        elif kind == SUB:
            out[y] = np.cumsum(row.reshape(w, 3), axis=0, dtype=np.uint8).reshape(-1)
        elif kind == UP:
            out[y] = row + prior
        else:
            raise ArtifactError(f"PNG row filter {kind} is not one moss-cli writes")
        prior = out[y]
    return out.reshape(h, w, 3)


def decode_png(data):
    """(pixels uint8 [H, W, 3], text dict) of a PNG written by encode_png."""
    header, text, idat = None, {}, []
    for kind, body in _chunks(bytes(data)):
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body) if len(body) == 13 else None
        elif kind in (b"tEXt", b"iTXt"):
            try:
                key, value = _read_text(kind, body)
            except (IndexError, UnicodeDecodeError, zlib.error):
                raise ArtifactError(f"PNG {kind.decode()} chunk is malformed") from None
            text[key] = value
        elif kind == b"IDAT":
            idat.append(body)
    if header is None:
        raise ArtifactError("PNG has no valid IHDR")
    w, h, depth, color, _, _, interlace = header
    if (depth, color, interlace) != (8, 2, 0):
        raise ArtifactError(f"PNG is not 8-bit RGB non-interlaced (depth {depth}, color {color}, interlace {interlace})")
    try:
        scan = zlib.decompress(b"".join(idat))
    except zlib.error:
        raise ArtifactError("PNG image data is corrupt") from None
    if len(scan) != h * (1 + w * 3):
        raise ArtifactError(f"PNG image data has {len(scan)} bytes, expected {h * (1 + w * 3)}")
    return _unfilter(np.frombuffer(scan, dtype=np.uint8), h, w), text
