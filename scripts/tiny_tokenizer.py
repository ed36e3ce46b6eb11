"""A tiny Qwen3.5-style chat tokenizer folder for tests and the embedded tiny checkpoint.

Byte-level BPE with a few hundred merges learned here from a small built-in corpus, the Qwen3.5
pipeline (NFC, letter runs that absorb combining marks, ByteLevel), the Qwen special tokens placed
right after the BPE vocabulary, `tokenizer_class: Qwen2Tokenizer` as the real checkpoint names it,
and a ChatML template with the thinking bracket. Deterministic: the same bytes on every run.

    python scripts/tiny_tokenizer.py OUT_DIR
"""

import json
import sys
import unicodedata
from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

MERGES = 320

# Qwen3.5's split: like Qwen2's, but letter runs also take combining marks (\p{M}).
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# In the order of their ids (encoder.md section 5); True = special (skipped when decoding).
SPECIAL_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True),
    ("<tts_pad>", True), ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]

CORPUS = """\
A photograph of a red fox sitting in the snow at sunrise, soft light, shallow depth of field.
An oil painting of a quiet harbour with fishing boats, warm evening colours and long shadows.
A watercolour illustration of a small cottage in the mountains, surrounded by pine trees.
The city skyline at night, neon signs reflected in the wet street after the rain.
A bowl of ramen with an egg, green onions and sesame seeds on a wooden table.
Portrait of an old sailor with a grey beard and a blue knitted hat, detailed skin texture.
A cat sleeping on a stack of books next to a window, afternoon sun, cosy interior.
Isometric view of a futuristic laboratory with glowing screens and robotic arms.
The text "OPEN 24 HOURS" written on a shop sign in bright yellow letters.
A café in Paris with a crème brûlée on the counter; the waiter says: «bon appétit!»
Über den Wolken: ein Flugzeug über schneebedeckten Bergen, Blick aus dem Fenster.
Una niña con un sombrero rojo camina por la playa al atardecer, pintura al óleo.
一只猫坐在窗边，阳光明媚，城市的风景。山上的小房子，水彩画。
東京の夜景、雨の中のネオンサイン。富士山と桜の写真。
서울의 거리 풍경, 밤의 불빛과 사람들.
Москва зимой, красная площадь под снегом, фотография.
مدينة قديمة في الصحراء عند غروب الشمس، مَدِينَةٌ قَدِيمَةٌ
किताब पढ़ती हुई एक लड़की, हिन्दी में किताबें, पहाड़ों की तस्वीर, किताबों की दुकान।
ภาพถ่ายของแมวสีขาว ภาษาไทย น้ำตก
שָׁלוֹם עוֹלָם, ציור של עיר עתיקה
A glass of water 🥤 and a slice of cake 🍰 on a plate, studio lighting ✨.
It's a sunny day, isn't it? We'll go to the park and we're going to paint the lake.
Numbers: 1, 2, 3, 42, 2026, 3.14 and 100% of the pixels.
{"layout": [{"box": [0, 0, 512, 512], "caption": "a tree"}], "style": "flat vector"}
"""


def byte_chars():
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stay, the rest go to U+0100.."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def learn_merges(corpus, count):
    """Greedy BPE on the pre-tokenized corpus: most frequent pair first, ties by the smaller pair."""
    chars = byte_chars()
    split = pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated")
    pieces = Counter(piece for piece, _ in split.pre_tokenize_str(unicodedata.normalize("NFC", corpus)))
    words = {tuple(chars[b] for b in piece.encode("utf-8")): n for piece, n in pieces.items()}
    merges = []
    for _ in range(count):
        pairs = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        joined = {}
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            joined[tuple(out)] = joined.get(tuple(out), 0) + n
        words = joined
    return merges


def build_tokenizer():
    chars = byte_chars()
    vocab = {chars[b]: b for b in range(256)}
    merges = learn_merges(CORPUS, MERGES)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    for content, special in SPECIAL_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    return tok


CHAT_TEMPLATE = """\
{%- macro render_content(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if item.type == 'image' or 'image' in item %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is not none and content is defined %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content)|trim %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
        {{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set thought = '' %}
        {%- if message.reasoning_content is string %}
            {%- set thought = message.reasoning_content|trim %}
        {%- elif '</think>' in content %}
            {%- set thought = content.split('</think>')[0].split('<think>')[-1]|trim %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.last and thought %}
            {{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""


def tokenizer_config(tok):
    added = {
        str(tok.token_to_id(content)): {"content": content, "lstrip": False, "normalized": False,
                                        "rstrip": False, "single_word": False, "special": special}
        for content, special in SPECIAL_TOKENS
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tiny_tokenizer(folder: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config = json.dumps(tokenizer_config(tok), indent=2, ensure_ascii=False)
    (folder / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def vocab_size() -> int:
    """Ids in use are 0 .. vocab_size() - 1 (BPE vocabulary, then the special tokens)."""
    return build_tokenizer().get_vocab_size(with_added_tokens=True)


if __name__ == "__main__":
    write_tiny_tokenizer(Path(sys.argv[1]))
    print(f"vocab size {vocab_size()}")
