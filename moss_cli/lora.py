"""LoRA and LoKr adapters, merged into the checkpoint's weights as a component loads.

Formats, told from each layer's key suffixes (a layer is a key stem: a root, then the module's path):

    diffusers / peft  STEM.lora_A.weight [r, in], STEM.lora_B.weight [out, r]; alpha from a STEM.alpha tensor,
                      else the file's `lora_adapter_metadata` (diffusers), else an adapter_config.json beside the
                      file (peft's save_pretrained), else r; `use_rslora` makes the factor alpha / sqrt(r)
    kohya / LyCORIS   STEM.lora_down.weight [r, in], STEM.lora_up.weight [out, r], STEM.alpha (absent or 0: r)
    LyCORIS LoKr      STEM.lokr_w1 or lokr_w1_a @ lokr_w1_b, STEM.lokr_w2 or lokr_w2_a @ lokr_w2_b, STEM.alpha;
                      delta = kron(w1, w2) * alpha / r, r the rank of the factored part; with neither part
                      factored the factor is 1 (LyCORIS's rule: a full matrix has no rank to scale by)

Roots: the DiT as `transformer.`, `diffusion_model.`, `base_model.model.` (peft) or none, dots kept, and as
`lora_unet_`, `lycoris_` or `lora_transformer_` with the path's dots written as underscores (kohakumoss's
two export styles are `lora_unet_layers_0_proj_q` and `diffusion_model.layers.0.proj.q`); ComfyUI's fused
`layers.N.proj.qkv` stands for the q, k and v rows of block N. The text encoder as `text_encoder.`, `te.`,
`base_model.model.` or none, then any of the checkpoint's text prefixes (`model.language_model.`, ...), or
`lora_te_` / `lora_te1_` with underscores. Only 2-D `.weight` tensors are targets (the token embedding
table, read row by row, is not).

Merge, for a weight W stored as bf16: W' = bf16(W + sum_i scale_i * f_i * delta_i), each delta in float32
(for a weight's rows of the delta: up[rows] @ down), scaled by float32(scale_i * f_i), the sum in float32 in the
adapters' order and one rounding to the stored dtype, as peft merges one adapter (its `weight += delta` with a
float32 delta). A weight stored as float32 stays float32 (no rounding). On the CPU the merged arrays replace the
base ones in the component's tensor dict (`merge`); on the GPU the base weights are uploaded and merged there by
the same statement (gpu/lora_merge.py), the product's float32 sum in cuBLAS's order.
"""

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import safetensors_io
from .errors import LoraError, UsageError

COMPONENTS = ("text_encoder", "transformer")
DIT_DOT_ROOTS = ("", "transformer.", "diffusion_model.", "base_model.model.")
DIT_UNDERSCORE_ROOTS = ("lora_unet_", "lycoris_", "lora_transformer_")
TEXT_DOT_ROOTS = ("", "text_encoder.", "te.", "base_model.model.")
TEXT_UNDERSCORE_ROOTS = ("lora_te_", "lora_te1_")
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")
HOST_ONLY = ("embed_tokens.weight",)     # read as rows, not as a matrix: no LoRA merge
FUSED_QKV = re.compile(r"(.*\.proj)\.q\.weight")
NAME = re.compile(r"[A-Za-z0-9_.-]+")     # an adapter's name on moss-server

# suffix -> (format, part); longest first so `lokr_w1_a` is not read as `lokr_w1`
SUFFIXES = {
    "lora_A.weight": ("peft", "down"), "lora_B.weight": ("peft", "up"),
    "lora_down.weight": ("kohya", "down"), "lora_up.weight": ("kohya", "up"),
    "lokr_w1_a": ("lokr", "w1_a"), "lokr_w1_b": ("lokr", "w1_b"),
    "lokr_w2_a": ("lokr", "w2_a"), "lokr_w2_b": ("lokr", "w2_b"),
    "lokr_w1": ("lokr", "w1"), "lokr_w2": ("lokr", "w2"),
    "alpha": (None, "alpha"),
}
# suffixes of kinds people ship that are not merged here: named in the error instead of "matches nothing"
UNSUPPORTED = ("dora_scale", "lora_magnitude_vector", "lora_mid.weight", "lokr_t1", "lokr_t2", "hada_w1_a",
               "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2", "lora_B.bias", "diff", "diff_b",
               "oft_blocks", "w_norm", "b_norm")
FOLDER_FILES = ("adapter_model.safetensors", "pytorch_lora_weights.safetensors")
FINGERPRINT_TAG = b"moss-cli lora fingerprint v1\n"
SHOWN = 3          # offending keys named in one error line


@dataclass(frozen=True)
class Target:
    component: str
    names: tuple       # tensor names whose rows the layer's delta covers, in order (a fused q/k/v: three)
    rows: tuple        # each one's row count
    columns: int
    path: str          # the module path as written after the root (what peft's alpha_pattern matches)


@dataclass(frozen=True, eq=False)
class Layer:
    target: Target
    kind: str          # "lora" | "lokr"
    parts: dict        # part -> array as stored (up, down; w1, w1_a, ...)
    factor: float      # alpha / r by the format's rule
    stem: str

    def delta(self):
        """float32 [sum(rows), columns]: up @ down or kron(w1, w2), before the factor and the scale."""
        p = {k: np.asarray(v, dtype=np.float32) for k, v in self.parts.items()}
        if self.kind == "lora":
            return p["up"] @ p["down"]
        return np.kron(_lokr_side(p, "w1"), _lokr_side(p, "w2"))

    def rows(self, i):
        """The rows of the delta that target name i covers (a slice)."""
        start = sum(self.target.rows[:i])
        return slice(start, start + self.target.rows[i])

    def part(self, i):
        """float32 [rows of name i, columns]: that name's rows of the delta (up[rows] @ down for a LoRA), unscaled."""
        if self.kind == "lora":
            return np.asarray(self.parts["up"][self.rows(i)], np.float32) @ np.asarray(self.parts["down"], np.float32)
        return self.delta()[self.rows(i)]


@dataclass(frozen=True, eq=False)
class Adapter:
    path: Path
    scale: float
    sha256: str
    format: str        # "peft", "kohya" or "lokr" (a file may mix kohya LoRA and LoKr layers: "kohya+lokr")
    layers: tuple

    @property
    def components(self):
        return tuple(c for c in COMPONENTS if any(layer.target.component == c for layer in self.layers))

    def describe(self):
        counts = ", ".join(f"{sum(layer.target.component == c for layer in self.layers)} {c} layers"
                           for c in self.components)
        return f"{self.path.name} ({self.format}, {counts}) at scale {self.scale:g}"


def parse_spec(text):
    """(path, scale) of a --lora value FILE[:SCALE]; the scale defaults to 1 and is read only when the part
    after the last ':' is a number (so a file name holding ':' still works)."""
    path, sep, tail = str(text).rpartition(":")
    if sep and path:
        try:
            scale = float(tail) if "_" not in tail else None      # float() reads 1_0 as 10
        except ValueError:
            scale = None
        if scale is None:
            if Path(path).exists() and not Path(text).exists():
                raise UsageError(f"--lora {text}: the scale {tail!r} is not a number")
            return Path(text), 1.0
        if not math.isfinite(scale):
            raise UsageError(f"--lora {text}: the scale must be a finite number")
        return Path(path), scale
    return Path(text), 1.0


def parse_named(text):
    """(name, path, scale) of a moss-server --lora value [NAME=]FILE[:SCALE]: NAME defaults to the file's stem (a
    folder's name for a peft or diffusers folder). A text that names an existing file is taken whole."""
    text = str(text)
    name, sep, rest = text.partition("=")
    if not sep or not NAME.fullmatch(name) or Path(text).exists():
        name, rest = "", text
    path, scale = parse_spec(rest)
    return name or (path.name if path.is_dir() else path.stem), path, scale


def index(shapes):
    """{key stem: Target} for every way an adapter file may name a target. `shapes`: {component: {tensor
    name: shape}} of the checkpoint (text-encoder names without their stored prefix)."""
    out = {}

    def add(stem, target):
        if out.get(stem, target) != target:
            raise ValueError(f"adapter key stem {stem!r} names two targets")
        out[stem] = target

    for component, tensors in shapes.items():
        if component not in COMPONENTS:
            continue
        modules = {}
        for name, shape in tensors.items():
            if len(shape) == 2 and name.endswith(".weight") and name not in HOST_ONLY:
                modules[name[:-len(".weight")]] = ((name,), (shape[0],), shape[1])
            m = FUSED_QKV.fullmatch(name)
            parts = m and [f"{m.group(1)}.{p}.weight" for p in "qkv"]
            if component == "transformer" and parts and all(p in tensors for p in parts):
                if len({tensors[p][1] for p in parts}) == 1:
                    modules[f"{m.group(1)}.qkv"] = (tuple(parts), tuple(tensors[p][0] for p in parts), shape[1])
        if component == "transformer":
            prefixes, dots, unders = ("",), DIT_DOT_ROOTS, DIT_UNDERSCORE_ROOTS
        else:
            prefixes, dots, unders = TEXT_PREFIXES, TEXT_DOT_ROOTS, TEXT_UNDERSCORE_ROOTS
        for module, (names, rows, columns) in modules.items():
            for prefix in prefixes:
                path = prefix + module
                target = Target(component, names, rows, columns, path)
                for root in dots:
                    add(root + path, target)
                for root in unders:
                    add(root + path.replace(".", "_"), target)
    return out


def read(path, scale, shapes, stems=None):
    """The Adapter in the safetensors file PATH, every layer checked against the checkpoint's `shapes`
    ({component: {name: shape}}); `stems` an index(shapes) already made. Raises LoraError in one line."""
    path = Path(path)
    if path.is_dir():       # peft's save_pretrained folder, or diffusers' save_lora_weights folder
        path = next((path / f for f in FOLDER_FILES if (path / f).is_file()), path)
    if not path.is_file():
        raise LoraError(f"--lora {path}: no such file" if not path.exists() else
                        f"--lora {path}: a folder without {' or '.join(FOLDER_FILES)}")
    try:
        tensors, metadata = safetensors_io.load(path)
    except safetensors_io.SafetensorsError as e:
        raise LoraError(f"--lora {path}: not a readable safetensors file ({e})") from None
    stems = stems if stems is not None else index(shapes)
    groups, unmatched, unsupported = {}, [], []
    for key in sorted(tensors):
        stem, suffix = _split(key)
        if suffix is None:
            (unsupported if key.endswith(tuple("." + s for s in UNSUPPORTED)) else unmatched).append(key)
            continue
        if stem not in stems:
            unmatched.append(key)
            continue
        groups.setdefault(stem, {})[suffix] = (key, tensors[key])
    if not tensors:
        raise LoraError(f"--lora {path}: holds no tensors")
    if unsupported:
        raise LoraError(f"--lora {path}: adapter kinds not supported here (LoRA and LoKr are): "
                        f"{_first(unsupported)}")
    if not groups:
        arch = metadata.get("modelspec.architecture") or metadata.get("ss_base_model_version")
        made = f" (its metadata says {arch})" if arch else ""
        raise LoraError(f"--lora {path}: made for another model{made}: no key names a MOSS-Image weight, "
                        f"e.g. {_first(unmatched)}")
    if unmatched:
        raise LoraError(f"--lora {path}: {len(unmatched)} keys match no weight of this model: {_first(unmatched)}")
    config = _peft_config(path, metadata)
    layers, taken, formats = [], {}, set()
    for stem, found in groups.items():
        target = stems[stem]
        for name in target.names:
            if name in taken:
                raise LoraError(f"--lora {path}: {target.component} weight {name} is named twice "
                                f"({taken[name]} and {stem})")
            taken[name] = stem
        layer, fmt = _layer(path, stem, target, found, config)
        layers.append(layer)
        formats.add(fmt)
    return Adapter(path, float(scale), _sha256(path), "+".join(sorted(formats)), tuple(layers))


def uses(adapters, component):
    """{tensor name: [(scale, layer, i), ...]}: each weight of COMPONENT the adapters touch, with every layer that
    touches it (i: the name's place in the layer's target), in the adapters' order (the order of the sum)."""
    out = {}
    for adapter in adapters:
        for layer in adapter.layers:
            if layer.target.component == component:
                for i, name in enumerate(layer.target.names):
                    out.setdefault(name, []).append((adapter.scale, layer, i))
    return out


def scaled(scale, layer, i):
    """float32 scale * factor * delta for target name i: the part rounded, times float32(scale * factor) rounded."""
    part = layer.part(i)
    part *= np.float32(scale * layer.factor)
    return part


def merge_one(base, used):
    """One weight BASE with its uses (an entry of `uses`) merged: bf16 or float32, as BASE is stored."""
    total = None
    for scale, layer, i in used:
        part = scaled(scale, layer, i)
        total = part if total is None else total + part
    merged = np.array(base, dtype=np.float32)
    merged += total
    return merged.astype(base.dtype) if base.dtype != np.float32 else merged


def merge(component, tensors, adapters):
    """TENSORS (the component's {name: array}) with every weight the adapters touch merged (see the module
    docstring); the others are the same arrays. A new dict; TENSORS is not changed."""
    out = dict(tensors)
    for name, used in uses(adapters, component).items():
        out[name] = merge_one(tensors[name], used)
    return out


def merged_set(adapters, component=None):
    """What decides COMPONENT's merged weights (None: every component's): each adapter touching it (its layers
    object) with its scale, in order; equal sets merge to equal weights."""
    return tuple((id(a.layers), a.scale) for a in adapters if component is None or component in a.components)


def fingerprint(base, adapters):
    """The model fingerprint of the base checkpoint with ADAPTERS merged: the base's when none, else sha256 of
    FINGERPRINT_TAG, the base fingerprint and one line 'sha256 scale' per adapter, in the order given (the
    float32 sum depends on it)."""
    if not adapters:
        return base
    lines = "".join(f"{a.sha256} {a.scale!r}\n" for a in adapters)
    return hashlib.sha256(FINGERPRINT_TAG + base.encode() + b"\n" + lines.encode()).hexdigest()


def record(adapters):
    """The artifacts' `moss.lora` value: [{"scale", "sha256"}, ...] as compact JSON, in order."""
    return json.dumps([{"scale": a.scale, "sha256": a.sha256} for a in adapters], sort_keys=True,
                      separators=(",", ":"))


def _split(key):
    for suffix in SUFFIXES:
        if key.endswith("." + suffix):
            return key[:-len(suffix) - 1], suffix
    return key, None


def _first(keys):
    more = f" (and {len(keys) - SHOWN} more)" if len(keys) > SHOWN else ""
    return ", ".join(keys[:SHOWN]) + more


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _peft_config(path, metadata):
    """{component or "": LoraConfig fields} from the file's diffusers metadata, else adapter_config.json."""
    raw = metadata.get("lora_adapter_metadata")
    if raw is None and (path.parent / "adapter_config.json").is_file():
        try:
            raw = (path.parent / "adapter_config.json").read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise LoraError(f"--lora {path}: adapter_config.json cannot be read as UTF-8 text ({e})") from None
    if raw is None:
        return {}
    try:
        fields = json.loads(raw)
    except json.JSONDecodeError as e:
        raise LoraError(f"--lora {path}: its LoRA config is not valid JSON ({e})") from None
    if not isinstance(fields, dict):
        raise LoraError(f"--lora {path}: its LoRA config is not a JSON object")
    out = {"": {k: v for k, v in fields.items() if "." not in k}}
    for component in COMPONENTS:       # diffusers prefixes each field with the component's name
        own = {k[len(component) + 1:]: v for k, v in fields.items() if k.startswith(component + ".")}
        out[component] = own or out[""]
    return out


def _alpha(path, stem, found, config, target):
    """The layer's alpha: its .alpha tensor, else its peft config's (alpha_pattern, then lora_alpha), else None."""
    if "alpha" in found:
        key, value = found["alpha"]
        value = np.asarray(value, dtype=np.float64)
        if value.size != 1 or not np.isfinite(value).all():
            raise LoraError(f"--lora {path}: {key} is not one finite number")
        return float(value.reshape(()))
    fields = config.get(target.component, config.get("", {}))
    patterns = fields.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise LoraError(f"--lora {path}: alpha_pattern in its LoRA config is not an object of pattern: alpha")
    for pattern, value in patterns.items():
        try:
            matched = re.match(rf"(.*\.)?({pattern})$", target.path)
        except re.error as e:
            raise LoraError(f"--lora {path}: alpha_pattern {pattern!r} is not a regular expression ({e})") from None
        if matched:
            return _config_number(path, f"alpha_pattern {pattern!r}", value)
    alpha = fields.get("lora_alpha")
    return None if alpha is None else _config_number(path, "lora_alpha", alpha)


def _config_number(path, name, value):
    """A LoRA config's number, refused where it is not one finite number (a string, a list, NaN, 1e999)."""
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    if not math.isfinite(number):
        raise LoraError(f"--lora {path}: {name} {value!r} in its LoRA config is not a finite number")
    return number


def _layer(path, stem, target, found, config):
    """(Layer, format) of one stem's tensors, their shapes checked against the target's."""
    formats = {SUFFIXES[s][0] for s in found} - {None}
    keys = sorted(k for k, _ in found.values())
    if len(formats) != 1:
        raise LoraError(f"--lora {path}: {stem} mixes formats or has only an alpha: {_first(keys)}")
    fmt = formats.pop()
    parts = {SUFFIXES[s][1]: v for s, (_, v) in found.items() if s != "alpha"}
    out_rows, columns = sum(target.rows), target.columns
    fields = config.get(target.component, config.get("", {})) if fmt == "peft" else {}
    if fields.get("use_dora"):
        raise LoraError(f"--lora {path}: a DoRA adapter (use_dora) is not supported here: {_first(keys)}")
    alpha = _alpha(path, stem, found, config if fmt == "peft" else {}, target)
    if fmt in ("peft", "kohya"):
        if set(parts) != {"up", "down"}:
            raise LoraError(f"--lora {path}: {stem} needs both its down/A and up/B matrices, has {_first(keys)}")
        up, down = parts["up"], parts["down"]
        if up.ndim != 2 or down.ndim != 2 or up.shape[1] != down.shape[0]:
            raise LoraError(f"--lora {path}: rank mismatch in {stem}: up/B {list(up.shape)}, "
                            f"down/A {list(down.shape)}")
        if up.shape[0] != out_rows or down.shape[1] != columns:
            raise LoraError(f"--lora {path}: {stem} makes a [{up.shape[0]}, {down.shape[1]}] delta, "
                            f"the weight is [{out_rows}, {columns}]")
        rank = down.shape[0]
        alpha = rank if not alpha else alpha      # kohya and LyCORIS read a missing or zero alpha as r
        root = math.sqrt(rank) if fields.get("use_rslora") else rank
        return Layer(target, "lora", parts, alpha / root, stem), fmt
    rank = None
    shapes = []
    for side in ("w1", "w2"):
        if side in parts and not ({side + "_a", side + "_b"} & set(parts)):
            full = parts[side]
            if full.ndim != 2:
                raise LoraError(f"--lora {path}: {stem}.lokr_{side} is {list(full.shape)}, not a matrix")
            shapes.append(full.shape)
        elif {side + "_a", side + "_b"} <= set(parts) and side not in parts:
            a, b = parts[side + "_a"], parts[side + "_b"]
            if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
                raise LoraError(f"--lora {path}: rank mismatch in {stem}: lokr_{side}_a {list(a.shape)}, "
                                f"lokr_{side}_b {list(b.shape)}")
            if rank is not None and rank != a.shape[1]:
                raise LoraError(f"--lora {path}: rank mismatch in {stem}: w1 has rank {rank}, w2 {a.shape[1]}")
            rank = a.shape[1]
            shapes.append((a.shape[0], b.shape[1]))
        else:
            raise LoraError(f"--lora {path}: {stem} needs lokr_{side} or lokr_{side}_a and _b, has {_first(keys)}")
    (a, b), (c, d) = shapes
    if (a * c, b * d) != (out_rows, columns):
        raise LoraError(f"--lora {path}: {stem} makes a [{a * c}, {b * d}] delta (kron of {[a, b]} and "
                        f"{[c, d]}), the weight is [{out_rows}, {columns}]")
    factor = 1.0 if rank is None or not alpha else alpha / rank
    return Layer(target, "lokr", parts, factor, stem), fmt


def _lokr_side(p, side):
    return p[side] if side in p else p[side + "_a"] @ p[side + "_b"]
