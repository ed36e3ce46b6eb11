"""Our PNG bytes as Pillow and zlib read them, the Paeth rows against the specification's own statement;
determinism across processes; damaged files."""

import io
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image

from moss_cli import png
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


def _paeth_by_the_book(pixels):
    """The filtered rows of PNG's Paeth filter, byte by byte as the PNG specification states it (ISO 15948 9.4)."""
    h, w, _ = pixels.shape
    x = pixels.reshape(h, 3 * w).astype(int)
    out = []
    for r in range(h):
        row = [4]
        for i in range(3 * w):
            a = x[r, i - 3] if i >= 3 else 0
            b = x[r - 1, i] if r else 0
            c = x[r - 1, i - 3] if r and i >= 3 else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
            row.append((x[r, i] - pred) % 256)
        out.append(row)
    return bytes(np.array(out, np.uint8).tobytes())


def _idat(data):
    """The concatenated IDAT payload of PNG bytes."""
    pos, body = 8, b""
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        if data[pos + 4:pos + 8] == b"IDAT":
            body += data[pos + 8:pos + 8 + n]
        pos += 12 + n
    return body


@pytest.mark.parametrize("band_bytes", [1, 3 * 41 + 1, 5 * (3 * 41 + 1) - 1, 1 << 18])
def test_bands_join_into_one_zlib_stream_of_paeth_rows(band_bytes):
    """A band a row, several rows a band, or one band: zlib inflates one stream (its Adler-32 checked) into the
    rows the specification's Paeth filter gives, and Pillow reads the same pixels."""
    data = encode_png(PIXELS, TEXT, band_bytes=band_bytes)
    assert zlib.decompress(_idat(data)) == _paeth_by_the_book(PIXELS)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), PIXELS)


def test_adler32_join_equals_zlib_over_the_whole():
    r = np.random.default_rng(3)
    for n, m in ((0, 0), (1, 0), (0, 7), (5552, 5553), (70000, 3), (3, 200000)):
        a, b = r.integers(0, 256, n, dtype=np.uint8).tobytes(), r.integers(0, 256, m, dtype=np.uint8).tobytes()
        assert png._adler32_join(zlib.adler32(a), zlib.adler32(b), len(b)) == zlib.adler32(a + b)


def test_a_planted_tie_break_is_caught(monkeypatch):
    """Control: a tie between the up and up-left predictions taken the other way (c before b) gives other
    bytes, and Pillow other pixels (a tie between left and up changes nothing: it implies c = (a + b) / 2)."""
    def wrong(rows, above):
        x = rows.reshape(rows.shape[0], -1).astype(np.int16)
        b = np.concatenate([above.reshape(1, -1).astype(np.int16), x[:-1]])
        a = np.zeros_like(x)
        a[:, 3:] = x[:, :-3]
        c = np.zeros_like(x)
        c[:, 3:] = b[:, :-3]
        pa, pb, pc = np.abs(b - c), np.abs(a - c), np.abs(a + b - 2 * c)
        pred = np.where((pa <= pb) & (pa <= pc), a, np.where(pc <= pb, c, b))
        return np.concatenate([np.full((x.shape[0], 1), 4, np.uint8), (x - pred).astype(np.uint8)], axis=1)
    monkeypatch.setattr(png, "paeth_rows", wrong)
    data = encode_png(PIXELS, TEXT, band_bytes=3 * 41 + 1)
    assert zlib.decompress(_idat(data)) != _paeth_by_the_book(PIXELS)
    assert not np.array_equal(np.asarray(Image.open(io.BytesIO(data))), PIXELS)
