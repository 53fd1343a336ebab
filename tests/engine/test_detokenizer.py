"""IncrementalText against decoding the whole sequence again: after every token its text is
a prefix of the full decode, equal to it whenever the sequence ends on a whole character,
for real text in several scripts and for random token ids."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from agentkv.engine.detokenizer import IncrementalText

TEXTS = [
    "The quick brown fox jumps over the lazy dog. def f(x):\n    return x * 2  # ok",
    "Ünïcödé façade — naïve café; 東京の天気は晴れです。 Привет, мир! 🚀🔥 emoji 👩‍💻 done.",
    '<tool_call>\n{"name": "search", "arguments": {"q": "naïve Bayes"}}\n</tool_call>',
    "   leading spaces,\ttabs\n\n\nand    runs of spaces   ",
]


QWEN_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "qwen3-tokenizer"


@pytest.fixture(scope="module", params=["smollm2", "qwen3", "gemma3"])
def tokenizer(request):
    """Byte-level BPE (SmolLM2, Qwen3) and SentencePiece with byte fallback (Gemma 3: word
    starts as a leading space)."""
    from transformers import AutoTokenizer

    from agentkv.engine.model_loader import resolve_model_dir

    if request.param == "gemma3":
        return request.getfixturevalue("gemma3")
    if request.param == "qwen3":
        if not (QWEN_DIR / "tokenizer.json").is_file():
            pytest.skip(f"Qwen3 tokenizer not found at {QWEN_DIR}")
        return AutoTokenizer.from_pretrained(QWEN_DIR)
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def _check(tokenizer, ids: list[int]) -> None:
    inc = IncrementalText(tokenizer)
    for n, t in enumerate(ids, 1):
        text = inc.add(t)
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        assert full.startswith(text), (n, text[-20:], full[-20:])
        if not full.endswith("\ufffd"):
            assert text == full, (n, text[-20:], full[-20:])


@pytest.mark.parametrize("i", range(len(TEXTS)))
def test_real_text_decodes_as_a_whole(tokenizer, i):
    ids = tokenizer(TEXTS[i], add_special_tokens=False)["input_ids"]
    special = tokenizer.eos_token_id  # (a special token in between: skipped)
    _check(tokenizer, ids + [special] + ids[:5])


def test_random_ids_stay_a_prefix_of_the_whole(tokenizer):
    rng = random.Random(0)
    for _ in range(5):
        _check(tokenizer, [rng.randrange(tokenizer.vocab_size) for _ in range(200)])
