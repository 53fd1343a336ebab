"""The computer-use agent: a LangGraph graph that operates a real headless Chromium, with a
KV-cache policy per node declared through agentkv's ``with_kv_policy``.

Graph (one ``invoke`` per user instruction; the ``thread_id`` keeps the session)::

    START -> act --tool call--> browser -> act -> ... --no tool call--> report -> END

- ``act`` (model call): reads the conversation, whose tool results are the browser's
  observations (the accessibility tree as text, the screenshot as an image part), and picks
  the next action: ``click(role, name)``, ``type(role, name, text, submit)``,
  ``scroll(direction)``, ``go_back()``; no tool call ends the instruction.
- ``browser`` (no model call, LangGraph's ``ToolNode``): runs the action in Chromium and
  answers with a tool message ``[accessibility tree (text), screenshot (image)]``. agentkv's client tags those parts
  ``obs|text`` and ``obs|image``; a turn runs from one user instruction to the next, so older
  screenshots age through the temporal buckets (``turn_m1``, ``turn_m2``, ``older``).
- ``report`` (model call): tells the user what was done.

Scripted mode (``--scripted``, the default with the tiny default model, which cannot operate
a browser): every model call still goes through the engine, but the action ``act`` takes is
the next step of a fixed plan (the model's own words are kept as the message text). With a
capable endpoint (``--base-url``, no ``--scripted``) the model picks the actions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import BaseTool, tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from .browser import Browser

SYSTEM = (
    "You operate a web browser for the user. After each action you get the page's "
    "accessibility tree and a screenshot. Act with one tool call at a time: "
    "click(role, name) and type(role, name, text, submit) take the role and the accessible "
    "name shown in the tree; scroll(direction) and go_back() move around. When the user's "
    "instruction is done, reply without a tool call."
)
REPORT = "Tell the user in one short sentence what you did on the website."


# ------------------------------------------------------------------------- the tools
def browser_tools(browser: Browser) -> list[BaseTool]:
    """The agent's tools on ``browser``. Each acts, then returns the observation as content
    blocks ``[accessibility tree (text), screenshot (image_url)]``, which LangGraph's
    ``ToolNode`` puts in the tool message as they are."""

    @tool
    def click(role: str, name: str) -> list[dict[str, Any]]:
        """Click the element with this ARIA role (link, button, ...) and accessible name."""
        return browser.click(role, name).content()

    @tool("type")
    def type_text(role: str, name: str, text: str, submit: bool = False) -> list[dict[str, Any]]:
        """Type text into the field with this role (textbox, searchbox) and accessible name;
        submit=true presses Enter afterwards."""
        return browser.type(role, name, text, submit).content()

    @tool
    def scroll(direction: Literal["down", "up"] = "down") -> list[dict[str, Any]]:
        """Scroll the page one screen down or up."""
        return browser.scroll(direction).content()

    @tool
    def go_back() -> list[dict[str, Any]]:
        """Go back to the previous page."""
        return browser.go_back().content()

    return [click, type_text, scroll, go_back]


# ---------------------------------------------------------------------- the task
@dataclass(frozen=True)
class Step:
    tool: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Turn:
    """One user instruction and, for scripted mode, the actions that carry it out."""

    instruction: str
    steps: tuple[Step, ...] = ()


DEMO_TASK: tuple[Turn, ...] = (
    Turn(
        "Find a blue mug in the shop.",
        (
            Step(
                "type",
                {
                    "role": "searchbox",
                    "name": "Search products",
                    "text": "blue mug",
                    "submit": True,
                },
            ),
        ),
    ),
    Turn(
        "Open it and add it to my cart.",
        (
            Step("click", {"role": "link", "name": "Blue ceramic mug"}),
            Step("click", {"role": "button", "name": "Add to cart"}),
        ),
    ),
    Turn(
        "What does the steel water bottle on the home page cost? Then come back to the cart.",
        (
            Step("click", {"role": "link", "name": "Home"}),
            Step("scroll", {"direction": "down"}),
            Step("scroll", {"direction": "up"}),
            Step("click", {"role": "link", "name": "Steel water bottle"}),
            Step("go_back"),
            Step("go_back"),
        ),
    ),
    Turn(
        "Check out: Ada Lovelace, ada@example.com, 12 Analytical Way.",
        (
            Step("click", {"role": "link", "name": "Checkout"}),
            Step("type", {"role": "textbox", "name": "Full name", "text": "Ada Lovelace"}),
            Step("type", {"role": "textbox", "name": "Email", "text": "ada@example.com"}),
            Step(
                "type", {"role": "textbox", "name": "Street address", "text": "12 Analytical Way"}
            ),
            Step("click", {"role": "button", "name": "Place order"}),
        ),
    ),
)
#: the short task the CI test runs
SHORT_TASK: tuple[Turn, ...] = DEMO_TASK[:2]


def _turn_position(messages: Sequence[Any]) -> tuple[int, int]:
    """(index of the current user instruction, tool results since it)."""
    humans = [i for i, m in enumerate(messages) if isinstance(m, HumanMessage)]
    last = humans[-1] if humans else -1
    steps = sum(isinstance(m, ToolMessage) for m in messages[last + 1 :])
    return len(humans) - 1, steps


def build_graph(
    llm: Any,
    browser: Browser,
    task: Sequence[Turn] | None = None,
    max_steps: int = 8,
    on_call: Callable[[str, AIMessage, float], None] | None = None,
) -> StateGraph:
    """The agent's ``StateGraph`` (compile it with ``with_kv_policy``).

    ``llm``: a LangChain chat model (``ChatOpenAI``); ``task``: the scripted plan (None: the
    model picks the actions); ``max_steps``: actions per instruction before ``report`` is
    forced; ``on_call(node, reply, seconds)``: called after each model call (progress).
    """
    tools = browser_tools(browser)
    actor = llm.bind_tools(tools)

    def timed(node: str, model: Any, messages: list[Any]) -> AIMessage:
        t0 = time.perf_counter()
        reply = model.invoke(messages)
        if on_call is not None:
            on_call(node, reply, time.perf_counter() - t0)
        return reply

    def act(state: MessagesState) -> dict[str, Any]:
        messages = state["messages"]
        reply = timed("act", actor, [SystemMessage(SYSTEM), *messages])
        turn, done = _turn_position(messages)
        if task is not None:  # scripted: the plan acts, the model's words stay as its text
            steps = task[turn].steps if turn < len(task) else ()
            calls = []
            if done < len(steps):
                s = steps[done]
                calls = [{"name": s.tool, "args": dict(s.args), "id": f"call_{turn}_{done}"}]
            reply = AIMessage(
                content=reply.content,
                tool_calls=calls,
                id=reply.id,
                response_metadata=reply.response_metadata,
            )
        elif done >= max_steps:
            reply = AIMessage(
                content=reply.content, id=reply.id, response_metadata=reply.response_metadata
            )
        return {"messages": [reply]}

    def report(state: MessagesState) -> dict[str, Any]:
        return {"messages": [timed("report", llm, [SystemMessage(REPORT), *state["messages"]])]}

    def route(state: MessagesState) -> str:
        return "browser" if state["messages"][-1].tool_calls else "report"

    graph = StateGraph(MessagesState)
    graph.add_node("act", act)
    graph.add_node("browser", ToolNode(tools))
    graph.add_node("report", report)
    graph.add_edge(START, "act")
    graph.add_conditional_edges("act", route, {"browser": "browser", "report": "report"})
    graph.add_edge("browser", "act")
    graph.add_edge("report", END)
    return graph


def instruction(turn: Turn, page_text: str) -> HumanMessage:
    """A user turn: the instruction and the page the browser shows now (text only; the
    screenshots come with the tool results)."""
    return HumanMessage(content=f"{turn.instruction}\n\nThe browser shows:\n{page_text}")
