"""The MOSS-Image model folder: model_index.json plus five diffusers components, checked before use.

Opening a checkpoint reads only small files (model_index.json, configs, safetensors headers): it
checks that every tensor each graph will read is present with the right shape and a float32/bf16
dtype, and computes the model fingerprint. Weights are memory-mapped when a component is asked for.
"""

import hashlib
import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Mapping

from . import safetensors_io
from .errors import CheckpointError

EMBEDDED = Path(str(resources.files("moss_cli") / "tiny"))
ENV = "MOSS_IMAGE_MODEL"

PIPELINE_CLASS = "MOSSImagePipeline"
# model_index.json entry -> the class names accepted for it (None: any)
COMPONENT_CLASSES = {
    "transformer": {"MOSSImageTransformer"},
    "text_encoder": {"Qwen3_5Model", "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5TextModel"},
    "vae": {"AutoencoderKLFlux2"},
    "scheduler": {"MOSSImageScheduler"},
    "tokenizer": None,
}
CONFIG_FILES = {"transformer": "config.json", "text_encoder": "config.json", "vae": "config.json",
                "scheduler": "scheduler_config.json", "tokenizer": "tokenizer_config.json"}
WEIGHT_FILES = {"transformer": "diffusion_pytorch_model", "text_encoder": "model", "vae": "diffusion_pytorch_model"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
FLOAT_DTYPES = {"F32", "BF16"}

# Text-encoder roots by how the model was saved: Qwen3_5ForConditionalGeneration, MLX/vLLM tools,
# Qwen3_5ForCausalLM, Qwen3_5TextModel. Longest first, since "model." prefixes the first.
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")
TEXT_MODULES = ("embed_tokens.", "layers.", "norm.")

# Files that enter the fingerprint besides safetensors headers: configs, index and tokenizer files.
FINGERPRINT_SUFFIXES = (".json", ".jinja", ".txt")
FINGERPRINT_TAG = b"moss-cli checkpoint fingerprint v1\n"


@dataclass(frozen=True)
class Component:
    """One component folder: its config and its tensors (memory-mapped, text prefix stripped)."""
    name: str
    path: Path
    config: dict = field(repr=False)
    tensors: Mapping = field(repr=False)


@dataclass(frozen=True)
class _Weights:
    files: tuple        # safetensors files, relative to the component folder
    headers: dict       # file -> its raw JSON header (what the fingerprint hashes)
    entries: dict       # stripped tensor name -> (stored name, file, dtype, shape)


class Checkpoint:
    """A validated MOSS-Image folder. Components are loaded (memory-mapped) on first request; `component` has the
    adapters' deltas merged into the weights they touch (lora.merge, on the host), `base_component` is the
    folder's own (what the GPU uploads, then merges there). `fingerprint` names the merged model
    (lora.fingerprint), `base_fingerprint` the folder's own."""

    def __init__(self, root, model_index, configs, weights, fingerprint, adapters=(), base=None):
        self.root = root
        self.model_index = model_index
        self.base_fingerprint = fingerprint
        self.adapters = tuple(adapters)
        self._configs = configs
        self._weights = weights
        self._base = {} if base is None else base     # name -> base Component, shared with with_adapters' views
        self._loaded = {}
        if self.adapters:
            from . import lora
            self.fingerprint = lora.fingerprint(fingerprint, self.adapters)
        else:
            self.fingerprint = fingerprint

    def with_adapters(self, adapters):
        """This folder with ADAPTERS (lora.Adapter, in order) in place of its own; one at scale 0 changes no
        weight and is left out. The base components are shared: loaded once for every view."""
        return Checkpoint(self.root, self.model_index, self._configs, self._weights, self.base_fingerprint,
                          [a for a in adapters if a.scale != 0], self._base)

    def read_adapters(self, lora):
        """The lora.Adapter of each (adapter file, scale) pair, read and checked against the weights' shapes (all
        of them, scale 0 too). Raises LoraError in one line."""
        from . import lora as lora_io
        shapes = self.shapes()
        stems = lora_io.index(shapes)
        return [lora_io.read(file, scale, shapes, stems) for file, scale in lora]

    def shapes(self):
        """{component: {tensor name: shape}} from the safetensors headers (text-encoder prefix stripped)."""
        return {name: {key: shape for key, (_, _, _, shape) in w.entries.items()} for name, w in self._weights.items()}

    def config(self, name):
        if name not in self._configs:
            raise CheckpointError(f"{self.root}: no component {name!r}")
        return self._configs[name]

    def component(self, name):
        """The component with the adapters merged into its weights on the host (the base one where none
        touches it)."""
        if not any(name in a.components for a in self.adapters):
            return self.base_component(name)
        if name not in self._loaded:
            from . import lora
            base = self.base_component(name)
            self._loaded[name] = Component(name, base.path, base.config, lora.merge(name, base.tensors, self.adapters))
        return self._loaded[name]

    def base_component(self, name):
        """The component as the folder holds it, no adapter merged (one tensors mapping for every view)."""
        if name not in self._base:
            self._base[name] = self._load(name)
        return self._base[name]

    def _load(self, name):
        folder = self.root / name
        weights = self._weights.get(name)
        tensors = {}
        if weights is not None:
            opened = {}
            for file in weights.files:
                try:
                    opened[file] = safetensors_io.load(folder / file)[0]
                except safetensors_io.SafetensorsError as e:
                    raise CheckpointError(f"{folder / file}: corrupt or truncated safetensors file ({e})") from None
            for key, (stored, file, _, shape) in weights.entries.items():
                array = opened[file].get(stored)
                if array is None or array.shape != shape:
                    raise CheckpointError(f"{folder / file}: changed since the checkpoint was opened ({stored})")
                tensors[key] = array
        return Component(name, folder, self.config(name), tensors)

    def __repr__(self):
        return f"Checkpoint({str(self.root)!r}, fingerprint={self.fingerprint[:12]})"


def expected_tensors(name, config):
    """{tensor name: shape} that the graph of component `name` reads, from the graph module itself."""
    if name == "transformer":
        from . import transformer
        return transformer.expected_tensors(config)
    if name == "text_encoder":
        from . import encoder
        return encoder.expected_tensors(encoder.text_config(config))
    if name == "vae":
        from . import vae
        return vae.expected_tensors(config)
    raise KeyError(name)


def open_checkpoint(path=None, *, expected=expected_tensors, lora=()):
    """Open and validate a MOSS-Image folder: `path`, else $MOSS_IMAGE_MODEL, else the embedded tiny one.

    `expected(component, config) -> {name: shape}` lists what each graph reads (tests may pass their own).
    `lora`: (adapter file, scale) pairs, each read and checked against the weights' shapes now and merged when
    its components load; one at scale 0 changes no weight, so it is checked and then left out (the model is
    the base one, its fingerprint too).
    Raises CheckpointError naming the folder, component, file, tensor or shape that is wrong, LoraError for
    an adapter that does not fit.
    """
    if path is None or str(path) == "":
        path = os.environ.get(ENV) or EMBEDDED
    root = Path(path).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"{root}: model folder does not exist" if not root.exists()
                              else f"{root}: not a folder (a checkpoint is a diffusers model folder)")
    model_index = _model_index(root)
    configs, weights = {}, {}
    for name in COMPONENT_CLASSES:
        folder = root / name
        if not folder.is_dir():
            raise CheckpointError(f"{root}: component folder {name}/ is missing")
        configs[name] = _json(folder / CONFIG_FILES[name], root)
        if name == "tokenizer":
            for file in TOKENIZER_FILES:
                if not (folder / file).is_file():
                    raise CheckpointError(f"{root}: tokenizer/{file} is missing")
        if name in WEIGHT_FILES:
            weights[name] = _weights(root, name)
            _check(root, name, configs[name], weights[name], expected)
    checkpoint = Checkpoint(root, model_index, configs, weights, fingerprint(root, weights))
    if not lora:
        return checkpoint
    return checkpoint.with_adapters(checkpoint.read_adapters(lora))


def fingerprint(root, weights):
    """sha256 (hex) naming a model without reading its weights.

    Hashed, in this order, after the tag FINGERPRINT_TAG: model_index.json; then for each component in
    sorted name order, each of its files ending in .json, .jinja or .txt (configs, shard index,
    tokenizer files) in sorted name order, followed by the raw JSON header of each safetensors file
    it uses, in sorted name order. Each item enters as its path relative to `root` ('/'-separated; a
    header as "<file>#header"), a NUL byte, its length as 8 little-endian bytes, then its bytes.
    """
    digest = hashlib.sha256(FINGERPRINT_TAG)

    def add(relpath, data):
        digest.update(relpath.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    add("model_index.json", (root / "model_index.json").read_bytes())
    for name in sorted(COMPONENT_CLASSES):
        folder = root / name
        for file in sorted(p.name for p in folder.iterdir() if p.is_file() and p.name.endswith(FINGERPRINT_SUFFIXES)):
            add(f"{name}/{file}", (folder / file).read_bytes())
        if name in weights:
            for file in sorted(weights[name].files):
                add(f"{name}/{file}#header", weights[name].headers[file])
    return digest.hexdigest()


def _model_index(root):
    if not (root / "model_index.json").is_file():
        raise CheckpointError(f"{root}: not a MOSS-Image folder (no model_index.json)")
    index = _json(root / "model_index.json", root)
    found = index.get("_class_name")
    if found != PIPELINE_CLASS:
        raise CheckpointError(f"{root}: not a MOSS-Image folder (model_index.json _class_name is {found!r}, "
                              f"expected {PIPELINE_CLASS!r})")
    for name, accepted in COMPONENT_CLASSES.items():
        entry = index.get(name)
        if not (isinstance(entry, list) and len(entry) == 2):
            raise CheckpointError(f"{root}: model_index.json has no [library, class] entry for {name!r}")
        if accepted is not None and entry[1] not in accepted:
            raise CheckpointError(f"{root}: not a MOSS-Image folder (model_index.json names {name} class "
                                  f"{entry[1]!r}, expected {' or '.join(sorted(map(repr, accepted)))})")
    return index


def _json(path, root):
    rel = path.relative_to(root)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{root}: {rel} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{root}: {rel} is not valid JSON ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{root}: cannot read {rel} ({e.strerror})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{root}: {rel} is not a JSON object")
    return value


def _weights(root, name):
    """The component's safetensors files (single or sharded) and every tensor's file, dtype and shape."""
    folder, base = root / name, WEIGHT_FILES[name]
    index_file, single = f"{base}.safetensors.index.json", f"{base}.safetensors"
    if (folder / index_file).is_file():
        weight_map = _json(folder / index_file, root).get("weight_map")
        if not (isinstance(weight_map, dict) and weight_map
                and all(isinstance(f, str) and "/" not in f for f in weight_map.values())):
            raise CheckpointError(f"{root}: {name}/{index_file} has no usable weight_map")
        files = tuple(sorted(set(weight_map.values())))
    elif (folder / single).is_file():
        weight_map, files = None, (single,)
    else:
        raise CheckpointError(f"{root}: {name}/ has no weights ({single} or {index_file})")
    stored, headers = {}, {}
    for file in files:
        if not (folder / file).is_file():
            raise CheckpointError(f"{root}: shard {name}/{file} is missing (named by {index_file})")
        try:
            headers[file], entries = safetensors_io.header(folder / file)
        except safetensors_io.SafetensorsError as e:
            raise CheckpointError(f"{root}: {name}/{file} is a corrupt or truncated safetensors file ({e})") from None
        for key, e in entries.items():
            if key == "__metadata__":
                continue
            if key in stored:
                raise CheckpointError(f"{root}: {name} tensor {key} is stored twice ({stored[key][0]}, {file})")
            stored[key] = (file, e["dtype"], tuple(e["shape"]))
    if weight_map is not None:
        for key, file in weight_map.items():
            if stored.get(key, (None,))[0] != file:
                raise CheckpointError(f"{root}: {name}/{index_file} puts tensor {key} in {file}, which lacks it")
    strip = _text_prefix(root, stored) if name == "text_encoder" else ""
    entries = {}
    for key, (file, dtype, shape) in stored.items():
        if not key.startswith(strip):
            continue
        short = key[len(strip):]
        if name == "text_encoder" and not short.startswith(TEXT_MODULES):
            continue
        entries[short] = (key, file, dtype, shape)
    return _Weights(files, headers, entries)


def _text_prefix(root, stored):
    for prefix in TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in stored:
            return prefix
    raise CheckpointError(f"{root}: text_encoder has no embed_tokens.weight under any known prefix "
                          f"({', '.join(repr(p) for p in TEXT_PREFIXES)})")


def _check(root, name, config, weights, expected):
    try:
        wanted = expected(name, config)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CheckpointError(f"{root}: {name}/{CONFIG_FILES[name]} is not a usable config "
                              f"({e.__class__.__name__}: {e})") from None
    for key, shape in wanted.items():
        entry = weights.entries.get(key)
        if entry is None:
            raise CheckpointError(f"{root}: {name} tensor {key} is missing")
        stored, file, dtype, found = entry
        if tuple(found) != tuple(shape):
            raise CheckpointError(f"{root}: {name} tensor {key} has shape {list(found)}, expected {list(shape)} "
                                  f"({name}/{file})")
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{root}: {name} tensor {key} is {dtype}, expected F32 or BF16 ({name}/{file})")
