"""A memo of prompt encodings for the replay benchmark (one process, trusted input).

The replay sends the same conversation prefix once per policy (and once for the FullCache
reference) at every turn, and the engine renders, tokenizes and tags it each time: on the
GPU that is ~20% of a request (docs/benchmarks.md §6d's profile: 79 ms of ~0.4 s). The
replay wraps the engine's renderer in :class:`MemoRenderer`, which returns a copy of the
first encoding of identical inputs.

Not for the server: a memo shared by tenants would let one tenant time whether another sent
the same messages (the prefix cache is namespaced per tenant for the same reason).
"""

from __future__ import annotations

import copy
import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from agentkv.token_tagger import TokenTags


class MemoRenderer:
    """Wraps a :class:`~agentkv.engine.chat_template.ChatRenderer`; ``encode`` is memoised
    (LRU of ``capacity`` entries keyed by a hash of its pickled arguments), everything else
    is the wrapped renderer's. Inputs that do not pickle are encoded every time."""

    def __init__(self, renderer: Any, capacity: int = 64):
        self.inner = renderer
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._memo: OrderedDict[bytes, TokenTags] = OrderedDict()

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def encode(
        self,
        messages: Sequence[Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
        annotations: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> TokenTags:
        try:
            raw = pickle.dumps(
                (list(messages), tools, annotations, add_generation_prompt), protocol=5
            )
        except Exception:  # not picklable: no memo
            return self.inner.encode(messages, tools, annotations, add_generation_prompt)
        key = hashlib.blake2b(raw, digest_size=16).digest()
        tags = self._memo.get(key)
        if tags is None:
            self.misses += 1
            tags = self.inner.encode(messages, tools, annotations, add_generation_prompt)
            self._memo[key] = tags
            while len(self._memo) > self.capacity:
                self._memo.popitem(last=False)
        else:
            self.hits += 1
            self._memo.move_to_end(key)
        return copy.deepcopy(tags)  # callers own what they get
