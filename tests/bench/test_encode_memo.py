"""The replay's encoding memo returns exactly what the renderer returns, as a private copy."""

from __future__ import annotations

import pytest

from agentkv.annotation import annotate_messages
from agentkv.bench.encode_memo import MemoRenderer

MESSAGES = [
    {"role": "system", "content": "You are an airline agent."},
    {"role": "user", "content": "My user id is mia_li_3668; change my flight to SEA."},
    {"role": "assistant", "content": "Let me look that up."},
    {"role": "user", "content": "Thanks, the reservation is ABC123."},
]


@pytest.fixture(scope="module")
def renderer():
    from transformers import AutoTokenizer

    from agentkv.engine.chat_template import ChatRenderer
    from agentkv.engine.model_loader import resolve_model_dir

    return ChatRenderer(AutoTokenizer.from_pretrained(resolve_model_dir(None)))


def test_memo_hits_equal_fresh_encodings_and_are_private(renderer):
    memo = MemoRenderer(renderer, capacity=2)
    ann = annotate_messages(MESSAGES)
    first = memo.encode(MESSAGES, None, ann)
    assert first == renderer.encode(MESSAGES, None, ann)
    first.token_ids.append(-1)  # the caller's copy; the memo keeps its own
    again = memo.encode(MESSAGES, None, ann)
    assert again == renderer.encode(MESSAGES, None, ann)
    assert (memo.hits, memo.misses) == (1, 1)
    # other inputs are other entries: the shorter conversation, no generation prompt
    short = memo.encode(MESSAGES[:2], None, ann[:2])
    assert short == renderer.encode(MESSAGES[:2], None, ann[:2])
    bare = memo.encode(MESSAGES, None, ann, add_generation_prompt=False)
    assert bare != again and memo.misses == 3
    assert len(memo._memo) == 2  # LRU capacity
    assert memo.tokenizer is renderer.tokenizer  # everything else is the renderer's
