"""Our PNG bytes (written by Pillow) as Pillow reads them; determinism across processes; damaged files."""

import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from moss_cli.errors import ArtifactError
from moss_cli.png import decode_png, encode_png

rng = np.random.default_rng(5)
# noise rows, smooth rows and flat rows, so the None, Sub and Up filters all get chosen
PIXELS = np.concatenate([
    rng.integers(0, 256, (9, 41, 3), dtype=np.uint8),
    np.broadcast_to((np.arange(41)[:, None] * [3, 5, 7]) % 256, (9, 41, 3)).astype(np.uint8),
    np.full((9, 41, 3), 200, np.uint8),
])
TEXT = {"prompt": "a red fox, 35mm", "seed": "42", "negative": "blurry · café", "prompt_zh": "一只红狐狸"}


def test_pillow_reads_our_pixels_and_text():
    data = encode_png(PIXELS, TEXT)
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG" and image.mode == "RGB" and image.size == (41, 27)
    assert np.array_equal(np.asarray(image), PIXELS)
    assert image.text == TEXT


def test_bytes_are_the_same_in_another_process():
    """No timestamp and fixed filters and zlib level: a second process writes the same bytes."""
    code = ("import sys, numpy as np; from moss_cli.png import encode_png; "
            "rng = np.random.default_rng(5); p = rng.integers(0, 256, (9, 41, 3), dtype=np.uint8); "
            "sys.stdout.buffer.write(encode_png(p, {'parameters': '{\"seed\": 42}', 'zh': '\u4e00'}))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout for _ in range(2)]
    here = encode_png(np.random.default_rng(5).integers(0, 256, (9, 41, 3), dtype=np.uint8),
                      {"zh": "\u4e00", "parameters": '{"seed": 42}'})
    assert runs[0] == runs[1] == here


def test_encoding_is_deterministic_and_decodes_back():
    data = encode_png(PIXELS, TEXT)
    assert encode_png(PIXELS.copy(), dict(reversed(TEXT.items()))) == data
    assert b"tIME" not in data and data.count(b"tEXt") == 3 and data.count(b"iTXt") == 1
    pixels, text = decode_png(data)
    assert np.array_equal(pixels, PIXELS) and text == TEXT


def test_truncated_or_corrupt_files_are_artifact_errors():
    data = encode_png(PIXELS, TEXT)
    for bad in (data[:-1], data[:-12], data[:40], data[:7], b"", b"GIF89a" + data[6:]):
        with pytest.raises(ArtifactError):
            decode_png(bad)
    flipped = bytearray(data)
    flipped[data.index(b"IDAT") + 10] ^= 0xFF
    with pytest.raises(ArtifactError, match="CRC"):
        decode_png(bytes(flipped))
