"""The checkpoint's chat bracket and tokenizer: prompt -> token ids, as transformers makes them.

The official pipeline calls `apply_chat_template([{"role": "user", "content": prompt}],
add_generation_prompt=True, enable_thinking=True)` and then `tokenizer(text, truncation=True,
max_length=4096)`. We render the same template with jinja2 and run `tokenizer.json` through the
`tokenizers` library, rebuilt the way transformers' tokenizer class rebuilds it: Qwen2Tokenizer and
Qwen3_5Tokenizer keep only vocab, merges and post-processor from the file and impose their own
normaliser, split regex and BPE options (encoder.md section 9).
"""

import copy
import json
from datetime import datetime
from pathlib import Path

import numpy as np

from .errors import CheckpointError

MAX_TOKENS = 4096

# The split regex each class hard-codes; they differ only in whether combining marks (\p{M}) join letters.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REBUILT_CLASSES = {"Qwen2Tokenizer": QWEN2_SPLIT, "Qwen3_5Tokenizer": QWEN35_SPLIT}
# Classes that take tokenizer.json as it is.
FILE_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast", "PythonBackend"}
# AutoTokenizer overrides the hub class for these model types (its list of known-wrong hub classes).
FORCED_BY_MODEL_TYPE = {"qwen3_5": "Qwen3_5Tokenizer", "qwen3_5_text": "Qwen3_5Tokenizer",
                        "qwen3_5_moe": "Qwen3_5Tokenizer", "qwen3_5_moe_text": "Qwen3_5Tokenizer"}
# Defaults both Qwen classes give when tokenizer_config.json leaves a special token out.
QWEN_DEFAULT_SPECIALS = {"bos_token": None, "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                         "pad_token": "<|endoftext|>"}
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path.name} in {path.parent}: {e}") from e


def _token_text(value):
    """A special token entry of tokenizer_config.json (string or AddedToken dict) as its text."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def resolve_class(folder: Path, declared: str | None, config: dict) -> str:
    """The tokenizer class transformers would instantiate for `folder`.

    `declared` is the class the caller was told to use (model_index.json); AutoTokenizer (None) reads
    tokenizer_config.json and lets a model config.json beside it override a known-wrong hub class.
    """
    if declared and declared != "AutoTokenizer":
        return declared.removesuffix("Fast") if declared != "PreTrainedTokenizerFast" else declared
    hub = config.get("tokenizer_class")
    model_config = folder / "config.json"
    if model_config.is_file():
        forced = FORCED_BY_MODEL_TYPE.get(_read_json(model_config).get("model_type"))
        if forced:
            return forced
    if hub is None:
        return "TokenizersBackend"
    return hub.removesuffix("Fast") if hub != "PreTrainedTokenizerFast" else hub


def _backend(folder: Path, cls: str, config: dict, specials: dict):
    """A tokenizers.Tokenizer that splits and merges exactly as transformers' class `cls` does."""
    from tokenizers import AddedToken, Tokenizer, processors

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"no tokenizer.json in {folder}")
    spec = _read_json(path)
    if cls in REBUILT_CLASSES:
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise CheckpointError(f"{path} holds a {model.get('type')} model; {cls} needs BPE")
        spec = copy.copy(spec)
        spec["model"] = {**model, "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                         "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                         "ignore_merges": False}
        spec["normalizer"] = {"type": "NFC"}
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": REBUILT_CLASSES[cls]}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": bool(config.get("add_prefix_space") or False),
             "trim_offsets": True, "use_regex": False}]}
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                           "use_regex": True}
        file_added = spec.get("added_tokens") or []
        spec["added_tokens"] = []
    elif cls in FILE_CLASSES:
        file_added = []
    else:
        raise CheckpointError(f"tokenizer class {cls!r} in {folder} is not supported "
                              f"(expected Qwen2Tokenizer, Qwen3_5Tokenizer or TokenizersBackend)")
    try:
        tok = Tokenizer.from_str(json.dumps(spec))
    except Exception as e:
        raise CheckpointError(f"cannot load {path}: {e}") from e

    # transformers adds the config's added tokens (else the file's) in id order, then missing named specials.
    declared = config.get("added_tokens_decoder")
    if declared:
        entries = [(int(i), t) for i, t in declared.items()]
    else:
        entries = [(t["id"], t) for t in file_added]
    for index, entry in sorted(entries, key=lambda e: e[0]):
        fields = {k: entry[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in entry}
        token = AddedToken(entry["content"], **fields)
        if tok.token_to_id(entry["content"]) is None:
            tok.add_tokens([token])
        if tok.token_to_id(entry["content"]) != index:
            raise CheckpointError(f"added token {entry['content']!r} of {folder} should have id {index}, "
                                  f"the vocabulary gives it {tok.token_to_id(entry['content'])}")
    for text in specials.values():
        if text and tok.token_to_id(text) is None:
            tok.add_tokens([AddedToken(text, special=True, normalized=False)])

    if "add_bos_token" in config or "add_eos_token" in config or tok.post_processor is None:
        bos, eos = specials.get("bos_token"), specials.get("eos_token")
        head = [bos] if config.get("add_bos_token") and bos else []
        tail = [eos] if config.get("add_eos_token") and eos else []
        single = " ".join([*(f"{t}:0" for t in head), "$A:0", *(f"{t}:0" for t in tail)])
        tok.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(t, tok.token_to_id(t)) for t in head + tail])
    tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
    return tok


def _chat_template(folder: Path, config: dict) -> str:
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers takes "default"
        template = {t["name"]: t["template"] for t in template}.get("default")
    if not template:
        raise CheckpointError(f"no chat template in {folder} (chat_template.jinja or tokenizer_config.json)")
    return template


def _compile(template: str):
    """The template under the sandbox, whitespace settings, filters and globals transformers gives it."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise CheckpointError(f"chat template does not compile: {e}") from e


class ChatTokenizer:
    """Prompt -> the token ids of the checkpoint's chat bracket (one user turn, thinking prompt open)."""

    def __init__(self, backend, template, specials, truncation_side="right"):
        self.backend = backend
        self.template = template
        self.specials = specials
        self.truncation_side = truncation_side

    @classmethod
    def from_folder(cls, tokenizer_dir: Path, tokenizer_class: str | None = None) -> "ChatTokenizer":
        folder = Path(tokenizer_dir)
        if not folder.is_dir():
            raise CheckpointError(f"tokenizer folder {folder} is missing")
        config_path = folder / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        name = resolve_class(folder, tokenizer_class, config)
        specials = {k: _token_text(config.get(k)) for k in SPECIAL_KEYS if k in config}
        if name in REBUILT_CLASSES:
            specials = {**QWEN_DEFAULT_SPECIALS, **specials}
        backend = _backend(folder, name, config, specials)
        side = config.get("truncation_side", "right")
        return cls(backend, _compile(_chat_template(folder, config)), specials, side)

    def render(self, prompt: str) -> str:
        """The templated text: the prompt as one user turn plus the assistant's opening bracket."""
        import jinja2

        try:
            return self.template.render(messages=[{"role": "user", "content": prompt}], tools=None,
                                        documents=None, add_generation_prompt=True, enable_thinking=True,
                                        **{k: v for k, v in self.specials.items() if v is not None})
        except jinja2.exceptions.TemplateError as e:
            raise CheckpointError(f"chat template failed: {e}") from e

    def encode_prompt(self, prompt: str) -> tuple[np.ndarray, bool]:
        """Token ids of the templated prompt, cut to MAX_TOKENS; `truncated` says whether it was cut."""
        self.backend.enable_truncation(MAX_TOKENS, direction=self.truncation_side)
        encoding = self.backend.encode(self.render(prompt), add_special_tokens=True)
        return np.asarray(encoding.ids, dtype=np.int32), bool(encoding.overflowing)
