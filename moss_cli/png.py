"""RGB 8-bit PNG through Pillow, deterministic: equal pixels and text give equal bytes.

Pillow writes IHDR, one text chunk per key (in the order given: sorted by key here), the image data and
IEND, and no timestamp (tIME) unless asked; a value that is not Latin-1 goes into an uncompressed UTF-8 iTXt
chunk, since tEXt can only hold Latin-1. Its row filters (adaptive) and zlib level (ZLIB_LEVEL) are fixed,
so the bytes depend only on the pixels, the text and the Pillow build (its bundled zlib): two runs, or two
processes, with one installation write identical files (tests/test_png.py checks it across processes).
Reading goes through Pillow too, with `verify()` first so that a damaged chunk (CRC mismatch) or a truncated
file is refused rather than decoded into wrong pixels.
"""

import io

import numpy as np

from .errors import ArtifactError, UsageError

ZLIB_LEVEL = 6
SIGNATURE = b"\x89PNG\r\n\x1a\n"
IEND = b"\0\0\0\0IEND\xaeB`\x82"     # the last 12 bytes of every complete PNG (Pillow reads past a missing one)


def _text_info(text):
    from PIL import PngImagePlugin
    info = PngImagePlugin.PngInfo()
    for key in sorted(text):
        value = text[key]
        try:
            k = key.encode("latin-1")
        except UnicodeEncodeError:
            raise UsageError(f"PNG text key {key!r} is not Latin-1") from None
        if not 1 <= len(k) <= 79 or b"\0" in k or key != key.strip():
            raise UsageError(f"PNG text key {key!r} must be 1-79 characters without NUL or outer spaces")
        if "\0" in value:
            raise UsageError(f"PNG text for {key!r} contains NUL")
        info.add_text(key, value)        # tEXt when Latin-1, else uncompressed iTXt
    return info


def encode_png(pixels, text):
    """PNG bytes of pixels uint8 [H, W, 3] with one text chunk per entry of text."""
    from PIL import Image
    pixels = np.ascontiguousarray(pixels)
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3 or 0 in pixels.shape:
        raise UsageError(f"PNG pixels must be uint8 [H, W, 3], got {pixels.dtype} {list(pixels.shape)}")
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG", pnginfo=_text_info(text), compress_level=ZLIB_LEVEL)
    return out.getvalue()


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
