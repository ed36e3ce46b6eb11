"""The safetensors reader/writer against the safetensors library, both directions, and on broken files."""

import json
import mmap
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch

from moss_cli.safetensors_io import SafetensorsError, dumps, header, load, loads, save

BF16 = np.dtype(ml_dtypes.bfloat16)


def sample():
    rng = np.random.default_rng(0)
    return {
        "layers.1.w": rng.normal(size=(3, 5)).astype(np.float32),
        "layers.0.w": rng.normal(size=(4,)).astype(BF16),
        "half": rng.normal(size=(2, 2)).astype(np.float16),
        "ids": np.arange(7, dtype=np.int32),
        "count": np.array(12345678901, dtype=np.int64),
        "bytes": np.arange(5, dtype=np.uint8),
        "empty": np.zeros((0, 3), np.float32),
    }


def as_numpy(t):
    """A torch tensor as numpy, bf16 through its bits."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def test_our_bytes_read_by_the_library():
    tensors = sample()
    data = dumps(tensors, {"moss.stage": "encode", "note": "café ✓"})
    back = safetensors.torch.load(data)
    assert sorted(back) == sorted(tensors)
    for name, value in tensors.items():
        got = as_numpy(back[name])
        assert got.dtype == value.dtype and got.shape == value.shape
        assert got.tobytes() == value.tobytes()


def test_library_bytes_read_by_us(tmp_path):
    tensors = {n: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if v.dtype == BF16 else torch.from_numpy(v)
               for n, v in sample().items()}
    path = tmp_path / "lib.safetensors"
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt", "k": "v"})
    for got, meta in (load(path), loads(path.read_bytes())):
        assert meta == {"format": "pt", "k": "v"}
        assert sorted(got) == sorted(tensors)
        for name, t in tensors.items():
            assert got[name].dtype == as_numpy(t).dtype
            assert got[name].shape == tuple(t.shape)
            assert got[name].tobytes() == as_numpy(t).tobytes()


def test_dumps_is_deterministic_sorted_and_padded():
    tensors = sample()
    data = dumps(tensors, {"b": "2", "a": "1"})
    assert data == dumps(dict(reversed(tensors.items())), {"a": "1", "b": "2"})
    n = int.from_bytes(data[:8], "little")
    assert n % 8 == 0
    raw = data[8:8 + n]
    parsed = json.loads(raw)
    assert raw.rstrip(b" ") == json.dumps(parsed, sort_keys=True, separators=(",", ":")).encode()
    starts = [parsed[k]["data_offsets"][0] for k in sorted(tensors)]
    assert starts == sorted(starts)   # data laid out in name order


def test_load_is_memory_mapped_and_read_only(tmp_path):
    path = tmp_path / "x.safetensors"
    save(path, sample())
    tensors, _ = load(path)
    base = tensors["layers.1.w"]
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, (mmap.mmap, memoryview))
    assert not tensors["layers.1.w"].flags.writeable
    assert not tensors["layers.1.w"].flags.owndata


def test_header_returns_the_stored_bytes(tmp_path):
    path = tmp_path / "x.safetensors"
    save(path, sample(), {"k": "v"})
    data = path.read_bytes()
    raw, parsed = header(path)
    assert raw == data[8:8 + int.from_bytes(data[:8], "little")]
    assert parsed["__metadata__"] == {"k": "v"}
    assert parsed["ids"]["shape"] == [7] and parsed["ids"]["dtype"] == "I32"


def file_with(entries, data=b"", raw=None):
    raw = json.dumps(entries).encode() if raw is None else raw
    return len(raw).to_bytes(8, "little") + raw + data


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}
BROKEN = {
    "short file": (b"\x10\x00\x00", "too short"),
    "header length beyond file": (b"\xff\x00\x00\x00\x00\x00\x00\x00{}", "past the end"),
    "bad JSON": (file_with({}, raw=b"{not json"), "not valid JSON"),
    "header not an object": (file_with({}, raw=b"[1, 2]"), "not a JSON object"),
    "unknown dtype": (file_with({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), "'a'"),
    "truncated data": (file_with(GOOD, bytes(10)), "'b'"),
    "overlapping offsets": (file_with({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                       "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)),
                            "overlaps"),
    "size != shape x dtype": (file_with({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)), "'a'"),
    "hole before a tensor": (file_with({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)),
                             "unindexed"),
    "trailing bytes": (file_with(GOOD, bytes(16)), "not indexed"),
    "negative shape": (file_with({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)), "'a'"),
    "metadata not strings": (file_with({"__metadata__": {"k": 1}}), "__metadata__"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_input_is_refused_by_us_and_by_the_library(case, tmp_path):
    data, words = BROKEN[case]
    with pytest.raises(SafetensorsError, match=words) as info:
        loads(data)
    assert "\n" not in str(info.value)
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(SafetensorsError, match=words):
        load(path)
    with pytest.raises(Exception):
        safetensors.torch.load(data)


def test_good_reference_file_is_accepted():
    tensors, _ = loads(file_with(GOOD, np.arange(3, dtype=np.float32).tobytes()))
    assert tensors["a"].tolist() == [0.0, 1.0] and tensors["b"].tolist() == [2.0]


def test_unstorable_input_is_refused():
    with pytest.raises(SafetensorsError, match="'c'"):
        dumps({"c": np.zeros(2, np.complex64)})
    with pytest.raises(SafetensorsError, match="strings"):
        dumps({}, {"k": 3})


def test_save_leaves_no_partial_file(tmp_path):
    path = tmp_path / "out.safetensors"
    with pytest.raises(SafetensorsError):
        save(path, {"c": np.zeros(2, np.complex64)})
    assert list(tmp_path.iterdir()) == []


def test_float32_files_do_not_import_ml_dtypes(tmp_path):
    """ml_dtypes takes about a second to import; LAT, ENC and VAE files need none of it."""
    path = tmp_path / "f32.safetensors"
    save(path, {"latents": np.zeros((1, 128, 2, 2), np.float32)})
    code = ("import sys, pathlib; from moss_cli.safetensors_io import load, loads; "
            f"t, _ = load({str(path)!r}); u, _ = loads(pathlib.Path({str(path)!r}).read_bytes()); "
            "print(t['latents'].shape, u['latents'].shape, 'ml_dtypes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["(1,", "128,", "2,", "2)"] * 2 + ["False"]


def test_loads_reads_numpy_dtypes_through_the_library(monkeypatch):
    """Artifact bytes (float32, int32, ...) are read by safetensors.numpy.load; BF16 ones, which it cannot
    read (KeyError 'BF16'), by our reader."""
    import safetensors.numpy
    calls = []
    real = safetensors.numpy.load
    monkeypatch.setattr(safetensors.numpy, "load", lambda data: calls.append(len(data)) or real(data))
    plain = {k: v for k, v in sample().items() if v.dtype != BF16}
    data = dumps(plain, {"moss.stage": "encode"})
    tensors, meta = loads(data)
    assert calls == [len(data)] and meta == {"moss.stage": "encode"}
    assert {k: (v.dtype, v.shape, v.tobytes()) for k, v in tensors.items()} == \
        {k: (v.dtype, v.shape, v.tobytes()) for k, v in plain.items()}
    with pytest.raises(KeyError, match="BF16"):
        real(dumps(sample()))
    tensors, _ = loads(dumps(sample()))
    assert calls == [len(data)]                  # not called for the file with a BF16 tensor
    assert tensors["layers.0.w"].dtype == BF16 and tensors["layers.0.w"].tobytes() == sample()["layers.0.w"].tobytes()


def test_broken_headers_keep_our_messages_before_the_library_sees_them(monkeypatch):
    import safetensors.numpy
    monkeypatch.setattr(safetensors.numpy, "load", lambda data: pytest.fail("library called on a broken file"))
    for data, words in BROKEN.values():
        with pytest.raises(SafetensorsError, match=words):
            loads(data)


ARTIFACT_WRITER = """
import sys
import numpy as np
from moss_cli.artifacts import build
rng = np.random.default_rng(1)
tensors = {"prompt_rows": rng.normal(size=(5, 8)).astype(np.float32), "prompt_ids": np.arange(5, dtype=np.int32),
           "negative_rows": rng.normal(size=(2, 8)).astype(np.float32), "negative_ids": np.arange(2, dtype=np.int32)}
meta = {"prompt": "a red fox", "negative": "", "seed": 5, "steps": 3, "width": 64, "height": 48, "z": "last"}
sys.stdout.buffer.write(build("encode", tensors, meta, "f" * 64))
"""


def test_artifact_bytes_are_identical_across_processes_and_read_by_the_library(tmp_path):
    """The reason dumps is ours: the same artifact written by separate processes is the same bytes (the
    library's save orders metadata by a hash map seeded per call), and the library reads it back."""
    import safetensors
    import safetensors.numpy
    outs = [subprocess.run([sys.executable, "-c", ARTIFACT_WRITER], capture_output=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout
            for seed in (0, 1, 2)]
    assert outs[0] and outs[0] == outs[1] == outs[2]
    ours, meta = loads(outs[0])
    lib = safetensors.numpy.load(outs[0])
    assert sorted(lib) == sorted(ours)
    for name, value in ours.items():
        assert lib[name].dtype == value.dtype and lib[name].tobytes() == value.tobytes()
    path = tmp_path / "p.enc"
    path.write_bytes(outs[0])
    with safetensors.safe_open(str(path), "numpy") as f:
        assert f.metadata() == meta
    assert meta["moss.stage"] == "encode" and meta["seed"] == "5"
