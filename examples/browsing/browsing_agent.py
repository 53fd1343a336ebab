"""A research agent on LangGraph: plan -> browse (tool loop) -> answer, one KV policy per node.

::

    START -> plan -> browse -> tools -> browse -> ... -> answer -> END
                       \\______________________________/

- ``plan`` reads the conversation (earlier turns included) and writes a short research plan;
- ``browse`` calls the model with the tools bound; its tool calls run in ``tools`` (LangGraph's
  ``ToolNode``) and the loop goes on until the model stops calling tools (or ``max_steps``);
- ``answer`` writes the answer from the pages read.

Nothing in the nodes is agentkv: :func:`build_agent` wraps the graph once with
``with_kv_policy(builder, default=..., nodes={...})`` and every ``ChatOpenAI`` call a node makes
carries its node's policy, the thread's session id and per-message tags to the server.

**One prefix for every node.** All nodes send the same system prompt with the same tools bound
(the server renders tool schemas into the system block); a node's own instruction comes last.
So each call extends the thread's cached sequence and the server prefills only what is new,
whichever node made the previous call. (A first version sent ``plan`` and ``answer`` no tools:
their system block then left ``browse``'s after 63 tokens, and as the thread's session keeps
the holes and quantized cells every node's policy made, ``browse``'s next call reused only
those 63 tokens and recomputed the rest.) ``plan`` and ``answer`` keep only the
text of their reply.

**Scripted mode.** A 135M model rarely emits a well-formed tool call. With ``scripted=True`` the
``browse`` node still calls the model on the same prompt (tools bound), then replaces the
reply's tool calls with the next step of the turn's script (``state["script"]``); the real
tools run on the real corpus, so the conversation, and the KV the server holds for it, is
the one a capable model would build. With ``scripted=False`` the model picks the tools.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.tools import BaseTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from agentkv import FullCache, IntentKV, KVPolicy, SnapKV, UniformQuant
from agentkv.integrations.langgraph import with_kv_policy

SYSTEM_PROMPT = (
    "You are a research assistant with an offline encyclopedia. Find facts with the tools: "
    "search(query) lists articles, open(title) reads one, find_in_page(title, text) finds "
    "sentences in one. Answer only from what you have read, and name the articles you used."
)
#: Node instructions come last (after the history), so every node's prompt starts with the
#: same system prompt and tool schemas and extends the thread's cached prefix.
PLAN_PROMPT = "List the encyclopedia articles to search for and open to answer: {question}"
ANSWER_PROMPT = "From the articles read above, answer in one or two sentences: {question}"

#: Each node's KV policy, chosen for what the node reads:
#: - plan: the whole conversation once per turn; older pages matter little -> SnapKV keeps the
#:   positions the latest question attends to;
#: - browse: the tool loop, the most calls and the most tokens; the latest page is what
#:   decides the next call -> IntentKV keeps the instructions, tool schemas and the latest
#:   tool result (its forced set) and scores the older pages;
#: - answer: must be able to quote any page read -> every token kept, at 4 bits
#:   (UniformQuant; the latest 128 tokens stay at full precision).
NODE_POLICIES: dict[str, KVPolicy] = {
    "plan": SnapKV(budget=512),
    "browse": IntentKV(budget=768),
    "answer": UniformQuant(bits=4),
}
#: The policy of nodes without one (the graph's only model-calling nodes have one).
DEFAULT_POLICY: KVPolicy = FullCache()


def text_only(reply: AIMessage, tool_calls: Sequence[dict[str, Any]] = ()) -> AIMessage:
    """``reply`` with its tool calls replaced by ``tool_calls`` (none: a text reply); the
    server's metadata (KV telemetry included) is kept."""
    return AIMessage(
        content=reply.content,
        tool_calls=list(tool_calls),
        id=reply.id,
        response_metadata=reply.response_metadata,
        usage_metadata=reply.usage_metadata,
    )


def latest_question(state: MessagesState) -> str:
    """The content of the latest user message."""
    return next(
        (str(m.content) for m in reversed(state["messages"]) if isinstance(m, HumanMessage)), ""
    )


class ResearchState(MessagesState):
    """The conversation, plus the browse loop's bookkeeping for the current turn."""

    script: list[dict[str, Any]]  # scripted tool calls still to make this turn
    steps: int  # browse calls made this turn


def build_graph(
    llm: BaseChatModel,
    tools: Sequence[BaseTool],
    scripted: bool = True,
    max_steps: int = 4,
    scripted_reply_tokens: int = 8,
) -> StateGraph:
    """The agent's ``StateGraph`` (not compiled): nodes plan, browse, tools, answer.

    ``max_steps``: browse calls per turn when the model picks the tools. In scripted mode the
    browse replies are cut at ``scripted_reply_tokens`` (their tool call comes from the
    script, only their text stays in the history)."""
    llm_with_tools = llm.bind_tools(list(tools))

    def plan(state: ResearchState) -> dict[str, Any]:
        ask = SystemMessage(PLAN_PROMPT.format(question=latest_question(state)))
        prompt = [SystemMessage(SYSTEM_PROMPT), *state["messages"], ask]
        return {"messages": [text_only(llm_with_tools.invoke(prompt))], "steps": 0}

    def browse(state: ResearchState) -> dict[str, Any]:
        prompt = [SystemMessage(SYSTEM_PROMPT), *state["messages"]]
        if scripted:
            reply = llm_with_tools.invoke(prompt, max_tokens=scripted_reply_tokens)
        else:
            reply = llm_with_tools.invoke(prompt)
        update: dict[str, Any] = {"steps": state.get("steps", 0) + 1}
        if scripted:
            script = list(state.get("script") or [])
            calls = []
            if script:
                step = script.pop(0)
                call_id = f"call_{len(state['messages'])}"
                calls = [{"name": step["name"], "args": step["args"], "id": call_id}]
            reply = text_only(reply, tool_calls=calls)
            update["script"] = script
        update["messages"] = [reply]
        return update

    def answer(state: ResearchState) -> dict[str, Any]:
        ask = SystemMessage(ANSWER_PROMPT.format(question=latest_question(state)))
        prompt = [SystemMessage(SYSTEM_PROMPT), *state["messages"], ask]
        return {"messages": [text_only(llm_with_tools.invoke(prompt))]}

    def after_browse(state: ResearchState) -> Literal["tools", "answer"]:
        last = state["messages"][-1]
        return "tools" if getattr(last, "tool_calls", None) else "answer"

    def after_tools(state: ResearchState) -> Literal["browse", "answer"]:
        if scripted:
            return "browse" if state.get("script") else "answer"
        return "browse" if state.get("steps", 0) < max_steps else "answer"

    builder = StateGraph(ResearchState)
    builder.add_node("plan", plan)
    builder.add_node("browse", browse)
    builder.add_node("tools", ToolNode(list(tools)))
    builder.add_node("answer", answer)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "browse")
    builder.add_conditional_edges("browse", after_browse)
    builder.add_conditional_edges("tools", after_tools)
    builder.add_edge("answer", END)
    return builder


def build_agent(
    llm: BaseChatModel,
    tools: Sequence[BaseTool],
    *,
    scripted: bool = True,
    default: KVPolicy | str = DEFAULT_POLICY,
    nodes: Mapping[str, KVPolicy | str] | None = None,
    max_steps: int = 4,
):
    """The compiled agent, with a checkpointer (turns of a thread share their history) and
    one KV policy per node: ``nodes`` (default :data:`NODE_POLICIES`) over ``default``."""
    return with_kv_policy(
        build_graph(llm, tools, scripted=scripted, max_steps=max_steps),
        default=default,
        nodes=dict(NODE_POLICIES if nodes is None else nodes),
        checkpointer=InMemorySaver(),
    )


def turn_input(question: str, script: Sequence[Any] = ()) -> dict[str, Any]:
    """The graph input of one user turn; ``script``: ``ToolStep``-like objects (``.name``,
    ``.args``) for scripted mode."""
    return {
        "messages": [("user", question)],
        "script": [{"name": s.name, "args": dict(s.args)} for s in script],
        "steps": 0,
    }
