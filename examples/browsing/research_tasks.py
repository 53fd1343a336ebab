"""The fixed research tasks: multi-turn questions whose answers are in the Wikipedia corpus.

Each turn is one user question. ``script`` is the tool calls a competent agent would make for
it (what ``--scripted`` replays, since the tiny default model rarely emits tool calls), and
``facts`` are strings the answer needs, each of which the scripted observations contain
(``tests/examples/test_browsing.py`` checks both against the real corpus). Later turns refer
back to earlier ones ("that engineer", "those two elements"), so the agent needs its history.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolStep:
    """One scripted tool call."""

    name: str  # "search", "open" or "find_in_page"
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Turn:
    question: str
    script: tuple[ToolStep, ...]
    facts: tuple[str, ...]


@dataclass(frozen=True)
class ResearchTask:
    name: str
    turns: tuple[Turn, ...]


def search(query: str) -> ToolStep:
    return ToolStep("search", {"query": query})


def open_page(title: str) -> ToolStep:
    return ToolStep("open", {"title": title})


def find(title: str, text: str) -> ToolStep:
    return ToolStep("find_in_page", {"title": title, "text": text})


TASKS: tuple[ResearchTask, ...] = (
    ResearchTask(
        "eiffel",
        (
            Turn(
                "Who is the Eiffel Tower named after, and when was it built?",
                (search("Eiffel Tower"), open_page("Eiffel Tower")),
                ("Gustave Eiffel", "1887", "1889"),
            ),
            Turn(
                "Which statue in New York did that engineer help build, and who designed it?",
                (
                    open_page("Gustave Eiffel"),
                    find("Gustave Eiffel", "Statue of Liberty"),
                    open_page("Statue of Liberty"),
                ),
                ("Statue of Liberty", "Bartholdi"),
            ),
            Turn(
                "When was that statue dedicated?",
                (find("Statue of Liberty", "dedicated"),),
                ("October 28, 1886",),
            ),
        ),
    ),
    ResearchTask(
        "curie",
        (
            Turn(
                "Which chemical elements did Marie Curie discover?",
                (search("Marie Curie elements discovered"), open_page("Marie Curie")),
                ("radium", "polonium"),
            ),
            Turn(
                "What are the atomic numbers of those two elements?",
                (
                    search("polonium radium atomic number"),
                    find("Polonium", "atomic number"),
                    find("Radium", "atomic number"),
                ),
                ("84", "88"),
            ),
            Turn(
                "Which Nobel Prizes did she win, and in which years?",
                (find("Marie Curie", "Nobel Prize"),),
                ("1903", "Physics", "1911", "Chemistry"),
            ),
        ),
    ),
    ResearchTask(
        "everest",
        (
            Turn(
                "Who were the first climbers confirmed on the summit of Mount Everest, and when?",
                (search("first climbers summit Mount Everest"), open_page("Edmund Hillary")),
                ("Edmund Hillary", "Tenzing Norgay", "29 May 1953"),
            ),
            Turn(
                "How high is that mountain, and which border runs across its summit?",
                (open_page("Mount Everest"), find("Mount Everest", "height")),
                ("8,848.86", "China–Nepal"),
            ),
        ),
    ),
)


def task_by_name(name: str) -> ResearchTask:
    for task in TASKS:
        if task.name == name:
            return task
    raise KeyError(f"no task {name!r}; tasks: {', '.join(t.name for t in TASKS)}")
