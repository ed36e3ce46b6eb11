"""Chat bracket token ids against transformers (AutoTokenizer + apply_chat_template) on the tiny tokenizer."""

import json
import shutil

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from moss_cli.errors import CheckpointError  # noqa: E402
from moss_cli.tokenizer import MAX_TOKENS, ChatTokenizer  # noqa: E402
from scripts.tiny_tokenizer import SPECIAL_TOKENS, vocab_size, write_tiny_tokenizer  # noqa: E402

PROMPTS = {
    "ascii": "A photograph of a red fox in the snow, it's 3.14 o'clock",
    "empty": "",
    "whitespace": "  two  spaces\n\n\tand a tab  ",
    "decomposed accents": "cafe\u0301 cre\u0300me bru\u0302le\u0301e",
    "marks that survive NFC": "e\u0301\u0301 n\u0303o\u0308\u0301x",
    "devanagari": "किताब पढ़ती हुई एक लड़की",
    "hebrew with niqqud": "שָׁלוֹם עוֹלָם",
    "arabic with harakat": "مَدِينَةٌ قَدِيمَةٌ في الصحراء",
    "cjk": "一只猫坐在窗边，东京の夜景，서울의 거리",
    "emoji": "a cake 🍰✨ and a family 👩‍👩‍👧 🇫🇷",
    "control tokens": "<|im_end|><|im_start|>system\n<think>",
    "over-long word run": "word " * 5000,
    "over-long single piece": "x" * 9000,
}
COMBINING = ("devanagari", "hebrew with niqqud", "arabic with harakat")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(folder)
    return folder


def variant(base, folder, tokenizer_class="keep", model_type=None, drop_decoder=False, template_in_config=False):
    """A copy of the tiny folder with tokenizer_config.json edited the way other checkpoints write it."""
    shutil.copytree(base, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if tokenizer_class is None:
        config.pop("tokenizer_class")
    elif tokenizer_class != "keep":
        config["tokenizer_class"] = tokenizer_class
    if drop_decoder:
        config.pop("added_tokens_decoder")
    if template_in_config:
        config["chat_template"] = (folder / "chat_template.jinja").read_text()
        (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if model_type:
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def transformers_ids(tok, prompt):
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=True)
    return text, tok(text, truncation=True, max_length=MAX_TOKENS)["input_ids"]


VARIANTS = {
    "as shipped (Qwen2Tokenizer)": dict(),
    "Qwen3_5Tokenizer": dict(tokenizer_class="Qwen3_5Tokenizer"),
    "TokenizersBackend": dict(tokenizer_class="TokenizersBackend"),
    "PreTrainedTokenizerFast": dict(tokenizer_class="PreTrainedTokenizerFast"),
    "no class": dict(tokenizer_class=None),
    "model config forces Qwen3_5Tokenizer": dict(model_type="qwen3_5"),
    "added tokens only in tokenizer.json": dict(drop_decoder=True),
    "template in tokenizer_config.json": dict(template_in_config=True),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ids_equal_transformers(tiny_dir, tmp_path, name):
    folder = variant(tiny_dir, tmp_path / "tok", **VARIANTS[name])
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = ChatTokenizer.from_folder(folder)
    for kind, prompt in PROMPTS.items():
        text, want = transformers_ids(ref, prompt)
        ids, truncated = ours.encode_prompt(prompt)
        assert ours.render(prompt) == text, kind
        assert ids.dtype == np.int32
        assert ids.tolist() == want, kind
        full = ref(text)["input_ids"]
        assert truncated == (len(full) > MAX_TOKENS), kind


def test_class_named_by_model_index_wins(tiny_dir, tmp_path):
    """diffusers loads the class model_index.json names, even beside a config.json that AutoTokenizer obeys."""
    folder = variant(tiny_dir, tmp_path / "tok", model_type="qwen3_5")
    ref = transformers.Qwen2Tokenizer.from_pretrained(str(folder))
    ours = ChatTokenizer.from_folder(folder, tokenizer_class="Qwen2Tokenizer")
    for prompt in PROMPTS.values():
        assert ours.encode_prompt(prompt)[0].tolist() == transformers_ids(ref, prompt)[1]


def test_the_class_decides_how_combining_marks_split(tiny_dir):
    """encoder.md 9: Qwen2Tokenizer rebuilds Qwen2's split (marks apart), Qwen3_5Tokenizer keeps them in words."""
    qwen2 = ChatTokenizer.from_folder(tiny_dir)
    qwen35 = ChatTokenizer.from_folder(tiny_dir, tokenizer_class="Qwen3_5Tokenizer")
    for kind in COMBINING:
        assert qwen2.encode_prompt(PROMPTS[kind])[0].tolist() != qwen35.encode_prompt(PROMPTS[kind])[0].tolist()
    assert qwen2.encode_prompt(PROMPTS["ascii"])[0].tolist() == qwen35.encode_prompt(PROMPTS["ascii"])[0].tolist()


def test_bracket_is_one_user_turn_with_thinking_open(tiny_dir):
    ours = ChatTokenizer.from_folder(tiny_dir)
    assert ours.render("a cat") == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    closed = ref.apply_chat_template([{"role": "user", "content": "a cat"}], tokenize=False,
                                     add_generation_prompt=True, enable_thinking=False)
    assert closed.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = ours.encode_prompt("a cat")[0].tolist()
    tok = {content: ref.convert_tokens_to_ids(content) for content, _ in SPECIAL_TOKENS}
    assert ids[0] == tok["<|im_start|>"] and ids[-2:] == [tok["<think>"], ref.convert_tokens_to_ids("Ċ")]


def test_truncation_cuts_the_end(tiny_dir):
    ours = ChatTokenizer.from_folder(tiny_dir)
    prompt = PROMPTS["over-long word run"]
    ids, truncated = ours.encode_prompt(prompt)
    ours.backend.no_truncation()       # the uncut ids, to compare the prefix
    full = ours.backend.encode(ours.render(prompt)).ids
    assert truncated and len(ids) == MAX_TOKENS < len(full)
    assert ids.tolist() == full[:MAX_TOKENS]
    assert ours.encode_prompt("a cat")[1] is False


def test_tiny_tokenizer_is_deterministic_and_small(tmp_path):
    write_tiny_tokenizer(tmp_path / "a")
    write_tiny_tokenizer(tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert sum((tmp_path / "a" / n).stat().st_size for n in names) < 300_000
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert type(ref).__name__ == "Qwen2Tokenizer"
    ids = [ref.convert_tokens_to_ids(content) for content, _ in SPECIAL_TOKENS]
    assert ids == list(range(ids[0], ids[0] + len(SPECIAL_TOKENS)))   # right after the BPE vocabulary
    assert ids[-1] + 1 == vocab_size() == len(ref)


def test_errors_name_the_problem(tiny_dir, tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer folder"):
        ChatTokenizer.from_folder(tmp_path / "nowhere")
    folder = variant(tiny_dir, tmp_path / "no_json")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        ChatTokenizer.from_folder(folder)
    folder = variant(tiny_dir, tmp_path / "no_template")
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(CheckpointError, match="chat template"):
        ChatTokenizer.from_folder(folder)
    folder = variant(tiny_dir, tmp_path / "llama", tokenizer_class="LlamaTokenizer")
    with pytest.raises(CheckpointError, match="LlamaTokenizer"):
        ChatTokenizer.from_folder(folder)
    folder = variant(tiny_dir, tmp_path / "broken")
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        ChatTokenizer.from_folder(folder)
