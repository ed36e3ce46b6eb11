"""The model fingerprint as documented in moss_cli.checkpoint.fingerprint, computed apart from it."""

import hashlib
import json
import struct

COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "transformer", "vae")
WEIGHTS = {"transformer": "diffusion_pytorch_model", "text_encoder": "model", "vae": "diffusion_pytorch_model"}


def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def fingerprint(root):
    digest = hashlib.sha256(b"moss-cli checkpoint fingerprint v1\n")

    def add(rel, data):
        digest.update(rel.encode() + b"\0" + struct.pack("<Q", len(data)) + data)

    add("model_index.json", (root / "model_index.json").read_bytes())
    for name in COMPONENTS:
        folder = root / name
        for file in sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".jinja", ".txt")):
            add(f"{name}/{file}", (folder / file).read_bytes())
        if name in WEIGHTS:
            index = folder / f"{WEIGHTS[name]}.safetensors.index.json"
            files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
                else [f"{WEIGHTS[name]}.safetensors"]
            for file in files:
                add(f"{name}/{file}#header", _header(folder / file))
    return digest.hexdigest()
