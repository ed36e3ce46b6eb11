"""RGB 8-bit PNG, written here and read through Pillow; deterministic: equal pixels and text give equal bytes.

Writing: IHDR, one text chunk per key (sorted by key: tEXt when the value is Latin-1, else an uncompressed
UTF-8 iTXt, as Pillow writes them), one IDAT, IEND; no timestamp. Every row takes the Paeth filter, and the
filtered rows are deflated in bands of BAND_BYTES (whole rows) at ZLIB_LEVEL, each band in its own thread
and ended with a sync flush, so the bands join into one zlib stream whose Adler-32 covers them all. The bands
are fixed by the picture's width, not by the machine's cores, so the bytes depend only on the pixels, the
text and the zlib build: two runs, or two processes, with one installation write identical files
(tests/test_png.py checks it across processes). A 1024x1024 picture takes 0.27 s through Pillow's
single-threaded writer and 0.03 s here on 16 cores (BENCHMARKS.md, the whole picture).
Reading goes through Pillow, with `verify()` first so that a damaged chunk (CRC mismatch) or a truncated
file is refused rather than decoded into wrong pixels.
"""

import io
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .errors import ArtifactError, UsageError

ZLIB_LEVEL = 6
BAND_BYTES = 1 << 18                  # filtered bytes a deflate band holds (whole rows, at least one)
PAETH = 4                             # the row filter type byte
SIGNATURE = b"\x89PNG\r\n\x1a\n"
IEND = b"\0\0\0\0IEND\xaeB`\x82"     # the last 12 bytes of every complete PNG (Pillow reads past a missing one)


def _text_chunk(key, value):
    """(type, data) of one text entry."""
    try:
        k = key.encode("latin-1")
    except UnicodeEncodeError:
        raise UsageError(f"PNG text key {key!r} is not Latin-1") from None
    if not 1 <= len(k) <= 79 or b"\0" in k or key != key.strip():
        raise UsageError(f"PNG text key {key!r} must be 1-79 characters without NUL or outer spaces")
    if "\0" in value:
        raise UsageError(f"PNG text for {key!r} contains NUL")
    try:
        return b"tEXt", k + b"\0" + value.encode("latin-1")
    except UnicodeEncodeError:      # iTXt: no compression, empty language tag and translated keyword
        return b"iTXt", k + b"\0\0\0\0\0" + value.encode("utf-8")


def _chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)))


def paeth_rows(rows, above):
    """Rows uint8 [n, W, 3] Paeth-filtered, each with its filter byte first: uint8 [n, 1 + 3W]. `above` is
    the row before the first (uint8 [W, 3]; zeros for the picture's first row)."""
    x = rows.reshape(rows.shape[0], -1).astype(np.int16)
    b = np.concatenate([above.reshape(1, -1).astype(np.int16), x[:-1]])   # up
    a = np.zeros_like(x)
    a[:, 3:] = x[:, :-3]                                                      # left (same channel)
    c = np.zeros_like(x)
    c[:, 3:] = b[:, :-3]                                                      # up-left
    pa, pb, pc = np.abs(b - c), np.abs(a - c), np.abs(a + b - 2 * c)
    pred = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))
    out = np.empty((x.shape[0], 1 + x.shape[1]), np.uint8)
    out[:, 0] = PAETH
    out[:, 1:] = (x - pred).astype(np.uint8)          # modulo 256
    return out


def _band(pixels, start, stop, last):
    """The deflated Paeth rows [start, stop) (a sync flush after a band that is not the last) and the raw bytes'
    length; zlib releases the GIL while it works, and so does numpy's arithmetic on whole arrays."""
    above = pixels[start - 1] if start else np.zeros_like(pixels[0])
    raw = paeth_rows(pixels[start:stop], above).tobytes()
    engine = zlib.compressobj(ZLIB_LEVEL, zlib.DEFLATED, -15)
    body = engine.compress(raw) + engine.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)
    return body, zlib.adler32(raw), len(raw)


def _adler32_join(first, second, length):
    """Adler-32 of A + B from adler32(A), adler32(B) and len(B) (zlib's adler32_combine, which Python lacks)."""
    base = 65521
    a1, b1, a2, b2 = first & 0xFFFF, first >> 16, second & 0xFFFF, second >> 16
    a = (a1 + a2 - 1) % base
    b = (b1 + b2 + length * (a1 - 1)) % base     # B's own sums started from 1: the shift each of its bytes adds
    return (b << 16) | a


def _image_data(pixels, band_bytes=BAND_BYTES):
    height, width = pixels.shape[:2]
    rows = max(1, band_bytes // (1 + 3 * width))
    bands = [(r, min(r + rows, height)) for r in range(0, height, rows)]
    jobs = [(pixels, a, b, b == height) for a, b in bands]
    if len(jobs) == 1:
        parts = [_band(*jobs[0])]
    else:
        with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
            parts = list(pool.map(lambda job: _band(*job), jobs))
    check = 1
    for _, adler, length in parts:
        check = _adler32_join(check, adler, length)
    return b"\x78\x9c" + b"".join(body for body, _, _ in parts) + struct.pack(">I", check)


def encode_png(pixels, text, band_bytes=BAND_BYTES):
    """PNG bytes of pixels uint8 [H, W, 3] with one text chunk per entry of text."""
    pixels = np.ascontiguousarray(pixels)
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3 or 0 in pixels.shape:
        raise UsageError(f"PNG pixels must be uint8 [H, W, 3], got {pixels.dtype} {list(pixels.shape)}")
    height, width = pixels.shape[:2]
    chunks = [_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))]
    chunks += [_chunk(*_text_chunk(key, text[key])) for key in sorted(text)]
    chunks += [_chunk(b"IDAT", _image_data(pixels, band_bytes)), IEND]
    return SIGNATURE + b"".join(chunks)


def decode_png(data):
    """(pixels uint8 [H, W, 3], text dict) of an 8-bit RGB PNG."""
    from PIL import Image, UnidentifiedImageError
    data = bytes(data)
    if not data.startswith(SIGNATURE):
        raise ArtifactError("not a PNG file")
    if not data.endswith(IEND):
        raise ArtifactError("PNG is truncated (it does not end with IEND)")
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()                  # every chunk's CRC, through IEND
        with Image.open(io.BytesIO(data)) as image:
            if image.format != "PNG":
                raise ArtifactError(f"not a PNG file ({image.format})")
            if image.mode != "RGB":
                raise ArtifactError(f"PNG is not 8-bit RGB (mode {image.mode})")
            image.load()
            return np.asarray(image, dtype=np.uint8).copy(), dict(image.text)
    except UnidentifiedImageError:
        raise ArtifactError("not a PNG file") from None
    except (SyntaxError, OSError, ValueError, EOFError) as e:
        message = str(e)
        if "checksum" in message or "crc" in message.lower():
            raise ArtifactError(f"PNG is corrupt (CRC mismatch: {message})") from None
        raise ArtifactError(f"PNG is truncated or corrupt ({message})") from None
